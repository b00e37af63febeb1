"""Training throughput lost to a checkpoint every N steps (target: <= 5%).

    python benchmarks/checkpoint_overhead.py                      # zero3.zs, gpt 4x256, 30 steps, every 10
    python benchmarks/checkpoint_overhead.py --reps 3 --every 10 --steps 30 --set model.width=384

Runs the same schedule (``programs/zero3.zs`` with a larger GPT through
``--set``) without checkpoints (A) and with ``--checkpoint-every N`` (B),
interleaved A B A B ... so that load from other processes hits both alike.
From each run's ``--metrics`` it takes the step times (step 0, which warms
up, excluded) and from the run summary the per-save cost: how long training
waited for the shards to be copied out (``blocking``) and how long the
writer thread took beside training (``writer``).

Three losses are printed, because a save costs in two ways: the median step
time (the writer thread competing with the steps for the CPU) and the mean
time per step with the blocking copies added (what a run of many steps
actually pays; the median alone would hide a save that happens on 1 step
in N). On a shared machine runs drift by tens of percent with other
processes' load, so a third figure is judged inside each checkpointing run:
the excess time of the steps during which the writer thread ran (the few
after each save) over the median of the other steps of the same run, plus
the blocking copies, per step. Save throughput is the checkpoint
folder's bytes over the writer's time; load throughput is
``load_for_rank`` of every rank's shards (checksums verified, page cache
dropped first) over its time.

Runs get ``MALLOC_MMAP_THRESHOLD_=65536`` in their environment (freed
buffers return to the OS, so runs do not inherit each other's heap state).

Save/load throughput of a checkpoint this small is its fixed costs, not the
disk's: see checkpoint_io.py for throughput. Results: benchmarks/README.md
(checkpoint_overhead.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkpoint_io import drop_cache   # benchmarks/ is on sys.path when this script runs

ROOT = Path(__file__).resolve().parent.parent
SCHEDULE = ROOT / "programs" / "zero3.zs"


def run_env() -> dict:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    return env


def zdsl_run(schedule: Path, sets: list[str], metrics: Path, extra: list[str]) -> tuple[list[dict], str, float]:
    """One ``zdsl run``; returns (metrics rows, stdout, wall seconds). Not --quiet: the summary
    table is where the per-save cost is printed."""
    cmd = [sys.executable, "-c", "import sys; from zdsl.cli import main; sys.exit(main())",
           "run", str(schedule), "--metrics", str(metrics)]
    for s in sets:
        cmd += ["--set", s]
    cmd += extra
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env(), cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return rows, proc.stdout, wall


def parse_save_cost(stdout: str) -> dict | None:
    """The summary's "checkpoint saves" row (rich may wrap it: join the lines first)."""
    flat = re.sub(r"\s*\n\s*│?\s*", " ", stdout)
    flat = re.sub(r"│", " ", flat)
    flat = re.sub(r"\s+", " ", flat)
    m = re.search(r"checkpoint saves (\d+) x ([\d.]+ ?\w+) per rank: training waited ([\d.]+) ms, writer ([\d.]+) ms",
                  flat)
    if not m:
        return None
    return {"saves": int(m.group(1)), "bytes_per_rank": m.group(2), "blocking_ms": float(m.group(3)),
            "writer_ms": float(m.group(4))}


def within_run_loss(rows: list[dict], every: int, save: dict | None) -> float | None:
    """Share of throughput lost, judged inside one run with checkpoints (immune to the load
    drifting between runs): the excess of the steps during which the writer ran (the few after
    each save) over the median of the other steps, plus the blocking copies, per step."""
    if not save:
        return None
    times = {r["step"]: r["step_s"] for r in rows if r["step"] > 0}
    saves_after = [s for s in times if (s + 1) % every == 0 and s + 1 < max(times) + 1]   # mid-run saves
    plain = sorted(times.values())
    base = plain[len(plain) // 2]
    span = int(save["writer_ms"] / 1000 / base) + 1          # steps the writer overlaps
    affected = {s + k for s in saves_after for k in range(1, span + 1) if s + k in times}
    others = sorted(t for s, t in times.items() if s not in affected)
    base = others[len(others) // 2] if others else base
    if not saves_after:
        return None
    per_save = sum(times[s] - base for s in affected) / len(saves_after) + save["blocking_ms"] / 1000
    return per_save / (every * base)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())



def load_seconds(step_dir: Path) -> tuple[float, int]:
    """Time to load every rank's shards of one checkpoint (verified), page cache dropped first."""
    from zdsl.runtime.checkpoint.reader import load_for_rank
    from zdsl.runtime.checkpoint.reader import read_index
    index = read_index(step_dir)
    layouts = [u.layout for u in index.units]
    ranks = layouts[0].ranks
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    drop_cache(files)
    t0 = time.perf_counter()
    for r in range(ranks):
        load_for_rank(step_dir, r, ranks, layouts)
    return time.perf_counter() - t0, sum(p.stat().st_size for p in files)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", type=Path, default=SCHEDULE)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--reps", type=int, default=3, help="A/B pairs, interleaved")
    p.add_argument("--set", dest="sets", action="append", default=None,
                   help="extra overrides (default: model.layers=4 model.width=256)")
    p.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder under /tmp)")
    args = p.parse_args(argv)
    sets = (args.sets if args.sets is not None else ["model.layers=4", "model.width=256"]) + [f"steps={args.steps}"]
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="zdsl-ckpt-overhead-"))
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"schedule {args.schedule.name} --set {' '.join(sets)}; checkpoint every {args.every}; "
          f"{args.reps} x (A: none, B: checkpoints), MALLOC_MMAP_THRESHOLD_=65536", flush=True)
    results = {"A": [], "B": []}
    try:
        for rep in range(args.reps):
            for tag in ("A", "B"):
                ckpt = scratch / f"ckpt-{rep}"
                extra = ["--checkpoint-every", str(args.every), "--checkpoint-dir", str(ckpt)] if tag == "B" else []
                rows, out, wall = zdsl_run(args.schedule, sets, scratch / f"{tag}{rep}.jsonl", extra)
                times = [r["step_s"] for r in rows if r["step"] > 0]
                res = {"median": statistics.median(times), "mean": statistics.fmean(times), "wall": wall,
                       "loss": (rows[0]["loss"], rows[-1]["loss"])}
                if tag == "B":
                    res["save"] = parse_save_cost(out)
                    res["within"] = within_run_loss(rows, args.every, res["save"])
                    steps_dirs = sorted(d for d in ckpt.iterdir() if d.is_dir())
                    res["ckpt_bytes"] = folder_bytes(steps_dirs[-1]) if steps_dirs else 0
                    res["load"] = load_seconds(steps_dirs[-1]) if steps_dirs else None
                results[tag].append(res)
                save = res.get("save")
                print(f"  rep {rep} {tag}: median step {res['median'] * 1000:7.1f} ms  mean {res['mean'] * 1000:7.1f} ms"
                      f"  loss {res['loss'][0]:.3f}->{res['loss'][1]:.3f}  wall {wall:5.1f} s"
                      + (f"  save: waited {save['blocking_ms']:.1f} ms, writer {save['writer_ms']:.1f} ms"
                         if save else ""), flush=True)
                if tag == "B":
                    shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)

    a_med = statistics.median(r["median"] for r in results["A"])
    b_med = statistics.median(r["median"] for r in results["B"])
    a_mean = statistics.median(r["mean"] for r in results["A"])
    b_mean = statistics.median(r["mean"] for r in results["B"])
    saves = [r["save"] for r in results["B"] if r["save"]]
    blocking_s = statistics.median(s["blocking_ms"] for s in saves) / 1000 if saves else 0.0
    writer_s = statistics.median(s["writer_ms"] for s in saves) / 1000 if saves else 0.0
    # per step, a save every `every` steps costs its blocking copy once
    b_paid = b_mean + blocking_s / args.every
    lost_median = (b_med / a_med - 1) * 100
    lost = (b_paid / a_mean - 1) * 100
    ckpt_bytes = statistics.median(r["ckpt_bytes"] for r in results["B"])
    loads = [r["load"] for r in results["B"] if r["load"]]
    print()
    print(f"{'':28}{'no checkpoints':>16}{'every ' + str(args.every):>16}")
    print(f"{'median step (ms)':28}{a_med * 1000:16.1f}{b_med * 1000:16.1f}")
    print(f"{'mean step (ms)':28}{a_mean * 1000:16.1f}{b_mean * 1000:16.1f}")
    print(f"{'mean step + save wait (ms)':28}{a_mean * 1000:16.1f}{b_paid * 1000:16.1f}")
    print()
    print(f"per save (run summary, median): training waited {blocking_s * 1000:.1f} ms, "
          f"writer {writer_s * 1000:.1f} ms beside training; checkpoint {ckpt_bytes / 1e6:.1f} MB (all ranks)")
    if writer_s > 0:
        print(f"save throughput: {ckpt_bytes / writer_s / 1e9:.3f} GB/s (folder bytes / writer time; "
              f"ranks write concurrently)")
    if loads:
        load_s = statistics.median(s for s, _ in loads)
        print(f"load throughput: {ckpt_bytes / load_s / 1e9:.3f} GB/s (load_for_rank of every rank, verified, "
              f"page cache dropped; {load_s * 1000:.1f} ms)")
    within = [r["within"] for r in results["B"] if r.get("within") is not None]
    within_pct = statistics.median(within) * 100 if within else float("nan")
    print(f"median step time change between runs: {lost_median:+.1f}% (runs drift with the machine's load)")
    print(f"within the checkpointing runs (steps beside the writer + blocking copies vs the other steps): "
          f"{within_pct:.1f}% lost (per run: {', '.join(f'{w * 100:.1f}%' for w in within)})")
    print(f"throughput lost to a save every {args.every} steps: {lost:.1f}% (target <= 5%)")
    print(json.dumps({"lost_pct": round(lost, 2), "within_run_lost_pct": round(within_pct, 2), "lost_median_pct": round(lost_median, 2),
                      "a_median_s": a_med, "b_median_s": b_med, "a_mean_s": a_mean, "b_mean_s": b_mean,
                      "blocking_s": blocking_s, "writer_s": writer_s, "ckpt_bytes": ckpt_bytes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
