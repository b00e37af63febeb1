"""Host optimizer step: parameters per second of zdsl's host AdamW against its peers.

Peers on the same flat fp32 shard: ``torch.optim.AdamW`` single-tensor
(``foreach=False``, the bitwise reference and torch's CPU default),
``foreach=True`` and ``fused=True``, and DeepSpeed's ``DeepSpeedCPUAdam``
where deepspeed is importable (it is not installed by this benchmark).
zdsl runs twice: ``exact`` (default; bitwise equal to ``foreach=False``) and
``fused=True`` (bitwise equal to torch's fused step). Rounds alternate over
all candidates so that load from other processes hits each alike; the
figure is the best of ``--rounds`` (a step is deterministic work, so the
fastest run is the one least disturbed).

    python benchmarks/host_step.py [--sizes 1M,16M,64M] [--rounds 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch

from zdsl.runtime.host_adam import exact_backend, host_adamw_

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def candidates(p, g, m, v) -> dict[str, Callable[[], None]]:
    """One step function per implementation, all on the same four tensors."""
    step = {"n": 0}

    def ours(fused: bool) -> Callable[[], None]:
        def run() -> None:
            step["n"] += 1
            host_adamw_(p, g, m, v, step["n"], LR, BETAS[0], BETAS[1], EPS, WD, fused=fused)

        return run

    def torch_optim(**kwargs) -> Callable[[], None]:
        param = torch.nn.Parameter(p, requires_grad=True)  # shares p's storage
        param.grad = g
        opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kwargs)
        opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
        return opt.step

    runs = {
        f"zdsl exact ({exact_backend()})": ours(False),
        "zdsl fused=True": ours(True),
        "torch foreach=False": torch_optim(foreach=False),
        "torch foreach=True": torch_optim(foreach=True),
        "torch fused=True": torch_optim(fused=True),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - any failure to import or build means: not available here
        print(f"DeepSpeedCPUAdam: skipped ({type(e).__name__}: {str(e)[:80]})")
    else:
        param = torch.nn.Parameter(p, requires_grad=True)
        param.grad = g
        ds = DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        runs["DeepSpeedCPUAdam"] = ds.step
    return runs


def measure(n: int, rounds: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    runs = candidates(p, g, m, v)
    best = {name: float("inf") for name in runs}
    with torch.no_grad():
        for name, run in runs.items():  # warm up: first-call costs (kernel build, lazy imports)
            run()
        for _ in range(rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    return {name: n / seconds for name, seconds in best.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,16M,64M", help="shard sizes in parameters, comma separated")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    try:
        sizes = [parse_count(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        print(f"--sizes: expected counts like 1M,16M,64M, got {args.sizes!r}")
        return 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.rounds} rounds; "
          "Mparams/s (ratio = ours / best peer)")
    for n in sizes:
        rates = measure(n, args.rounds)
        peers = {k: r for k, r in rates.items() if not k.startswith("zdsl")}
        best_peer = max(peers, key=peers.get)
        print(f"\nshard {n / (1 << 20):g}M parameters (best peer: {best_peer})")
        for name, rate in rates.items():
            ratio = f"{rate / peers[best_peer]:6.2f}x" if name.startswith("zdsl") else ""
            print(f"  {name:28s} {rate / 1e6:9.0f} {ratio}")
        exact = next(k for k in rates if k.startswith("zdsl exact"))
        print(f"  exact vs torch foreach=False (same bits): {rates[exact] / rates['torch foreach=False']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
