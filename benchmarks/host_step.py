"""Host optimizer step: parameters per second of zdsl's host AdamW against its peers.

Peers on the same flat fp32 shard: ``torch.optim.AdamW`` single-tensor
(``foreach=False``, the bitwise reference and torch's CPU default),
``foreach=True`` and ``fused=True``, and DeepSpeed's ``DeepSpeedCPUAdam``
where deepspeed is importable (it is not installed by this benchmark).
zdsl runs twice: ``exact`` (default; bitwise equal to ``foreach=False``) and
``fused=True`` (bitwise equal to torch's fused step). Rounds alternate over
all candidates so that load from other processes hits each alike; the
figures are the best of ``--rounds`` (a step is deterministic work, so the
fastest run is the one least disturbed), by wall clock and per CPU-second
of the process (all threads; what the step costs, and steadier on a shared
machine). Every candidate steps the same four tensors, moments included.

Where the shard's pages landed moves every candidate's rate by up to a
third (the same loop on a fresh allocation of the same size), more than the
candidates differ. So each
size is measured on ``--allocations`` fresh sets of tensors and the table
shows, per candidate, the median over them of its best round, and the ratio
is the median of the per-allocation ratios.

    python benchmarks/host_step.py [--sizes 1M,16M,64M] [--rounds 7] [--allocations 5] [--threads N]

On a machine shared with other busy processes, multi-threaded steps (all of
them: torch's OpenMP loops, DeepSpeed's, ours) wait at every join for the
thread that was descheduled, and their timings swing by 10x or more;
``--threads 1`` compares the implementations themselves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

from zdsl.runtime.offload.host_adam import exact_backend

from zdsl.runtime.offload.host_adam import host_adamw_

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
# Standard deviations of parameters and gradients: "gpt" as in training a GPT (init 0.02,
# gradients around 1e-3), "unit" as the first version of this benchmark had them.
VALUE_SCALES = {"gpt": (0.02, 1e-3), "unit": (1.0, 1.0)}


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
        # The same moments as every other candidate: left to itself DeepSpeed allocates its own
        # at the first step, and the step's speed then depends on where those pages landed.
        ds.state[param] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
        runs["DeepSpeedCPUAdam"] = ds.step
    return runs


def measure(n: int, rounds: int, seed: int = 0, values: str = "gpt") -> tuple[dict[str, float], dict[str, float]]:
    """Best parameters/s per candidate on one fresh allocation: by wall clock, and per
    CPU-second of this process (all its threads): the second is what a step costs, and
    moves less when other processes take the cores away."""
    gen = torch.Generator().manual_seed(seed)
    scale_p, scale_g = VALUE_SCALES[values]
    p = torch.randn(n, generator=gen) * scale_p
    g = torch.randn(n, generator=gen) * scale_g
    m = torch.zeros(n)
    v = torch.zeros(n)
    runs = candidates(p, g, m, v)
    wall = {name: float("inf") for name in runs}
    cpu = {name: float("inf") for name in runs}
    with torch.no_grad():
        for name, run in runs.items():  # warm up: first-call costs (kernel build, lazy imports)
            run()
        for _ in range(rounds):
            for name, run in runs.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                run()
                wall[name] = min(wall[name], time.perf_counter() - start)
                cpu[name] = min(cpu[name], time.process_time() - start_cpu)
    return ({name: n / seconds for name, seconds in wall.items()},
            {name: n / max(seconds, 1e-9) for name, seconds in cpu.items()})


def ratios_to_best_peer(rates: dict[str, float]) -> dict[str, float]:
    best = max(r for k, r in rates.items() if not k.startswith("zdsl"))
    return {k: r / best for k, r in rates.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,16M,64M", help="shard sizes in parameters, comma separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--allocations", type=int, default=5, help="fresh tensor sets per size (median over them)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads for every candidate (torch.set_num_threads); default: torch's")
    ap.add_argument("--values", choices=sorted(VALUE_SCALES), default="gpt",
                    help="magnitudes of parameters and gradients (gpt: 0.02 and 1e-3)")
    args = ap.parse_args(argv)
    if args.threads > 0 and os.environ.get("OMP_NUM_THREADS") != str(args.threads):
        # DeepSpeedCPUAdam's OpenMP loop ignores torch.set_num_threads (under --threads 1 it
        # still runs on every core); OpenMP reads OMP_NUM_THREADS when it loads,
        # so start again with it set and every candidate gets the same threads.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        given = sys.argv[1:] if argv is None else list(argv)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *given])
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        sizes = [parse_count(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        print(f"--sizes: expected counts like 1M,16M,64M, got {args.sizes!r}")
        return 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}), {args.values} values, best of {args.rounds} rounds, "
          f"median over {args.allocations} allocations; Mparams/s by wall clock and per CPU-second "
          "(ratio = ours / best peer)")
    for n in sizes:
        per_alloc = [measure(n, args.rounds, seed, args.values) for seed in range(args.allocations)]
        names = list(per_alloc[0][0])
        print(f"\nshard {n / (1 << 20):g}M parameters ({args.allocations} allocations)")
        print(f"  {'':28s} {'wall':>9s} {'ratio':>7s} {'per cpu-s':>10s} {'ratio':>7s}")
        table = {}
        for which in (0, 1):   # wall, cpu
            rates = {k: statistics.median(a[which][k] for a in per_alloc) for k in names}
            ratio = {k: statistics.median(ratios_to_best_peer(a[which])[k] for a in per_alloc) for k in names}
            table[which] = (rates, ratio)
        for name in names:
            mine = name.startswith("zdsl")
            rw = f"{table[0][1][name]:6.2f}x" if mine else ""
            rc = f"{table[1][1][name]:6.2f}x" if mine else ""
            print(f"  {name:28s} {table[0][0][name] / 1e6:9.0f} {rw:>7s} {table[1][0][name] / 1e6:10.0f} {rc:>7s}")
        exact = next(k for k in names if k.startswith("zdsl exact"))
        each = " ".join(f"{ratios_to_best_peer(a[0])[exact]:.2f}" for a in per_alloc)
        print(f"  exact / best peer, wall, per allocation: {each}")
        wall = table[0][0]
        print(f"  exact vs torch foreach=False (same bits): {wall[exact] / wall['torch foreach=False']:.2f}x wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
