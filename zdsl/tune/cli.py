"""``zdsl tune FILE --vary prefetch=1,2,4 bucket=16MiB,64MiB``: predict every variant, measure the best.

Why two stages: the planner prices a combination in milliseconds and knows
the memory budget, so it can afford to try all of them and reject the ones
that do not fit; but a prediction is a model, so the best few are then run
for real (short ``zdsl run`` subprocesses, exactly as a user would run them)
and the winner is the fastest *measured* one. The table shows both, so the
user also sees how far the cost model is off on this machine.

The winning schedule is written as a new .zs file that re-checks to the
winner's task graph (``zdsl.tune.search.write_schedule_text``).

This module imports no torch: every measurement is a subprocess.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zdsl.ir import TIERS
from zdsl.lang.sizes import human_bytes
from zdsl.tune.search import (Candidate, TuneUsageError, combinations, parse_vary, predict, ranked,
                       validate_values, write_schedule_text)

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):                      # usage errors: exit 2, one line, no traceback
        self.print_usage(sys.stderr)
        print(f"zdsl tune: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zdsl tune",
                description="Try combinations of schedule values: all predicted by the planner "
                            "(over-budget ones rejected), the best K measured by short runs; "
                            "writes the winner as a new .zs file.",
                epilog="values with top-level commas (overlap pairs): separate alternatives with '|', "
                       "e.g. --vary 'overlap=all|gather/forward,scatter/backward'")
    p.add_argument("file", metavar="FILE", nargs="?", help="the .zs schedule")
    p.add_argument("--vary", nargs="+", action="extend", default=[], metavar="KEY=V1,V2",
                   help="a --set key and the values to try (repeatable)")
    p.add_argument("--measure", type=int, default=3, metavar="K",
                   help="measure the K best predicted combinations (default 3; 0: planner only)")
    p.add_argument("--steps", type=int, default=8, metavar="N",
                   help="steps per measured run; the first is excluded from the median (default 8)")
    p.add_argument("--out", metavar="BEST.zs", help="where to write the winner (default: FILE's stem + "
                                                    "'.tuned.zs' beside FILE)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a fixed override for every combination (repeatable)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds one measured run may take (default 600)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.file is None:                          # `--vary a=1,2 FILE`: --vary took the file too
        stray = [v for v in args.vary if "=" not in v]
        if len(stray) != 1:
            parser.error("the following arguments are required: FILE")
        args.file = stray[0]
        args.vary.remove(stray[0])
    if args.measure < 0:
        parser.error("--measure must be 0 or more")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    from zdsl.driver import compile_file
    from zdsl.driver import memo_units_for
    from zdsl.cli import parse_sets
    from zdsl.driver import report
    from zdsl.driver import status_of
    base = parse_sets(args.set, parser)
    if "steps" in base or "train.steps" in base:
        parser.error("set the measured run length with --steps, not --set steps")
    try:
        vary = parse_vary(args.vary)
    except TuneUsageError as exc:
        parser.error(str(exc))
    if any(k in ("steps", "train.steps") for k, _ in vary):
        parser.error("steps is the run's length, not a schedule choice: measured runs use --steps")
    clash = [k for k, _ in vary if k in base]
    if clash:
        parser.error(f"{clash[0]} is both --set and --vary")
    if not Path(args.file).is_file():
        parser.error(f"no such schedule file: {args.file}")
    units_for = memo_units_for()
    first = compile_file(args.file, base, units_for, simulate=False)
    if first.schedule is None:                     # the file itself (or --set) does not check
        report(first)
        return status_of(first)
    try:
        validate_values(args.file, base, vary, units_for)
    except TuneUsageError as exc:
        parser.error(str(exc))

    combos = combinations(vary)
    t0 = time.perf_counter()
    cands = predict(args.file, base, combos, units_for)
    plan_s = time.perf_counter() - t0
    best = ranked(cands)
    print(f"zdsl tune: {len(cands)} combination(s) planned in {plan_s:.2f} s; "
          f"{len(cands) - len(best)} rejected by the planner", file=sys.stderr)
    if not best:
        print_table(cands, None, args)
        print("zdsl tune: error: every combination was rejected; nothing to run", file=sys.stderr)
        return EXIT_INVALID

    to_measure = best[:args.measure]
    for i, cand in enumerate(to_measure, 1):
        print(f"zdsl tune: measuring {i}/{len(to_measure)}: {cand.label} ({args.steps} steps)",
              file=sys.stderr, flush=True)
        measure(args.file, cand, args.steps, args.timeout)
    measured = [c for c in to_measure if c.measured_s is not None]
    if to_measure and not measured:
        print_table(cands, None, args)
        print("zdsl tune: error: no measured run finished; see the verdicts above", file=sys.stderr)
        return EXIT_INVALID
    winner = min(measured, key=lambda c: c.measured_s) if measured else best[0]
    print_table(cands, winner, args)

    out = args.out or str(Path(args.file).with_suffix("").as_posix() + ".tuned.zs")
    how_measured = (f"measured {winner.measured_s * 1e3:.2f} ms/step" if winner.measured_s is not None
                    else f"predicted {winner.predicted_s * 1e3:.2f} ms/step")
    try:
        text, how = write_schedule_text(args.file, winner.overrides, out,
                                        note=f"{winner.label} ({how_measured})", units_for=units_for)
        Path(out).write_text(text, encoding="utf-8")
    except (ValueError, OSError) as exc:
        print(f"zdsl tune: error: cannot write {out}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(f"winner: {winner.label} ({how_measured}); wrote {out}"
          f"{' (checked schedule printed: comments not kept)' if how == 'printed' else ''}")
    return EXIT_OK


# -- measuring ----------------------------------------------------------------------

def measure(path: str, cand: Candidate, steps: int, timeout_s: float) -> None:
    """One short real run: median step time (first step excluded) and peak bytes per tier."""
    with tempfile.TemporaryDirectory(prefix="zdsl-tune-") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [sys.executable, "-m", "zdsl.cli", "run", path]
        for k, v in cand.overrides.items():
            cmd += ["--set", f"{k}={v}"]
        cmd += ["--set", f"steps={steps}", "--metrics", metrics, "--quiet"]
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            cand.failed = f"run took longer than {timeout_s:.0f} s"
            return
        rows = read_metrics(metrics)
        if proc.returncode != 0 or not rows:
            lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
            cand.failed = (lines[-1] if lines else f"exit status {proc.returncode}")[:200]
            return
    apply_metrics(cand, rows)


def read_metrics(path: str) -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(row, dict) and "step_s" in row:
                        rows.append(row)
    except OSError:
        return []
    return rows


def apply_metrics(cand: Candidate, rows: list[dict]) -> None:
    times = [float(r["step_s"]) for r in rows]
    cand.measured_steps = times
    timed = times[1:] if len(times) > 1 else times
    cand.measured_s = statistics.median(timed)
    peak: dict[str, int] = {}
    for r in rows:
        for per_tier in (r.get("peak_bytes") or {}).values():
            for tier, b in (per_tier or {}).items():
                peak[tier] = max(peak.get(tier, 0), int(b))
    cand.measured_peak = {t: b for t, b in peak.items() if b}


# -- the table ------------------------------------------------------------------------

def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def _bytes(n: int | None) -> str:
    return human_bytes(n) if n else "-"


def verdict(cand: Candidate, winner: Candidate | None, rank: int | None) -> str:
    if cand.rejected:
        return f"rejected: {cand.rejected}"
    if cand.failed:
        return f"run failed: {cand.failed}"
    if cand is winner:
        return "best" + (" (measured)" if cand.measured_s is not None else " (predicted; not measured)")
    if cand.measured_s is not None:
        return f"slower by {cand.measured_s / winner.measured_s - 1:.0%}" if winner and winner.measured_s \
            else "measured"
    return f"not measured (predicted #{rank})"


def print_table(cands: list[Candidate], winner: Candidate | None, args) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    order = {id(c): i for i, c in enumerate(ranked(cands), 1)}
    tiers = [t for t in TIERS if any(c.predicted_peak.get(t) or c.measured_peak.get(t) for c in cands)] \
        or ["device"]
    table = Table(title=f"zdsl tune {args.file}: {len(cands)} combination(s), "
                        f"best {min(args.measure, len(order))} measured over {args.steps} steps",
                  title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("combination")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("meas/pred", justify="right")
    for t in tiers:
        table.add_column(f"peak {t}", justify="right")
    table.add_column("verdict", overflow="fold")
    for cand in sorted(cands, key=lambda c: (order.get(id(c), 10 ** 9), cands.index(c))):
        rank = order.get(id(cand))
        ratio = f"{cand.measured_s / cand.predicted_s:.2f}" \
            if cand.measured_s is not None and cand.predicted_s else "-"
        peaks = []
        for t in tiers:
            if cand.measured_peak.get(t):
                peaks.append(_bytes(cand.measured_peak[t]))
            elif cand.predicted_peak.get(t):
                peaks.append(_bytes(cand.predicted_peak[t]) + " (plan)")
            else:
                peaks.append("-")
        style = "bold green" if cand is winner else ("dim" if cand.rejected else None)
        table.add_row(str(rank) if rank else "-", cand.label, _ms(cand.predicted_s), _ms(cand.measured_s),
                      ratio, *peaks, verdict(cand, winner, rank), style=style)
    console.print(table)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
