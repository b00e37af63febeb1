"""``zdsl tune``'s measuring loop: candidates run in interleaved rounds until the verdict holds.

A round runs every candidate still in the race once, all in one launch
(``zdsl.tune.measure.measure_round``), so they share its processes' conditions
and a spell of load from elsewhere falls on neighbouring runs of different
candidates rather than on all runs of one. The order changes each round
(:func:`round_order`, a Williams design): no candidate always runs first, after
the start-up, or always after the same one (whose warm heap or caches it would
inherit; a rotation, A B C, B C A, C A B, keeps each behind the same one). From
round :data:`MIN_ROUNDS` on, a candidate clearly slower than the fastest median
(``zdsl.tune.noise``) is not run again. The race stops at the first of:

* one candidate left: it is faster than every other beyond the spread (or it
  was the only one to measure: one round then);
* ``max_rounds`` rounds done: the ones left tie (rounds compared in pairs
  separate a real difference of 3-5% only after 10-30 of them on a shared
  host, ``zdsl.tune.noise``; the budget may end the race first);
* the budget: a round is started only if it is expected to end within it (the
  last round's time per run times the runs left); the first round always runs.
  Where the budget is tune's default (``stretch_s``), one too short for the
  :data:`MIN_ROUNDS` rounds a verdict needs on this machine grows to hold them,
  if they are expected to end within ``stretch_s``, and says so;
* every run failed.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

from zdsl.tune.measure import Run, RunFailed
from zdsl.tune.noise import MIN_ROUNDS, clearly_slower, leader
from zdsl.tune.search import Candidate

DEFAULT_BUDGET_S = 120.0
DEFAULT_STRETCH_S = 360.0   # the default budget's most, grown to hold a verdict's rounds
DEFAULT_MAX_ROUNDS = 30
# Steps per measured run and the first ones not timed. A fresh run's first ten or twenty steps are
# slower than its later ones, and not alike for every candidate (two candidates can swap places
# after them). Fifty timed steps outlast a spell of the host's (``zdsl.tune.measure.RUN_QUANTILE``)
# and narrow the round ratios' spread, for a few seconds a round, small beside a launch's start-up.
DEFAULT_STEPS = 60
DEFAULT_WARMUP = 10


@dataclass
class Race:
    """How the measuring went: rounds run, seconds spent, and why it stopped."""
    rounds: int
    seconds: float
    stopped: str


MeasureRound = Callable[[list[Candidate]], dict[str, Run | RunFailed]]


def race(cands: list[Candidate], measure_round: MeasureRound, budget_s: float = DEFAULT_BUDGET_S,
         max_rounds: int = DEFAULT_MAX_ROUNDS, clock: Callable[[], float] = time.monotonic,
         say: Callable[[str], None] | None = None, stretch_s: float = 0.0) -> Race:
    """Measure ``cands`` in interleaved rounds; fills each one's ``rounds``, ``measured_peak``,
    ``failed`` and ``dropped``. ``measure_round`` runs the candidates it is given once each, in that
    order, and returns each one's Run or RunFailed by label. ``stretch_s``: how far a budget too
    short for :data:`MIN_ROUNDS` rounds may grow to hold them (0: not at all, a budget the user gave)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    start, active, r, per_run, given = clock(), list(cands), 0, 0.0, budget_s
    while True:
        spent, per_round = clock() - start, per_run * len(active)
        if r and r < MIN_ROUNDS and len(active) > 1 and spent + per_round > budget_s:
            needed = spent + per_round * (MIN_ROUNDS - r)
            if needed <= stretch_s:
                if budget_s == given:
                    say(f"zdsl tune: the default budget ({given:.0f} s) ends before round {MIN_ROUNDS}, the "
                        f"fewest a verdict needs; measuring on to it (~{needed:.0f} s; --budget sets the time)")
                budget_s = needed
        if r and spent + per_round > budget_s:
            stopped = f"the budget ({budget_s:.0f} s) would end during round {r + 1} (~{per_round:.0f} s a round)"
            break
        r += 1
        t0 = clock()
        ran = len(active)
        results = measure_round(round_order(active, r - 1))
        for cand in active:
            run = results.get(cand.label, RunFailed("the round gave no figure for it"))
            if isinstance(run, RunFailed):
                cand.failed = str(run)
                continue
            cand.rounds[r] = run.step_s
            if run.typical_s is not None:
                cand.typical[r] = run.typical_s
            for tier, b in run.peak.items():
                cand.measured_peak[tier] = max(cand.measured_peak.get(tier, 0), b)
        per_run = (clock() - t0) / max(ran, 1)
        active = [c for c in active if not c.failed]
        lead = leader(active)
        if lead is not None and r >= MIN_ROUNDS:
            for cand in active:
                if clearly_slower(cand, lead):
                    cand.dropped = r
            active = [c for c in active if c.dropped is None]
        say(progress(r, clock() - start, budget_s, lead, active, cands))
        if not active:
            stopped = "every run failed"
        elif len(cands) == 1:
            stopped = "one candidate: nothing to compare it with"
        elif len(active) == 1 and any(c.dropped for c in cands):
            stopped = f"{active[0].label} is faster than every other beyond the spread"
        elif len(active) == 1:
            stopped = f"only {active[0].label} is left to measure: the other runs failed"
        elif r >= max_rounds:
            stopped = f"the {len(active)} left tie after {r} rounds"
        else:
            continue
        break
    return Race(r, clock() - start, stopped)


def round_order(cands: list, r: int) -> list:
    """``cands`` in the order of round ``r`` (from 0): row ``r`` of a Williams design, the sequence
    0, 1, n-1, 2, n-2, ... shifted by ``r``, every other row reversed where ``n`` is odd. Over ``n``
    rounds (``2n`` where odd) each candidate runs once in each place and right after each other
    one equally often."""
    n = len(cands)
    if n < 2:
        return list(cands)
    base, lo, hi = [0], 1, n - 1
    while lo <= hi:
        base.append(lo)
        lo += 1
        if lo <= hi:
            base.append(hi)
            hi -= 1
    row = [(b + r) % n for b in base]
    if n % 2 and r % 2:
        row.reverse()
    return [cands[i] for i in row]


def progress(r: int, spent: float, budget_s: float, lead: Candidate | None, active: list[Candidate],
             cands: list[Candidate]) -> str:
    """One line per round: time used, the fastest median so far, how many still tie with it, how many are out."""
    out = sum(1 for c in cands if c.dropped is not None)
    failed = sum(1 for c in cands if c.failed)
    head = f"zdsl tune: round {r}: {spent:.0f} of {budget_s:.0f} s"
    if lead is None:
        return f"{head}; every run failed"
    others = len(active) - (lead in active)
    state = (f"{others} other(s) still in the race (verdicts from round {MIN_ROUNDS})" if r < MIN_ROUNDS
             else f"{others} still tie with it, {out} clearly slower (not run again)")
    return (f"{head}; fastest median {lead.label} {lead.median * 1e3:.2f} ms; {state}"
            + (f", {failed} failed" if failed else ""))
