"""How long `zdsl check` and `zdsl plan` take on a 1,000-unit schedule (target: under 1 s each),
and how compile time grows with the model's depth and with a file's length (target: linear).

The schedule is a GPT with 998 blocks (+ embedding and head = 1,000 units),
ZeRO-3 over 8 ranks with prefetch, bucketing and a memory budget, so every
compiler stage has work to do. Each command is timed in-process (the
compiler alone, best of a few runs after a warm-up) and as a subprocess
(what a user waits for, interpreter start-up and imports included).

The growth is the exponent k of a least-squares fit time ~ size^k over
doubling sizes, each size compiled in a fresh process (CPU seconds of the
compile alone, best of --repeat): the model's depth (--depths), with
Python's cyclic collector paused during the compile as `zdsl` does and,
for comparison, left on; and a schedule whose statement is repeated
(--repeats lines, each an error): the checker's cost per line.

    python benchmarks/compile_speed.py [--layers 998] [--repeat 3] [--depths 1000,2000,4000,8000]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

SCHEDULE = """\
schedule big "1,000 units: ZeRO-3 on 8 ranks"
model     gpt(layers={layers}, width=256, heads=4, vocab=512, context=128)
data      synthetic(vocab=512, context=128)
train     steps=10, batch=4, accumulate=2, precision=bf16
optimizer adamw(lr=1e-3, clip=1.0)
ranks     8 on cpu
zero      3
prefetch  parameters 2 units ahead
bucket    16MiB
memory    device 80GiB
"""


def best_of(fn, repeat: int) -> tuple[float, float]:
    """Best wall seconds and best CPU seconds (this process and its children) over ``repeat`` runs.

    CPU time is reported beside wall time because a shared machine's load
    inflates wall time; CPU time is what the compiler itself costs."""
    walls, cpus = [], []
    for _ in range(repeat):
        c0, w0 = cpu_seconds(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(cpu_seconds() - c0)
    return min(walls), min(cpus)


def cpu_seconds() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def in_process(path: str, command: list[str]) -> None:
    from zdsl.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([*command, path])
    if status != 0:
        raise SystemExit(f"zdsl {' '.join(command)} failed ({status}):\n{err.getvalue()}")


def subprocess_run(path: str, command: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", *command, path], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"zdsl {' '.join(command)} failed ({proc.returncode}):\n{proc.stderr}")


def stages(path: str) -> dict[str, float]:
    """Where the time goes, one stage at a time (one run)."""
    from zdsl.check.checker import load_schedule
    from zdsl.driver import compile_schedule
    from zdsl.driver import memo_units_for
    from zdsl.planner.report import build_plan
    from zdsl.planner.report import render_plan
    from zdsl.sim.simulate import simulate
    from zdsl.compile.verify import verify
    units_for = memo_units_for()
    out = {}
    t = time.perf_counter()
    schedule, _ = load_schedule(path, None, units_for)
    units = units_for(schedule.model)
    out["parse + check"] = time.perf_counter() - t
    t = time.perf_counter()
    graph = compile_schedule(schedule, units)
    out["lower + instantiate"] = time.perf_counter() - t
    t = time.perf_counter()
    sim = simulate(graph, schedule.machine)
    out["simulate"] = time.perf_counter() - t
    t = time.perf_counter()
    verify(graph, schedule, sim)
    out["verify"] = time.perf_counter() - t
    t = time.perf_counter()
    render_plan(build_plan(graph, schedule, sim))
    out["plan report"] = time.perf_counter() - t
    out["ops"] = len(graph.ops)
    out["units"] = len(graph.units)
    return out


# In a fresh process: warm up (imports, the parser's tables), then time one compile_file.
TIME_ONE = """\
import contextlib, sys, time
import zdsl.driver as driver
if sys.argv[3] == "on":                       # the collector left on, for comparison
    driver.gc_paused = contextlib.nullcontext
driver.compile_file(sys.argv[1], None, simulate=False)
t = time.process_time()
driver.compile_file(sys.argv[2], None, simulate=sys.argv[4] == "plan")
print(time.process_time() - t)
"""


def compile_cpu_seconds(warm: str, path: str, collector: str, what: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        proc = subprocess.run([sys.executable, "-c", TIME_ONE, warm, path, collector, what],
                              capture_output=True, text=True, check=True)
        best = min(best, float(proc.stdout.split()[-1]))
    return best


def exponent(sizes: list[int], seconds: list[float]) -> float:
    """k in seconds ~ size^k, by least squares on the logarithms."""
    xs, ys = [math.log(n) for n in sizes], [math.log(t) for t in seconds]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def growth(tmp: str, depths: list[int], repeats: list[int], repeat: int) -> None:
    warm = os.path.join(tmp, "warm.zs")
    with open(warm, "w") as f:
        f.write(SCHEDULE.format(layers=4))
    if len(depths) > 1:
        by_depth(tmp, warm, depths, repeat)
    if len(repeats) > 1:
        by_length(tmp, warm, repeats, repeat)


def by_depth(tmp: str, warm: str, depths: list[int], repeat: int) -> None:
    print(f"\ncompile (check + lower + verify + simulate) by depth; CPU seconds, best of {repeat}")
    print(f"{'layers':>8}{'collector paused':>18}{'collector on':>14}")
    paused, on = [], []
    for layers in depths:
        path = os.path.join(tmp, f"deep{layers}.zs")
        with open(path, "w") as f:
            f.write(SCHEDULE.format(layers=layers))
        paused.append(compile_cpu_seconds(warm, path, "paused", "plan", repeat))
        on.append(compile_cpu_seconds(warm, path, "on", "plan", repeat))
        print(f"{layers:>8}{paused[-1]:>18.2f}{on[-1]:>14.2f}")
    print(f"exponent (linear = 1.0): collector paused {exponent(depths, paused):.2f}, "
          f"on {exponent(depths, on):.2f}")


def by_length(tmp: str, warm: str, repeats: list[int], repeat: int) -> None:
    print(f"\ncheck of a schedule repeating `zero 3` (every repeat an error); CPU seconds, best of {repeat}")
    seconds = []
    for n in repeats:
        path = os.path.join(tmp, f"repeat{n}.zs")
        with open(path, "w") as f:
            f.write(SCHEDULE.format(layers=2) + "zero 3\n" * n)
        seconds.append(compile_cpu_seconds(warm, path, "paused", "check", repeat))
        print(f"{n:>8} lines {seconds[-1]:8.2f}")
    print(f"exponent (linear = 1.0): {exponent(repeats, seconds):.2f}")


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=998)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--depths", type=sizes, default=[1000, 2000, 4000, 8000],
                    help="model depths for the growth exponent (comma-separated; empty to skip)")
    ap.add_argument("--repeats", type=sizes, default=[25_000, 50_000, 100_000, 200_000],
                    help="repeated-statement counts for the checker's exponent")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.zs")
        with open(path, "w") as f:
            f.write(SCHEDULE.format(layers=args.layers))
        detail = stages(path)
        print(f"schedule: {detail.pop('units')} units, {detail.pop('ops'):,} ops")
        for name, secs in detail.items():
            print(f"  {name:<22}{secs * 1e3:8.1f} ms")
        rows = []
        for command in (["check"], ["plan"], ["plan", "--json"]):
            in_process(path, command)          # warm-up: imports, caches
            rows.append((" ".join(command),
                         best_of(lambda: in_process(path, command), args.repeat),
                         best_of(lambda: subprocess_run(path, command), args.repeat)))
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; seconds, best of {args.repeat}")
    print(f"{'command':<18}{'in-process':>11}{'(cpu)':>8}{'subprocess':>12}{'(cpu)':>8}   target < 1 s")
    worst = 0.0
    for name, (inproc, inproc_cpu), (sub, sub_cpu) in rows:
        verdict = "ok" if max(inproc, sub) < 1 else ("ok on cpu time" if max(inproc_cpu, sub_cpu) < 1 else "SLOW")
        print(f"zdsl {name:<13}{inproc:>11.3f}{inproc_cpu:>8.3f}{sub:>12.3f}{sub_cpu:>8.3f}   {verdict}")
        worst = max(worst, inproc_cpu, sub_cpu)
    if len(args.depths) > 1 or len(args.repeats) > 1:
        with tempfile.TemporaryDirectory() as tmp:
            growth(tmp, args.depths, args.repeats, args.repeat)
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
