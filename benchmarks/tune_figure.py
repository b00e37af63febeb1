"""Which figure of a run's step times tells ``zdsl tune``'s candidates apart best on this host?

    python benchmarks/tune_figure.py                                  # zero3, prefetch 0/1/2, 12 rounds
    python benchmarks/tune_figure.py --rounds 8 --launch run          # a zdsl run per candidate
    python benchmarks/tune_figure.py --program programs/zero2.zs --set overlap=none --set overlap=scatter/backward

Every candidate (one ``--set`` each, default prefetch 0, 1 and 2 at bucket 256KiB) runs
``--steps`` steps once per round, in tune's order for the round, a round's runs in one launch as tune's
(``--launch round``, ``zdsl run --variants``) or each in its own ``zdsl run`` (``--launch run``);
every step's time is kept. Then, for each window of timed steps and each figure of a window
(median, mean, 25th and 10th percentile, minimum), the ratio of each candidate's figure to the last
candidate's round by round: its median and its interquartile range. Tune's verdicts need that range
past 1 (``zdsl.tune.noise``), so the narrower the range at the same median, the smaller the
difference tune can call; tune's own figure is ``zdsl.tune.measure.run_of``. ``--json`` keeps the
step times. About 15 s a round of three at 100 steps of 30 ms.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zdsl.tune.measure import RunFailed, quantile, read_metrics, run_zdsl, set_options, write_variants  # noqa: E402
from zdsl.tune.noise import spread  # noqa: E402
from zdsl.tune.rounds import round_order  # noqa: E402
from zdsl.tune.search import Candidate  # noqa: E402

FIGURES = {
    "median": statistics.median,
    "mean": statistics.mean,
    "p25": lambda xs: quantile(sorted(xs), 0.25),
    "p10": lambda xs: quantile(sorted(xs), 0.10),
    "min": min,
}
WINDOWS = [(10, 30), (10, 60), (20, 100)]
RUN_TIMEOUT_S = 600.0     # a run's, as tune_quality's truth gives it


def collect(program: str, cands: list[Candidate], rounds: int, steps: int, launch: str) -> list[dict]:
    """Per run: its round, candidate (label) and step times."""
    out = []
    for r in range(rounds):
        order = round_order(cands, r)
        with tempfile.TemporaryDirectory(prefix="zdsl-figure-") as tmp:
            variants, files = write_variants(tmp, order)
            try:
                if launch == "round":
                    run_zdsl(program, ["--set", f"steps={steps}", "--variants", variants], RUN_TIMEOUT_S * len(order))
                else:
                    for c, m in zip(order, files):
                        run_zdsl(program, set_options(c) + ["--set", f"steps={steps}", "--metrics", m], RUN_TIMEOUT_S)
            except RunFailed as exc:
                sys.exit(f"tune_figure: zdsl run failed: {exc}")
            for c, m in zip(order, files):
                out.append({"round": r, "cand": c.label, "steps": [row["step_s"] for row in read_metrics(m)]})
        print(f"  round {r + 1}/{rounds} {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    return out


def report(runs: list[dict], cands: list[str]) -> None:
    ref = cands[-1]
    print(f"each candidate's figure over {ref}'s, round by round: median (interquartile range) width")
    print(f"{'window':>8} {'figure':>7}  " + "  ".join(f"{c:>30}" for c in cands[:-1]))
    for lo, hi in WINDOWS:
        for name, figure in FIGURES.items():
            by: dict[int, dict[str, float]] = {}
            for run in runs:
                timed = run["steps"][lo:hi]
                if timed:
                    by.setdefault(run["round"], {})[run["cand"]] = figure(timed)
            cells = []
            for c in cands[:-1]:
                ratios = [v[c] / v[ref] for v in by.values() if c in v and ref in v]
                if not ratios:
                    cells.append(f"{'-':>30}")
                    continue
                q1, q3 = spread(ratios)
                cells.append(f"{statistics.median(ratios):.3f} ({q1:.3f}..{q3:.3f}) {q3 - q1:.3f}".rjust(30))
            print(f"{lo:>3}-{hi:<4} {name:>7}  " + "  ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", default=str(ROOT / "programs" / "zero3.zs"))
    ap.add_argument("--set", dest="cands", action="append", metavar="'K=V ...'",
                    help="a candidate's overrides, space-separated (repeat; the last is the reference)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=100, help="steps a run (default 100; windows reach step 100)")
    ap.add_argument("--launch", choices=("round", "run"), default="round")
    ap.add_argument("--json", help="write the step times here")
    args = ap.parse_args()
    given = args.cands or [f"prefetch={p} bucket=256KiB" for p in (0, 1, 2)]
    if len(given) < 2:
        ap.error("give at least two --set candidates")
    if any("=" not in o for c in given for o in c.split()):
        ap.error("a --set candidate is KEY=VALUE pairs separated by spaces")
    cands = [Candidate(combo, combo) for combo in (dict(o.split("=", 1) for o in c.split()) for c in given)]
    runs = collect(args.program, cands, args.rounds, args.steps, args.launch)
    if args.json:
        Path(args.json).write_text(json.dumps(runs), encoding="utf-8")
    report(runs, [c.label for c in cands])
    return 0


if __name__ == "__main__":
    sys.exit(main())
