"""How far ``zdsl plan``'s step time is from measurement, after calibration, per program.

    python benchmarks/prediction_error.py                   # calibrate, run a program; the next ...
    python benchmarks/prediction_error.py --machine /tmp/machine.zs --repeat 3 --explain

1. ``zdsl calibrate --out /tmp/machine.zs`` (or ``--machine FILE`` to reuse
   a profile). Where calibrate measured the reference off the machine's
   usual step and kept the cached profile, the round plans with that one,
   as ``zdsl plan`` would (:func:`kept_cached`: the cache holds another
   profile than the one calibrate wrote).
2. For every program in ``programs/`` that runs on CPU: plan it with the
   calibrated ``machine`` statement (``--set machine=...``: the same as
   ``include``-ing the profile, without writing a copy of the program) and
   run it, ``zdsl run --set steps=100 --metrics`` (``--repeat R`` rounds,
   alternating programs, to damp load from other processes).
3. Print predicted vs measured median step time (the first step excluded)
   and the raw error, then ``K/N programs within 15% raw``: the target
   (8 of 8, with the profile calibration by default measures,
   ``zdsl calibrate --quick``, and no drift correction; ``--calibration
   full`` for the full calibration).

Drift, and the control. On a shared host the machine's own speed drifts, by
tens of percent within minutes and more from one second to the next where the
work is bound by memory (other tenants share the memory bandwidth; a matmul
that stays in cache holds its rate); and a profile is only a claim about the
machine as it was when measured. So each program's run is flanked by runs of
calibrate's own reference schedule (``zdsl run`` of it, the same steps), and
the prediction is also given corrected for drift: replanned with the profile's
rates and fixed costs scaled by how the host ran the reference beside the
program against what the profile predicts for the reference (the ``drift``
column, the geometric mean of the runs before and after), its disk rates left
as measured (:func:`drifted_step`; for a program without disk I/O, the step
times the drift). A user has no reference run beside their job, so the target
is judged on the raw error; the corrected one, printed after it, says how much
of the raw error is the host's drift.
A quiet round. The target is for a quiet machine, and 0% steal and no other
process do not make one: the reference's step can move by tens of percent
within minutes with neither. So each round also says whether the host held its
speed: every run of the reference beside the programs within ``QUIET`` (10%)
of the step the round's calibration measured for it (the profile's comment). A
round that is not quiet compares two states of the host as much as the model
with the machine. (Not judged without the control, or with ``--machine``.) A
host that is never quiet for a whole round is quiet now and then: a run whose
references before and after were both within ``QUIET`` is a quiet run, and the
raw error over a program's quiet runs (:func:`quiet_errors`, pooled over
``--repeat`` rounds) is the nearest this host comes to what a quiet machine
would show (a run's own seconds may still move, with the reference's held).

``--no-control`` leaves the reference runs out (and then calibrates before
each program's run, ``--calibrate-each program``; with the control, one
calibration a round). The error per program is the median over rounds.

``--explain`` also records both traces and compares them op kind by op kind:
predicted and measured mean duration per op, and the time a step spends
between ops (measured step minus its critical path), which is what the rate
model does not see. (The fixed costs per op are the profile's: ``overhead``,
``kernel_overhead``, ``comm_overhead``, ``scatter_overhead``, measured by
calibrate.)
"""
from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.host_load import OutsideLoad             # noqa: E402
from zdsl.driver import compile_file                       # noqa: E402
from zdsl.sim.simulate import machine_of, simulate   # noqa: E402

TARGET = 0.15
# A quiet round: every run of the reference beside the programs within this of the step calibrate
# measured for it. A shared host's speed can move by tens of percent within minutes with no steal
# or other process to see; in such a round the raw error measures the host, not the model.
QUIET = 0.10
CHILD_ENV_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def zdsl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROP}
    return subprocess.run([sys.executable, "-m", "zdsl.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def machine_statement(path: str) -> str:
    """The value of the profile's ``machine`` statement (``cpu(flops=..., ...)``), on one line
    (calibrate writes it a setting a line: the lines up to the ')' that closes it)."""
    parts, depth = [], 0
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not parts and not line.startswith("machine "):
            continue
        parts.append(line[len("machine "):].strip() if not parts else line)
        depth += line.count("(") - line.count(")")
        if depth <= 0:
            return " ".join(parts).replace("( ", "(").replace(" )", ")")
    raise SystemExit(f"error: {path} has no complete `machine` statement")


def calibrate(out: str, disk: str | None = None, quiet: bool = False, quick: bool = True) -> None:
    """``zdsl calibrate`` into ``out``: ``--quick`` (what calibration by default runs) unless ``quick`` is off."""
    args = ["calibrate", "--out", out, "--no-progress"] + (["--quick"] if quick else []) \
        + (["--disk", disk] if disk else [])
    if not quiet:
        print(f"calibrating: zdsl {' '.join(a for a in args if a != '--no-progress')}", flush=True)
    proc = zdsl(*args)
    if proc.returncode != 0:
        raise SystemExit(f"error: zdsl calibrate failed ({proc.returncode}): {proc.stderr.strip()[-600:]}")


def cached_profile() -> tuple[str, float | None] | None:
    """(the machine statement ``zdsl plan`` uses, on one line, as :func:`machine_statement` gives
    it; the reference step it was fitted to, None where the cache does not say); None without a cache."""
    from zdsl.sim.profile_cache import profile_path
    try:
        cached = json.loads(profile_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return " ".join(cached["statement"].removeprefix("machine ").split()), cached.get("reference_s")


def kept_cached(measured: str) -> tuple[str, float | None] | None:
    """The cached profile where calibrate kept it for ``zdsl plan`` instead of caching ``measured``,
    the statement it wrote to --out (as :func:`machine_statement` reads it), as it does for a
    reference measured off the machine's usual step; None where the cache holds ``measured`` (or nothing)."""
    cached = cached_profile()
    return None if cached is None or cached[0] == measured else cached


def reference_step(path: str) -> str:
    """The reference step a profile's comment reports (``measured X ms a step``), or ''."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if "measured " in line and " a step" in line:
            return line.split("measured ", 1)[1].split(" a step", 1)[0]
    return ""


def reference_seconds(path: str) -> float | None:
    """The reference step a profile's comment reports, in seconds; None where it reports none."""
    text = reference_step(path)
    try:
        return float(text.removesuffix(" ms")) / 1e3 if text.endswith(" ms") else None
    except ValueError:
        return None


def steadiness(calibrated: list[float], beside: list[float]) -> tuple[float, float] | None:
    """(lowest, highest) ratio of the reference's runs ``beside`` the programs to the step the
    round's calibration(s) measured for it (their median); None without both."""
    if not calibrated or not beside:
        return None
    at = statistics.median(calibrated)
    return min(beside) / at, max(beside) / at


def is_quiet(ratios: tuple[float, float] | None) -> bool:
    return ratios is not None and 1 - QUIET <= ratios[0] and ratios[1] <= 1 + QUIET


def quiet_errors(results: list[dict]) -> dict[str, float]:
    """Per program, the median raw error over its runs the host ran at its calibrated speed (the
    reference before and after the run both quiet, :func:`is_quiet`), for a host that is quiet only
    now and then. Programs with no such run are left out."""
    out = {}
    for row in results:
        held = [p / m - 1 for p, m, q in zip(row["predicted_runs_s"], row["runs_s"], row["quiet_runs"]) if q]
        if held:
            out[row["program"]] = statistics.median(held)
    return out


def reference_program(folder: str, steps: int) -> str:
    """calibrate's reference schedule as a file ``zdsl run`` can run (the control)."""
    from zdsl.runtime.calibrate.reference import reference_text
    path = os.path.join(folder, "reference.zs")
    Path(path).write_text(reference_text(steps, 2, "cpu"), encoding="utf-8")
    return path


# What the host's drift moves, as the control measures it (compute, memory, gloo, the runtime's own
# costs): rates are divided by the drift and fixed times multiplied. The disk's are left alone: the
# control does no disk I/O, and the disk (shared with other tenants too) does not drift with the CPU.
DRIFT_RATES = ("flops", "host_flops", "link_bandwidth", "scatter_bandwidth", "reduce_bandwidth",
               "pcie_bandwidth", "memory_bandwidth", "host_memory_bandwidth")
DRIFT_TIMES = ("link_latency", "scatter_latency", "reduce_latency", "op_overhead", "kernel_overhead",
               "comm_overhead", "scatter_overhead", "wake_latency", "loop_overhead")


def drifted_step(graph, drift: float) -> float:
    """The predicted step of ``graph`` on its profile as the host ran at ``drift`` times the
    profile's time. Without disk ops exactly ``drift`` times the step (every duration scales);
    with them, only the rest of the step moves."""
    m = machine_of(graph)
    given = lambda keys: [k for k in keys if m.value(k) is not None]   # noqa: E731 (a rate not given stays so)
    changes = {k: m.value(k) / drift for k in given(DRIFT_RATES)} | {k: m.value(k) * drift for k in given(DRIFT_TIMES)}
    return simulate(graph, m.with_fields(**changes)).step_s


def cpu_programs() -> list[Path]:
    return sorted(p for p in (ROOT / "programs").glob("*.zs"))


def plan(program: str, machine: str, steps: int, max_step_s: float):
    """Compiled (with the calibrated machine), or the reason it cannot be planned/run on CPU."""
    compiled = compile_file(program, {"machine": machine, "steps": str(steps)}, simulate=True)
    if not compiled.ok or compiled.sim is None:
        d = next((d for d in compiled.diagnostics if d.is_error), None)
        return None, (d.message if d else "the planner could not simulate it")
    if compiled.schedule.device == "cuda":
        return None, "needs CUDA"
    if compiled.sim.step_s > max_step_s:
        return None, (f"predicted {compiled.sim.step_s:.0f} s a step (> --max-step {max_step_s:g} s): "
                      f"a benchmark of its own (capacity.py)")
    return compiled, None


def measure(program: str, steps: int, trace: str | None) -> tuple[float | None, str | None, list[float]]:
    with tempfile.TemporaryDirectory(prefix="zdsl-prederr-") as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        args = ["run", program, "--set", f"steps={steps}", "--metrics", metrics, "--quiet"]
        if trace:
            args += ["--trace", trace]
        proc = zdsl(*args)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            return None, (lines[-1] if lines else f"exit {proc.returncode}")[:300], []
        times = [json.loads(ln)["step_s"] for ln in Path(metrics).read_text().splitlines() if ln.strip()]
    return statistics.median(times[1:] if len(times) > 1 else times), None, times


def explain(compiled, trace_path: str) -> list[str]:
    """Predicted vs measured per op kind (mean ms per op, all ranks and traced steps)."""
    from zdsl.observe.overlap import analyze
    from zdsl.observe.overlap import times_from_trace
    trace = json.loads(Path(trace_path).read_text())
    graph, sim = compiled.graph, compiled.sim
    steps = trace.get("metadata", {}).get("steps") or []
    meas: dict[str, list[float]] = {}
    gaps, crit = [], []
    for rank in range(graph.ranks):
        for step in steps:
            times = times_from_trace(trace, rank=rank, step=step)
            if not times:
                continue
            for op in graph.ops:
                if op.id in times:
                    s, e = times[op.id]
                    meas.setdefault(op.kind, []).append(e - s)
            rep = analyze(graph, times, rank=rank)
            gaps.append(rep.step_time - rep.critical_length)
            crit.append(rep.critical_length)
    pred: dict[str, list[float]] = {}
    for op, d in zip(graph.ops, sim.duration):
        if op.kind != "mem.free":
            pred.setdefault(op.kind, []).append(d)
    lines = [f"      {'op kind':<20}{'ops':>5}{'pred ms/op':>12}{'meas ms/op':>12}{'meas/pred':>10}"]
    for kind, ds in sorted(pred.items(), key=lambda kv: -sum(kv[1])):
        m = meas.get(kind)
        pm = statistics.mean(ds)
        mm = statistics.median(m) if m else None
        ratio = f"{mm / pm:10.2f}" if mm and pm else f"{'-':>10}"
        lines.append(f"      {kind:<20}{len(ds):5d}{pm * 1e3:12.3f}"
                     f"{(mm * 1e3 if mm is not None else float('nan')):12.3f}{ratio}")
    if gaps:
        lines.append(f"      measured critical path {statistics.median(crit) * 1e3:.2f} ms, "
                     f"time between ops on it {statistics.median(gaps) * 1e3:.2f} ms per step "
                     f"(predicted critical path = step {sim.step_s * 1e3:.2f} ms)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", metavar="FILE.zs", help="reuse this profile instead of calibrating")
    ap.add_argument("--out", default="/tmp/machine.zs",
                    help="where calibrate writes (default /tmp/machine.zs; round r: .r appended)")
    ap.add_argument("--calibration", choices=("quick", "full"), default="quick",
                    help="quick: what calibration by default measures (zdsl calibrate --quick, the default); "
                         "full: zdsl calibrate")
    ap.add_argument("--disk", metavar="FOLDER", help="calibrate's --disk (the folder the NVMe programs swap to)")
    ap.add_argument("--program", action="append", help="program(s) (default: every programs/*.zs)")
    ap.add_argument("--steps", type=int, default=100,
                    help="steps a run (default 100: a step's median over 30 still moved 30%% between runs)")
    ap.add_argument("--max-step", type=float, default=30.0, metavar="SECONDS",
                    help="skip programs predicted slower than this per step (default 30)")
    ap.add_argument("--repeat", type=int, default=3, help="measured runs per program (median of medians)")
    ap.add_argument("--calibrate-each", choices=("program", "round"), default=None,
                    help="calibrate afresh before each program's run or once a round (the default with "
                         "the control; without it, program)")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="do not run the reference schedule beside each program (no drift correction)")
    ap.add_argument("--explain", action="store_true", help="compare predicted and measured traces op by op")
    ap.add_argument("--json", metavar="OUT.json", help="write the figures as JSON")
    args = ap.parse_args(argv)

    outside = OutsideLoad.start()
    programs = [str(p) for p in (args.program or cpu_programs())]
    planned, skipped = [], []
    runs: dict[str, list[float]] = {p: [] for p in programs}
    preds: dict[str, list[float]] = {p: [] for p in programs}
    traces: dict[str, str] = {}
    tmp = tempfile.mkdtemp(prefix="zdsl-prederr-traces-")     # the control's schedule, --explain's traces
    atexit.register(shutil.rmtree, tmp, True)                  # read before the end: none outlives the run
    each = args.machine is None and (args.calibrate_each or ("round" if args.control else "program")) == "program"
    reference = reference_program(tmp, args.steps) if args.control else None
    controls: dict[str, list[float]] = {p: [] for p in programs}   # measured / predicted reference step
    drifted: dict[str, list[float]] = {p: [] for p in programs}    # each run's prediction, drift applied
    held: dict[str, list[bool]] = {p: [] for p in programs}        # each run flanked by quiet references
    # per round: the reference step its calibration(s) measured, and the reference's runs beside the programs
    calibrated: list[list[float]] = [[] for _ in range(args.repeat)]
    beside: list[list[float]] = [[] for _ in range(args.repeat)]

    @functools.lru_cache(maxsize=None)
    def reference_predicted(machine: str) -> float | None:
        """The profile's predicted step of the reference (once per profile)."""
        compiled, _ = plan(reference, machine, args.steps, float("inf"))
        return compiled.sim.step_s if compiled is not None else None

    def profile_now(r: int, label: str) -> str:
        """The machine statement to predict with: a fresh calibration of this moment, or --machine."""
        profile = args.machine
        if profile is None:
            profile = f"{args.out}.{r}" if args.repeat > 1 else args.out
            calibrate(profile, args.disk, quiet=each, quick=args.calibration == "quick")
        machine, reference = machine_statement(profile), reference_step(profile)
        measured = reference_seconds(profile) if args.machine is None else None
        kept = kept_cached(machine) if args.machine is None else None
        if kept:        # as `zdsl plan` would: the cached profile of the machine's usual speed
            machine, measured = kept
            print(f"{label}: calibrate measured the reference step {reference}, off the machine's usual: "
                  f"planning with the cached profile, as zdsl plan does"
                  + (f" (its reference step {measured * 1e3:.1f} ms)" if measured else ""), flush=True)
            reference = f"{measured * 1e3:.1f} ms" if measured else ""
        if measured is not None:
            calibrated[r].append(measured)
        said = f"reference step {reference}" if each and reference else f"machine {machine}" + (
            f" (reference step {reference})" if reference else "")
        print(f"{label}: {said}", flush=True)
        return machine

    for r in range(args.repeat):                       # alternate programs: load hits all alike
        machine = None if each else profile_now(r, f"round {r + 1}")
        before = None
        if r == 0:                                     # which programs can run here at all
            first = machine or profile_now(r, "planning")
            for program in programs:
                compiled, why = plan(program, first, args.steps, args.max_step)
                if compiled is None:
                    skipped.append((program, f"cannot plan: {why}"))
                else:
                    planned.append((program, compiled))
        for program, compiled in planned:
            if program in dict(skipped):
                continue
            if each:                                   # this run against a profile of this moment
                machine = profile_now(r, f"round {r + 1}, {Path(program).stem}")
            if each or (r > 0 and args.machine is None):
                compiled, why = plan(program, machine, args.steps, float("inf"))
                if compiled is None:
                    skipped.append((program, f"cannot plan: {why}"))
                    continue
            trace = os.path.join(tmp, Path(program).stem + ".json") if args.explain and r == 0 else None
            # the reference run after the previous program serves as this one's "before"
            if reference and before is None:
                before = measure(reference, args.steps, None)[0]
                if before:
                    beside[r].append(before)
            med, err, _ = measure(program, args.steps, trace)
            if med is None:
                skipped.append((program, f"run failed: {err}"))
                continue
            flanks: list[float] = []                  # the reference's runs before and after this one
            if reference:
                after = measure(reference, args.steps, None)[0]
                if after:
                    beside[r].append(after)
                ref_pred = reference_predicted(machine)
                if before and after and ref_pred:
                    drift = (before * after) ** 0.5 / ref_pred
                    controls[program].append(drift)
                    drifted[program].append(drifted_step(compiled.graph, drift))
                flanks = [before, after] if before and after else []
                before = None if each else after      # a fresh calibration comes between otherwise
            held[program].append(is_quiet(steadiness(calibrated[r], flanks)))
            runs[program].append(med)
            preds[program].append(compiled.sim.step_s)
            if trace:
                traces[program] = trace
    skipped_names = dict(skipped)
    rows = [(p, c) for p, c in planned if p not in skipped_names and runs[p]]

    head = f"{'program':<20}{'predicted':>12}{'measured':>12}{'raw error':>11}"
    if args.control:
        head += f"{'drift':>8}{'corrected':>11}"
    print(head + "   rounds (predicted/measured ms)")
    results = []
    for program, compiled in rows:
        pred, meas = statistics.median(preds[program]), statistics.median(runs[program])
        err = statistics.median(p / m - 1 for p, m in zip(preds[program], runs[program]))
        name = Path(program).stem
        line = f"{name:<20}{pred * 1e3:10.2f}ms{meas * 1e3:10.2f}ms{err:+11.0%}"
        row = {"program": name, "predicted_s": pred, "measured_s": meas, "error": err,
               "runs_s": runs[program], "predicted_runs_s": preds[program], "quiet_runs": held[program]}
        if args.control:
            drift = controls[program]
            if len(drift) == len(runs[program]):
                # each run's prediction scaled by how the host ran the reference beside it
                corrected = statistics.median(p / m - 1 for p, m in zip(drifted[program], runs[program]))
                line += f"{statistics.median(drift):7.2f}x{corrected:+11.0%}"
                row.update(corrected_error=corrected, drift=drift, drifted_predicted_s=drifted[program])
            else:
                line += f"{'-':>8}{'-':>11}"
        print(line + "   " + ", ".join(f"{p * 1e3:.1f}/{m * 1e3:.1f}" for p, m in zip(preds[program], runs[program])))
        if args.explain and program in traces:
            print("\n".join(explain(compiled, traces[program])))
        results.append(row)
    for program, why in skipped:
        print(f"{Path(program).stem:<20}skipped: {why}")
    raw = [abs(r["error"]) for r in results]
    ok = sum(e <= TARGET for e in raw)
    how = "calibration by default (zdsl calibrate --quick)" if args.calibration == "quick" and not args.machine \
        else ("the profile " + args.machine if args.machine else "a full zdsl calibrate")
    print(f"{ok}/{len(results)} programs within {TARGET:.0%} raw (worst {max(raw, default=0.0):.0%}; "
          f"{how}, no drift correction); {len(skipped)} skipped")
    under = [r["error"] for r in results]
    if under:
        print(f"raw errors: median {statistics.median(under):+.0%}, {sum(e < 0 for e in under)} of "
              f"{len(under)} under-predicted")
    corrected = [abs(r["corrected_error"]) for r in results if "corrected_error" in r]
    if corrected:
        print(f"corrected for drift: {sum(e <= TARGET for e in corrected)}/{len(corrected)} within {TARGET:.0%} "
              f"(worst {max(corrected):.0%}); drift = the reference schedule's step run beside each program "
              f"over the profile's prediction of it")
    if args.control and args.machine is None:
        quiet = quiet_errors(results)
        n_quiet = sum(sum(r["quiet_runs"]) for r in results)
        print(f"runs the host ran at its calibrated speed (the reference before and after within {QUIET:.0%} "
              f"of the calibration's step): {n_quiet} of {sum(len(r['runs_s']) for r in results)}; "
              f"raw error over them: " + (", ".join(f"{k} {v:+.0%}" for k, v in quiet.items()) or "none")
              + (f"; {sum(abs(v) <= TARGET for v in quiet.values())}/{len(quiet)} within {TARGET:.0%}"
                 f" ({len(results) - len(quiet)} programs had no such run)" if quiet else ""))
    spreads = [max(r["runs_s"]) / min(r["runs_s"]) - 1 for r in results if len(r["runs_s"]) > 1]
    load = outside.stop()
    print(load.line() + (f"; run-to-run spread (max/min - 1) median {statistics.median(spreads):.0%}"
                         if spreads else ""))
    if load.busy:
        print("note: other work shared the cores; step times (and the calibration) move with it, so "
              "errors above are partly noise: rerun on a quiet machine")
    steady = [steadiness(c, b) for c, b in zip(calibrated, beside)]
    for r, ratios in enumerate(steady):
        if ratios is None:
            continue
        print(f"round {r + 1}: the reference step calibrate measured {statistics.median(calibrated[r]) * 1e3:.1f} ms, "
              f"beside the programs {min(beside[r]) * 1e3:.1f}-{max(beside[r]) * 1e3:.1f} ms "
              f"({ratios[0]:.2f}-{ratios[1]:.2f}x): " + (
                  "quiet" if is_quiet(ratios) else
                  f"not quiet (beyond {QUIET:.0%}): the host's speed moved, and the raw error with it"))
    if args.json:
        rounds = [{"calibrated_reference_s": c, "reference_beside_s": b, "quiet": is_quiet(q) if q else None}
                  for c, b, q in zip(calibrated, beside, steady)]
        Path(args.json).write_text(json.dumps({"machine": machine, "results": results, "rounds": rounds,
                                               "skipped": skipped}, indent=2))
    return 0 if results and ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
