"""Step time with parameters and optimizer state on NVMe against the same in host memory (target: <= 1.3x).

    python benchmarks/nvme_vs_host.py                                 # gpt 4x768 (~29M params), 2 ranks, batch 16
    python benchmarks/nvme_vs_host.py --prefetch 1,2,4 --reps 2 --steps 8 --set precision=bf16

One ZeRO-3 schedule (``programs/nvme.zs``: parameters and optimizer state
on NVMe, the step on the host) run twice per prefetch depth: as written
(``nvme``) and with ``--set offload.parameters=cpu --set
offload.optimizer=cpu`` (``host``), same model, ranks, data and steps. The
pairs are interleaved (host, nvme, host, nvme, ...) so that load from other
processes hits both alike; each run's median step time comes from its
``--metrics`` with step 0 (warm-up, file creation) excluded, and the table
shows the median over repeats and the ratio nvme/host per depth. Prefetch
sets how far ahead parameter reads (and optimizer-state reads) run, so a
deep enough prefetch should hide the NVMe reads behind compute.

The ratio depends on compute per byte moved: each step reads the
parameters twice and reads and writes the optimizer state (16 bytes per
parameter moved, fp32 Adam, whatever the batch), while compute grows with
the batch. On a machine of few cores the NVMe cost is CPU more than disk
latency: the swapper's I/O threads (checksums, staging copies) take cycles
from the compute lane, so a small batch shows the largest ratio, and single
runs swing with other processes' load. Results: benchmarks/README.md
(nvme_vs_host.py).

Runs get ``MALLOC_MMAP_THRESHOLD_=65536`` in their environment.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_overhead import ROOT, zdsl_run  # noqa: E402  (benchmarks/ is not a package)

SCHEDULE = ROOT / "programs" / "nvme.zs"
HOST = ["offload.parameters=cpu", "offload.optimizer=cpu"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", type=Path, default=SCHEDULE)
    p.add_argument("--prefetch", default="1,2,4", help="comma-separated depths")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--set", dest="sets", action="append", default=None,
                   help="extra overrides (default: model.layers=4 model.width=768 model.heads=12 "
                        "model.context=64 data.context=64 batch=16)")
    args = p.parse_args(argv)
    depths = [int(d) for d in args.prefetch.split(",")]
    base = (args.sets if args.sets is not None else
            ["model.layers=4", "model.width=768", "model.heads=12", "model.context=64", "data.context=64",
             "batch=16"])
    base = base + [f"steps={args.steps}"]
    from zdsl.model.units import gpt_parameter_count
    print(f"schedule {args.schedule.name} --set {' '.join(base)}; prefetch {depths}; {args.reps} reps; "
          f"MALLOC_MMAP_THRESHOLD_=65536", flush=True)
    times: dict[tuple[int, str], list[float]] = {}
    losses: dict[tuple[int, str], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="zdsl-nvme-vs-host-") as scratch:
        for rep in range(args.reps):
            for depth in depths:
                for tier in ("host", "nvme"):
                    sets = base + [f"prefetch={depth}"] + (HOST if tier == "host" else [])
                    rows, _, wall = zdsl_run(args.schedule, sets, Path(scratch) / f"{tier}{depth}-{rep}.jsonl",
                                             ["--quiet"])
                    med = statistics.median(r["step_s"] for r in rows if r["step"] > 0)
                    times.setdefault((depth, tier), []).append(med)
                    losses[(depth, tier)] = (rows[0]["loss"], rows[-1]["loss"])
                    print(f"  rep {rep} prefetch {depth} {tier:4}: median step {med * 1000:8.1f} ms  "
                          f"loss {rows[0]['loss']:.4f}->{rows[-1]['loss']:.4f}  wall {wall:5.1f} s", flush=True)
    print()
    print(f"{'prefetch':>8} {'host (ms)':>10} {'nvme (ms)':>10} {'nvme/host':>10}")
    result = {}
    for depth in depths:
        h = statistics.median(times[(depth, "host")])
        n = statistics.median(times[(depth, "nvme")])
        result[depth] = {"host_s": h, "nvme_s": n, "ratio": n / h}
        print(f"{depth:>8} {h * 1000:>10.1f} {n * 1000:>10.1f} {n / h:>10.2f}")
    best = min(result, key=lambda d: result[d]["ratio"])
    print(f"best: prefetch {best}, nvme/host {result[best]['ratio']:.2f} (target <= 1.3)")
    same = all(losses[(d, "host")] == losses[(d, "nvme")] for d in depths)
    print(f"losses identical between host and nvme runs: {same}")
    print(json.dumps({str(d): v for d, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
