"""The Python API's overhead: the same ZeRO-3 schedule trained by ``zdsl run`` and by a user loop.

    python benchmarks/api_overhead.py                     # vs_peers' GPT, 2 ranks, 5 interleaved rounds
    python benchmarks/api_overhead.py --steps 4 --reps 2 --layers 2 --width 128 --context 64

Both sides are vs_peers' jobs on its GPT at 2 ranks on gloo, each rank bound to its share of the
cores alike (zdsl's binding): ``zdsl3`` (``zdsl run FILE --set zero=3 --metrics OUT``, its own
loop) and ``zdsl3-api`` (``zdsl.initialize`` on the same schedule under torchrun, a loop of
``engine(x)``, ``engine.backward``, ``engine.step``; ``benchmarks/peers/zdsl_api_peer.py``).
Rounds are interleaved (run, api, run, api, ...) so a shared machine's drift falls on both.

What is timed, on both sides alike: the wall time per optimizer step of the whole training loop,
data included (``timing = "loop"``). For ``zdsl run``, the time from one step's metrics line
appearing to the next's: its batch made, the step graph, its metrics gathered over the ranks and
written. For the API, the time from one ``engine.step()``'s return to the next's on each rank:
the batch made, the three calls (each with its agreement of the ranks), the loss read; no barrier
between steps. A step counts as its slowest rank's; warm-up steps (at least 1: the first step of
``zdsl run`` has no line before it) are left out.

It prints each side's median step, the ratio api / run of the medians over every round's steps,
each round's ratio (round i's api over its run) and their spread, and the median CPU seconds a
step of the busiest rank (every thread, over the same span of the loop), which a shared host
moves less than the wall time. Target: within 5% (ratio <=
1.05). It also prints the largest difference of the per-step loss, which should be 0 (the API
trains ``zdsl run``'s bits).

Results: benchmarks/README.md (api_overhead)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.peers import BenchConfig  # noqa: E402
from benchmarks.vs_peers import (  # noqa: E402
    PEERS,
    Outcome,
    absorb,
    check_availability,
    job_config,
    max_loss_diff,
    run_job,
)

SIDES = ("zdsl3", "zdsl3-api")       # the baseline first
TARGET = 1.05


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="zdsl's Python API against zdsl run: the same schedule, 2 ranks.")
    p.add_argument("--steps", type=int, default=8, help="measured steps per round (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and not timed (default 2, at least 1)")
    p.add_argument("--reps", type=int, default=5, help="interleaved rounds of each side (default 5)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--job-timeout", type=float, default=540.0, help="seconds one job may take (default 540)")
    p.add_argument("--workdir", help="keep job folders (configs, logs, per-rank results) here")
    args = p.parse_args(argv)
    for name in ("steps", "reps", "layers", "width", "heads", "vocab", "context", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (zdsl run's first step has no metrics line before it)")
    if args.width % args.heads:
        p.error(f"--width {args.width} is not divisible by --heads {args.heads}")
    return args


def run_rounds(cfg: BenchConfig, reps: int, workdir: Path, timeout_s: float):
    """Each side ``reps`` times, interleaved; what each gave, and each side's median step per round."""
    from zdsl import env
    policy = env.get("ZDSL_GLOO_LOOP_POLICY")
    outcomes = {key: Outcome(PEERS[key]) for key in SIDES}
    rounds: dict[str, list[float]] = {key: [] for key in SIDES}
    check_availability(outcomes, cfg, workdir)
    for o in outcomes.values():     # the API side needs what zdsl run needs
        o.unavailable = o.unavailable or outcomes["zdsl3"].unavailable
    for rep in range(reps):
        for key, o in outcomes.items():
            if o.unavailable or o.failed:
                continue
            got = run_job(o.peer, job_config(o.peer, cfg, "equal", policy), workdir / f"{key}.rep{rep}", timeout_s)
            if isinstance(got, str):
                o.failed = got
                print(f"[round {rep + 1}/{reps}] {key}: failed ({got})", file=sys.stderr, flush=True)
                continue
            before = len(o.step_s)
            absorb(o, got)
            rounds[key].append(statistics.median(o.step_s[before:]))
            print(f"[round {rep + 1}/{reps}] {key}: median {rounds[key][-1]:.3f} s this round",
                  file=sys.stderr, flush=True)
    return outcomes, rounds


def report(outcomes: dict[str, Outcome], rounds: dict[str, list[float]]) -> bool:
    """Print each side's median, the ratio (overall and per round) and the loss difference; whether both ran."""
    for o in outcomes.values():
        if o.ok:
            print(f"  {o.peer.label:<24} median step {o.median_s:.4f} s over {len(o.step_s)} steps, "
                  f"final loss {o.loss[-1]:.4f}")
        else:
            print(f"  {o.peer.label:<24} {'unavailable' if o.unavailable else 'failed'}: "
                  f"{o.unavailable or o.failed}")
    run, api = (outcomes[k] for k in SIDES)
    if not (run.ok and api.ok):
        print("  api / run step time: n/a")
        return False
    ratio = api.median_s / run.median_s
    print(f"  api / run step time: {ratio:.3f} (target <= {TARGET:.2f}: {'met' if ratio <= TARGET else 'not met'})")
    per_round = [a / r for r, a in zip(*(rounds[k] for k in SIDES))]
    print(f"  per round: {' '.join(f'{x:.3f}' for x in per_round)} (median {statistics.median(per_round):.3f}, "
          f"spread {min(per_round):.3f}-{max(per_round):.3f})")
    if run.cpu_s and api.cpu_s:     # CPU seconds move less than wall time on a shared host
        cpu_run, cpu_api = statistics.median(run.cpu_s), statistics.median(api.cpu_s)
        print(f"  CPU s a step (busiest rank, every thread): run {cpu_run:.3f}, api {cpu_api:.3f}, "
              f"api / run {cpu_api / cpu_run:.3f}")
    diff = max_loss_diff(api.loss, run.loss)
    print(f"  max |loss(api) - loss(run)| per step: {'-' if diff is None else format(diff, '.2e')}")
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = BenchConfig(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab,
                      context=args.context, batch=args.batch, steps=args.steps, warmup=args.warmup,
                      extra={"timing": "loop"})     # both sides: the whole loop's wall time a step
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="api_overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")   # as vs_peers: both sides alike
    print(f"GPT layers={cfg.layers} width={cfg.width} heads={cfg.heads} vocab={cfg.vocab} "
          f"context={cfg.context}, ZeRO-3, 2 ranks on gloo bound to their cores, batch {cfg.batch} per rank, "
          f"{cfg.warmup} warm-up + {cfg.steps} measured steps, {args.reps} interleaved rounds; a step: the whole "
          f"loop's wall time, data included", flush=True)
    try:
        ok = report(*run_rounds(cfg, args.reps, workdir, args.job_timeout))
    except KeyboardInterrupt:
        print("api_overhead.py: interrupted", file=sys.stderr)
        return 130
    print(f"(job folders: {workdir})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
