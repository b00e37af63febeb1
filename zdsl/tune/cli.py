"""``zdsl tune FILE --vary prefetch=1,2,4 bucket=16MiB,64MiB``: predict every variant, measure the best.

Why two stages: the planner prices a combination in milliseconds and knows
the memory budget, so it can afford to try all of them and reject the ones
that do not fit; but a prediction is a model, so the best few are then run
for real (short ``zdsl run`` subprocesses, exactly as a user would run them)
and the winner is the fastest *measured* one. The table shows both, so the
user also sees how far the cost model is off on this machine.

This module turns arguments into calls: the candidates and their ranking
(``zdsl.tune.search``), the measured runs (``zdsl.tune.measure``), the table
(``zdsl.tune.table``) and the winner written as a new .zs file that re-checks
to its task graph (``zdsl.tune.write``). No torch is imported: every
measurement is a subprocess.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from zdsl.tune.measure import measure
from zdsl.tune.search import TuneUsageError, combinations, parse_vary, predict, ranked, validate_values
from zdsl.tune.table import print_table
from zdsl.tune.write import write_schedule_text

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
    from zdsl.planner import profile_cache
    profile_cache.enable()                         # predictions with this machine's calibrated rates
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
