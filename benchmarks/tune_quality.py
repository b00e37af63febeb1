"""Does ``zdsl tune`` pick the true best, and does any verdict it prints claim a difference that is not there?

    python benchmarks/tune_quality.py                         # zero3 and zero2, 5 truth rounds, 3 tune runs
    python benchmarks/tune_quality.py --programs zero3,zero2,nvme --truth-rounds 8 --runs 5
    python benchmarks/tune_quality.py --programs zero3 --truth-rounds 3 --runs 1 --budget 40   # a quick look
    python benchmarks/tune_quality.py --truth-launch round --truth-rounds 20   # a truth paired as tune's rounds

For each program and its knobs (:data:`PROGRAMS`, each as a user would pass
them to ``--vary``):

1. **the truth**: every combination measured exhaustively, in interleaved
   rounds (every combination once per round, a ``zdsl run`` of ``--steps``
   steps, the first ``--warmup`` not timed, as a user runs a schedule, or with
   ``--truth-launch round`` a round's runs in one launch as tune measures them;
   in tune's order for each round); half the rounds before the tune
   runs and half after, so that a drift of the machine during the benchmark
   falls on both. The true best has the lowest median of its figures each
   divided by its round's geometric mean, and a combination is "x% behind the
   best" by the median of its rounds' ratios to the best's: on a shared host a
   round's runs share its spell of speed, which the ratios cancel and the
   medians of the raw figures (whose spread within minutes can be wider than
   the differences) do not;
2. ``--runs`` runs of ``zdsl tune FILE --vary ...`` with its defaults (``--budget``
   to change the budget), each read back through ``--json``;
3. per run: tune's pick against the true best, round by round (within 5%?;
   for a miss, whether the truth's own rounds put the best ahead by tune's rule
   or leave the two inside the truth's noise), and every verdict that claims a
   difference ("X slower than Y") checked against the truth, by the rule tune
   itself uses (``zdsl.tune.noise``) on the truth's rounds: **contradicted** when the truth has X faster than Y
   beyond its noise (it shows the opposite); **not borne out** when the
   truth's rounds put X no slower than Y but within its noise (the truth
   cannot order them: it neither confirms nor contradicts); unconfirmed when
   the truth has X slower but not beyond its noise. Also any combination the
   planner pruned that the truth puts within 5% of the best.

The last line: ``pick within 5% of best in K/M runs (X of the misses ...); contradicted
verdicts: J`` and how many were not borne out (the target: K/M >= 80%, J = 0).
About 15 minutes with the defaults on a 2-core machine where a run takes ~5 s; it prints
its estimate first.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zdsl.driver import memo_units_for  # noqa: E402
from zdsl.sim import profile_cache  # noqa: E402
from zdsl.tune import noise  # noqa: E402
from zdsl.tune.measure import RunFailed, measure_each, measure_round  # noqa: E402
from zdsl.tune.rounds import (DEFAULT_BUDGET_S, DEFAULT_STEPS, DEFAULT_STRETCH_S, DEFAULT_WARMUP,  # noqa: E402
                              round_order)
from zdsl.tune.search import Candidate, combinations, parse_vary, predict  # noqa: E402

# program -> its knobs, as --vary arguments (two meaningful knobs each; nvme has one that matters)
PROGRAMS = {
    "zero3": ["prefetch=0..2", "bucket=64KiB..256KiB"],
    "zero2": ["bucket=64KiB..256KiB", "overlap=none,scatter/backward"],
    "zero1": ["bucket=64KiB..256KiB", "overlap=none,scatter/backward"],
    "nvme": ["prefetch=0..2"],
}
WITHIN = 0.05


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="zero3,zero2",
                    help=f"comma-separated, from {', '.join(PROGRAMS)} (default zero3,zero2)")
    # 20: ten rounds can misorder leaders a few percent apart, and a truth that does scores tune
    # against noise
    ap.add_argument("--truth-rounds", type=int, default=20, help="rounds of the exhaustive truth (default 20)")
    ap.add_argument("--truth-launch", choices=("run", "round"), default="run",
                    help="the truth's runs: a zdsl run each (run, the default) or a round's in one launch (round)")
    ap.add_argument("--runs", type=int, default=3, help="zdsl tune runs per program (default 3)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"pass --budget to zdsl tune (default: tune's own, {DEFAULT_BUDGET_S:.0f} s, grown "
                         f"up to {DEFAULT_STRETCH_S:.0f} s where a verdict's rounds need it)")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                    help=f"steps per truth run (default {DEFAULT_STEPS}, as zdsl tune)")
    ap.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                    help=f"untimed steps per truth run (default {DEFAULT_WARMUP}, as zdsl tune)")
    args = ap.parse_args()
    names = [n.strip() for n in args.programs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        ap.error(f"unknown program {unknown[0]!r}; choose from {', '.join(PROGRAMS)}")

    profile_cache.enable()          # predict as zdsl tune does: with this machine's calibrated profile
    units_for = memo_units_for()
    truths = {n: predict(str(ROOT / "programs" / f"{n}.zs"), {}, combinations(parse_vary(PROGRAMS[n])), units_for)
              for n in names}
    runs = sum(len(c) for c in truths.values()) * args.truth_rounds
    budget = args.budget or DEFAULT_STRETCH_S
    print(f"tune_quality: {runs} truth runs (~{runs * 5 / 60:.1f} min at ~5 s a run) and {len(names) * args.runs} "
          f"zdsl tune runs (at most ~{len(names) * args.runs * budget / 60:.1f} min: their budget, and the "
          f"first round always runs)", flush=True)
    first = math.ceil(args.truth_rounds / 2)
    picks, misses_apart, claims_total, contradicted_total, flipped_total = [], 0, 0, 0, 0
    for name in names:
        file = str(ROOT / "programs" / f"{name}.zs")
        cands = [c for c in truths[name] if c.rejected is None]
        measure_truth(file, cands, range(1, first + 1), args)
        results = [tune_once(file, name, PROGRAMS[name], args.budget, i) for i in range(1, args.runs + 1)]
        measure_truth(file, cands, range(first + 1, args.truth_rounds + 1), args)
        print_truth(name, cands)
        for i, res in enumerate(results, 1):
            ok, apart, claims, contradicted, flipped = judge(name, i, res, cands)
            picks.append(ok)
            misses_apart += apart
            claims_total += claims
            contradicted_total += contradicted
            flipped_total += flipped
    misses = sum(1 for p in picks if not p)
    print(f"pick within {WITHIN:.0%} of best in {len(picks) - misses}/{len(picks)} runs "
          f"({misses_apart} of the {misses} misses slower than the best beyond the truth's own noise); "
          f"contradicted verdicts: {contradicted_total} (of {claims_total} claimed differences; "
          f"{flipped_total} not borne out: the truth's rounds the other way within its noise)")
    return 0


def measure_truth(file: str, cands: list[Candidate], rounds, args) -> None:
    """Every candidate once per round, in tune's order for the round (``round_order``), so that no
    candidate always runs first or after the same one. ``--truth-launch run``: one ``zdsl run`` each, as
    a user runs a schedule; ``round``: the round's candidates in one launch (``--variants``), as tune
    measures them, seconds apart rather than a launch apart (a tighter pairing, many more rounds)."""
    for r in rounds:
        t0 = time.monotonic()
        order = round_order(cands, r - 1)
        each = measure_round if args.truth_launch == "round" else measure_each
        results = each(file, order, args.steps, args.warmup, 600.0)
        for cand in order:
            run = results.get(cand.label, RunFailed("no figure"))
            if isinstance(run, RunFailed):
                cand.failed = str(run)
                continue
            cand.rounds[r] = run.step_s
        print(f"  truth {Path(file).stem} round {r}: {len(cands)} runs in {time.monotonic() - t0:.0f} s",
              flush=True)


def tune_once(file: str, name: str, vary: list[str], budget: float | None, i: int) -> dict | None:
    with tempfile.TemporaryDirectory(prefix="tune-quality-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "zdsl.cli", "tune", file, "--vary", *vary, "--out",
               os.path.join(tmp, "best.zs"), "--json", out]
        if budget is not None:
            cmd += ["--budget", str(budget)]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        took = time.monotonic() - t0
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"  {name} tune run {i}: failed (exit {proc.returncode}): {tail}", flush=True)
            return None
        res = json.loads(Path(out).read_text())
        res["took_s"] = took
        print(f"  {name} tune run {i}: {took:.0f} s, {res['rounds']} round(s), picked {res['winner']} "
              f"({res['stopped']})", flush=True)
        return res


def tune_saw(res: dict, pick: str, best: str) -> str:
    """How the true best compared with the pick in the tune run's own rounds (its ``--json``), by
    tune's own comparison."""
    seen = {}
    for row in res["candidates"]:
        seen[row["label"]] = cand = Candidate({}, {})
        cand.rounds = {int(r): v for r, v in (row.get("rounds") or {}).items()}
    cmp = noise.compare(seen[best], seen[pick]) if best in seen and pick in seen else None
    if cmp is None or not cmp.shared:
        return f"{best} not measured beside the pick"
    return (f"{best} over the pick round by round {noise.ratio_text(cmp)}, slower in "
            f"{cmp.b_wins}/{cmp.shared} round(s)")


def true_best(cands: list[Candidate]) -> Candidate:
    """The truth's fastest: the lowest median of a candidate's figures each divided by its round's
    geometric mean, so that a round run in a slow spell of the host weighs no more than another."""
    measured = [c for c in cands if c.rounds]
    means = {}
    for r in {r for c in measured for r in c.rounds}:
        xs = [c.rounds[r] for c in measured if r in c.rounds]
        means[r] = math.exp(sum(math.log(x) for x in xs) / len(xs))
    return min(measured, key=lambda c: statistics.median(v / means[r] for r, v in c.rounds.items()))


def paired(a: Candidate, b: Candidate) -> tuple[float, float, float]:
    """``a``'s figure over ``b``'s in the rounds both ran: the median ratio and a ~90% confidence interval
    of it (order statistics of the ratios, so no assumption about the noise's shape)."""
    ratios = sorted(a.rounds[r] / b.rounds[r] for r in set(a.rounds) & set(b.rounds))
    n = len(ratios)
    if not n:
        return math.nan, math.nan, math.nan
    # the largest j whose [x_j, x_(n+1-j)] covers the median with probability >= 90%
    j = max([k for k in range(1, n // 2 + 1) if 1 - 2 * noise.sign_chance(n - k + 1, n) >= 0.90] or [1])
    return statistics.median(ratios), ratios[j - 1], ratios[n - j]


def print_truth(name: str, cands: list[Candidate]) -> None:
    measured = [c for c in cands if c.rounds]
    best = true_best(cands)
    print(f"\n{name}: the truth ({len(best.rounds)} rounds each; spread = interquartile range of the rounds; "
          f"vs best = the median of the rounds' ratios to the best's, with its ~90% interval)")
    print(f"  {'combination':40} {'predicted':>10} {'true median':>12} {'spread ms':>14} {'vs best':>24}")
    lags = {c.label: paired(c, best) for c in measured}
    for c in sorted(measured, key=lambda c: lags[c.label][0]):
        lo, hi = noise.spread(list(c.rounds.values()))
        mid, clo, chi = lags[c.label]
        print(f"  {c.label:40} {c.predicted_s * 1e3:8.2f}ms {c.measured_s * 1e3:10.2f}ms "
              f"{lo * 1e3:6.2f}..{hi * 1e3:6.2f} {mid - 1:+7.1%} ({clo - 1:+.1%}..{chi - 1:+.1%})")
    for c in cands:
        if c.failed:
            print(f"  {c.label:40} failed: {c.failed}")


def judge(name: str, i: int, res: dict | None, cands: list[Candidate]) -> tuple[bool, bool, int, int, int]:
    """Print one tune run's verdict against the truth; (pick within 5%, pick beyond 5% and slower than
    the best beyond the truth's own noise, claims, contradicted claims, claims not borne out)."""
    if res is None or res.get("winner") is None:
        print(f"{name} run {i}: no pick")
        return False, True, 0, 0, 0
    truth = {c.label: c for c in cands if c.rounds}
    best = true_best(cands)
    pick = truth.get(res["winner"])
    if pick is None:
        print(f"{name} run {i}: picked {res['winner']}, which the truth has no figure for")
        return False, True, 0, 0, 0
    # round by round: a spell of the host's slowness falls on both in a round and cancels
    off, off_lo, off_hi = (x - 1 for x in paired(pick, best))
    ok = off <= WITHIN
    notes = []
    separated = False
    if not ok:      # a truth of a few rounds in a noisy phase may not order the two itself
        cmp = noise.compare(pick, best)
        separated = cmp.faster
        notes.append(f"the truth's own rounds: the best faster in {cmp.b_wins}/{cmp.shared}, the pick "
                     f"{off_lo:+.1%}..{off_hi:+.1%} (~90%) behind it: "
                     + ("beyond the truth's noise by tune's rule" if separated else
                        "within the truth's noise by tune's rule (it does not order the two)"))
        notes.append(f"tune's own rounds: {tune_saw(res, pick.label, best.label)}; its reason: {res['why']}")
    claims = contradicted = flipped = 0
    for row in res["candidates"]:
        if not row["slower_than"]:
            continue
        claims += 1
        slow, fast = truth.get(row["label"]), truth.get(row["slower_than"])
        if slow is None or fast is None:
            continue
        said = (f"{slow.label} slower than {fast.label} (truth {slow.measured_s * 1e3:.2f} vs "
                f"{fast.measured_s * 1e3:.2f} ms")
        if noise.clearly_slower(fast, slow):
            contradicted += 1
            notes.append(f"CONTRADICTED: {said}, round by round {noise.ratio_text(noise.compare(fast, slow))}: "
                         f"the truth has it faster beyond its noise)")
        elif paired(slow, fast)[0] <= 1.0:
            flipped += 1
            notes.append(f"not borne out: {said}, round by round {noise.ratio_text(noise.compare(slow, fast))}: "
                         f"the truth's rounds the other way, within its noise)")
        elif not noise.clearly_slower(slow, fast):
            notes.append(f"unconfirmed: {said}, within the truth's noise)")
    for row in res["candidates"]:
        c = truth.get(row["label"])
        lag = paired(c, best)[0] if row["pruned"] and c is not None else math.inf
        if lag <= 1 + WITHIN:
            notes.append(f"pruned {c.label}, which the truth puts {lag - 1:+.1%} from the best")
    print(f"{name} run {i}: pick {pick.label} true {pick.measured_s * 1e3:.2f} ms vs best {best.label} "
          f"{best.measured_s * 1e3:.2f} ms (round by round {off:+.1%}: {'within' if ok else 'NOT within'} "
          f"{WITHIN:.0%}; medians {pick.measured_s / best.measured_s - 1:+.1%}); "
          f"{claims} claimed difference(s), {contradicted} contradicted, {flipped} not borne out; "
          f"tune took {res['took_s']:.0f} s, {res['rounds']} round(s)")
    for note in notes:
        print(f"    {note}")
    return ok, separated, claims, contradicted, flipped


if __name__ == "__main__":
    sys.exit(main())
