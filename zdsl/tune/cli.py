"""``zdsl tune FILE --vary prefetch=0..4 bucket=256KiB..16MiB``: predict every variant, measure the best.

Why two stages: the planner prices a combination in milliseconds and knows
the memory budget, so it can afford to try all of them, reject the ones that
do not fit and prune the ones predicted too slow to win; but a prediction is a
model, so the best few are then run for real (short training runs, each as
``zdsl run`` would do it, a round's all in one launch), in interleaved rounds
until the verdict stands out of the machine's noise or the budget ends. The
table shows both, so the user also sees how far the cost model is off on this
machine, and where it cannot tell two candidates apart that measure apart.

This module turns arguments into calls: the candidates, their ranking and
pruning (``zdsl.tune.search``, ranges in ``zdsl.tune.ranges``), the rounds
(``zdsl.tune.rounds``, each run by ``zdsl.tune.measure``), the verdicts
(``zdsl.tune.noise``), the table (``zdsl.tune.table``) and the winner written
as a new .zs file that re-checks to its task graph (``zdsl.tune.write``). No
torch is imported: every measurement is a subprocess.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from zdsl.driver import compile_file, memo_units_for, report, status_of
from zdsl.lang.overrides import parse_sets
from zdsl.sim import profile_cache
from zdsl.tune import noise
from zdsl.tune.measure import RUN_QUANTILE, measure_round
from zdsl.tune.rounds import (
    DEFAULT_BUDGET_S,
    DEFAULT_MAX_ROUNDS,
    DEFAULT_STEPS,
    DEFAULT_STRETCH_S,
    DEFAULT_WARMUP,
    race,
)
from zdsl.tune.search import (
    PRUNE_FACTOR,
    TuneUsageError,
    combinations,
    count_changes,
    parse_vary,
    predict,
    prune,
    run_identity,
    same_runs,
    validate_values,
)
from zdsl.tune.table import as_json, print_table
from zdsl.tune.write import write_schedule_text

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):                      # usage errors: exit 2, one line, no traceback
        self.print_usage(sys.stderr)
        print(f"zdsl tune: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zdsl tune",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Try combinations of schedule values: all predicted by the planner "
                            "(over-budget ones rejected, ones predicted too slow to win pruned), the best K "
                            "measured by short runs in interleaved rounds; writes the winner as a new .zs file.",
                epilog="""\
ranges: prefetch=0..4 is every integer from 0 to 4 (step 1); bucket=256KiB..16MiB
  doubles from the first size up to the last (256KiB, 512KiB, ..., 16MiB; the last
  end is always included). Ranges and values mix: bucket=0,256KiB..4MiB.
values with top-level commas (overlap pairs): separate alternatives with '|',
  e.g. --vary 'overlap=all|gather/forward,scatter/backward'
verdicts: each round runs every candidate once, back to back in one launch, in an order
  that changes each round so that none always runs first or after the same one (A B C,
  A C B, C A B, C B A, B C A, B A C); a round's figure is a candidate's run's
  {quantile:.0f}th-percentile step after the warm-up (the steps no slow spell of the host
  fell on). "measured" is the median of those figures, "spread" their interquartile range;
  "step/pred" the runs' median step over the prediction (the planner predicts a typical step).
  Two candidates are compared round by round (the ratio of their figures in each round,
  which cancels a load both met): one is faster
  only when, over at least {min_rounds} shared rounds, the ratios' interquartile range lies past 1,
  it was faster in so many rounds that an even coin would be so lucky under {level:.0%} of the
  time ({examples}), and the median ratio is at least {min_ratio:g};
  otherwise they tie. Ties of equal speed (none {min_ratio:g}x or more slower than another
  at the median ratio) go to the lower peak device memory, then the simpler schedule
  (fewer values changed from the file, then smaller values), then the faster median; a
  tie trailing by more than that is an unconfirmed difference, not traded for memory.
  Measuring stops when one candidate beats all others, when the ones left still tie
  after --rounds rounds, or before a round that would overrun --budget.""".format(
                    quantile=RUN_QUANTILE * 100, min_rounds=noise.MIN_ROUNDS, level=noise.SIGN_LEVEL,
                    min_ratio=1 + noise.MIN_DIFFERENCE,
                    examples=", ".join(f"{noise.wins_needed(n)} of {n}" for n in (noise.MIN_ROUNDS, 11, 20, 30))))
    p.add_argument("file", metavar="FILE", nargs="?", help="the .zs schedule")
    p.add_argument("--vary", nargs="+", action="extend", default=[], metavar="KEY=V1,V2",
                   help="a --set key and the values (or LO..HI ranges) to try (repeatable)")
    p.add_argument("--measure", type=int, default=4, metavar="K",
                   help="measure the K best predicted combinations left after pruning, one per task graph: "
                        "combinations that compile to the same ops run once (default 4; 0: planner only)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help=f"seconds of measuring at most: no round starts that would end after it; "
                        f"the first round always runs (default {DEFAULT_BUDGET_S:.0f}, grown up to "
                        f"{DEFAULT_STRETCH_S:.0f} where the machine needs it for {noise.MIN_ROUNDS} rounds)")
    p.add_argument("--rounds", type=int, default=DEFAULT_MAX_ROUNDS, metavar="N",
                   help=f"stop after N rounds when the candidates left still tie (default {DEFAULT_MAX_ROUNDS}; "
                        f"at least {noise.MIN_ROUNDS}, the rounds a verdict needs)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help=f"steps per measured run (default {DEFAULT_STEPS})")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, metavar="W",
                   help=f"first steps of each run not timed (default {DEFAULT_WARMUP}: a fresh run's "
                        f"first steps are slower, and not alike for every candidate)")
    p.add_argument("--prune", type=float, default=PRUNE_FACTOR, metavar="F",
                   help=f"do not measure combinations predicted slower than F x the best predicted "
                        f"(default {PRUNE_FACTOR:g}: the spread of the cost model's error across programs)")
    p.add_argument("--out", metavar="BEST.zs", help="where to write the winner (default: FILE's stem + "
                                                    "'.tuned.zs' beside FILE)")
    p.add_argument("--json", metavar="OUT.json", help="also write every candidate's figures and verdict as JSON")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a fixed override for every combination (repeatable)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds one measured run may take (default 600)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``zdsl tune``: EXIT_OK with the winner written; EXIT_INVALID where every combination was
    rejected, no measured run finished or a file cannot be written; the file's own status where it
    does not check; a usage error exits 2."""
    parser = build_parser()
    args = _parse_arguments(parser, sys.argv[1:] if argv is None else argv)
    profile_cache.enable()                         # predictions with this machine's calibrated rates
    base, vary = _overrides(parser, args)
    units_for = memo_units_for()
    first = compile_file(args.file, base, units_for, simulate=False)
    if first.schedule is None:                     # the file itself (or --set) does not check
        report(first)
        return status_of(first)
    try:
        validate_values(args.file, base, vary, units_for)
    except TuneUsageError as exc:
        parser.error(str(exc))
    cands, survivors, distinct = _plan(args, base, vary, first, units_for)
    to_measure = distinct[:args.measure]
    if not survivors:
        print_table(cands, None, "", args, title(args, cands, None))
        print("zdsl tune: error: every combination was rejected; nothing to run", file=sys.stderr)
        return EXIT_INVALID
    result = _measure(args, to_measure) if to_measure else None
    if to_measure and not any(c.rounds for c in to_measure):
        print_table(cands, None, "", args, title(args, cands, result))
        print("zdsl tune: error: no measured run finished; see the verdicts above", file=sys.stderr)
        return EXIT_INVALID
    winner, why = _choose_winner(args, to_measure, distinct, vary, units_for)
    if not _report(args, cands, to_measure, winner, why, result):
        return EXIT_INVALID
    return _write_winner(args, winner, units_for)


def _parse_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments, each measuring option in its range (a usage error, exit 2, where not)."""
    args = parser.parse_args(argv)
    if args.file is None:                          # `--vary a=1,2 FILE`: --vary took the file too
        stray = [v for v in args.vary if "=" not in v]
        if len(stray) != 1:
            parser.error("the following arguments are required: FILE")
        args.file = stray[0]
        args.vary.remove(stray[0])
    if args.measure < 0:
        parser.error("--measure must be 0 or more")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    if args.steps < args.warmup + 1:
        parser.error(f"--steps must exceed --warmup ({args.warmup}): the first {args.warmup} step(s) "
                     f"of a run are not timed")
    if args.budget is not None and not args.budget > 0:
        parser.error("--budget must be a positive number of seconds, e.g. --budget 120")
    if args.rounds < noise.MIN_ROUNDS:
        parser.error(f"--rounds must be at least {noise.MIN_ROUNDS}: a verdict needs that many rounds")
    if not args.prune >= 1:
        parser.error("--prune must be 1 or more (1: measure only the best predicted; e.g. --prune 1.5)")
    return args


def _overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[dict, list]:
    """The fixed ``--set`` overrides and the ``--vary`` keys with their values; a usage error where
    one names the run's length, both name one key, or the file is missing."""
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
    return base, vary


def _plan(args: argparse.Namespace, base: dict, vary: list, first, units_for) -> tuple[list, list, list]:
    """Every combination predicted; those left after pruning; and of those, one per task graph in
    predicted order, the ones to measure (``first``: the file as given, whose graph one may repeat)."""
    t0 = time.perf_counter()
    cands = predict(args.file, base, combinations(vary), units_for)
    plan_s = time.perf_counter() - t0
    survivors = prune(cands, args.prune)
    rejected = sum(1 for c in cands if c.rejected)
    pruned = sum(1 for c in cands if c.pruned)
    distinct = same_runs(survivors, run_identity(first.graph)[1] if first.graph is not None else (), dict(vary))
    alike = len(survivors) - len(distinct)
    print(f"zdsl tune: {len(cands)} combination(s) planned in {plan_s:.2f} s; {rejected} rejected by the "
          f"planner, {pruned} pruned (predicted over {args.prune:g}x the best)"
          + (f", {alike} the same task graph as another (run once)" if alike else "")
          + f"; measuring {len(distinct[:args.measure])}", file=sys.stderr)
    return cands, survivors, distinct


def _measure(args: argparse.Namespace, to_measure: list):
    """The candidates raced in interleaved rounds of short runs; the race's rounds and why it stopped."""
    result = race(to_measure,
                  lambda cs: measure_round(args.file, cs, args.steps, args.warmup, args.timeout),
                  args.budget or DEFAULT_BUDGET_S, args.rounds,
                  stretch_s=DEFAULT_STRETCH_S if args.budget is None else 0.0)
    print(f"zdsl tune: stopped after {result.rounds} round(s), {result.seconds:.0f} s: {result.stopped}",
          file=sys.stderr)
    return result


def _choose_winner(args: argparse.Namespace, to_measure: list, distinct: list, vary: list, units_for):
    """The measured winner and why (ties broken by the simpler schedule), or the best predicted."""
    if not to_measure:
        return distinct[0], "predicted; not measured"
    for cand in noise.undominated(to_measure):     # only ties need "simpler"
        cand.changes = count_changes(args.file, cand, units_for)
    return noise.choose_winner(to_measure, dict(vary))


def _report(args: argparse.Namespace, cands: list, to_measure: list, winner, why: str, result) -> bool:
    """The table, where the cost model missed, whether the profile the plans used is off, and
    the ``--json`` file; False where that file cannot be written."""
    print_table(cands, winner, why, args, title(args, cands, result))
    for line in noise.model_gaps(cands):
        print(line)
    off = noise.profile_off(to_measure)
    if off is not None:
        print(f"{off}; {profile_advice(profile_cache.rates_line())}")
    if not args.json:
        return True
    try:
        Path(args.json).write_text(json.dumps(as_json(cands, winner, why, args, result), indent=1) + "\n",
                                   encoding="utf-8")
    except OSError as exc:
        print(f"zdsl tune: error: cannot write {args.json}: {exc}", file=sys.stderr)
        return False
    return True


def _write_winner(args: argparse.Namespace, winner, units_for) -> int:
    """The winner written as a .zs file (``--out``, or FILE's stem + ``.tuned.zs``) that re-checks."""
    out = args.out or str(Path(args.file).with_suffix("").as_posix() + ".tuned.zs")
    how_measured = (f"measured {winner.measured_s * 1e3:.2f} ms/step, spread {table_spread(winner)} ms "
                    f"over {len(winner.rounds)} round(s)" if winner.rounds
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


def profile_advice(rates: str | None) -> str:
    """Which profile the plans used (``rates``: ``zdsl plan``'s rates line, None where the schedule
    has its own ``machine`` statement) and how to measure this machine again."""
    if rates is None:
        return "planned with the schedule's own machine statement; `zdsl calibrate --out FILE` measures this machine"
    used = rates.removeprefix("rates: ").split("; calibrate:")[0]
    return f"planned with {used}; `zdsl calibrate` measures this machine again"


def title(args, cands, result) -> str:
    head = f"zdsl tune {args.file}: {len(cands)} combination(s)"
    if result is None:
        return head + ", planner only"
    return (f"{head}; measured in {result.rounds} interleaved round(s) of {args.steps} steps (first "
            f"{args.warmup} not timed); measured = median of the rounds' "
            f"{RUN_QUANTILE * 100:.0f}th-percentile steps, spread = their "
            f"interquartile range")


def table_spread(cand) -> str:
    lo, hi = noise.spread(list(cand.rounds.values()))
    return f"{lo * 1e3:.2f}..{hi * 1e3:.2f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
