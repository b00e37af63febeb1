"""``zdsl tune``'s verdicts: which measured candidate is faster, and only beyond the noise.

Every candidate is measured once per round (``zdsl.tune.rounds``); a round's
figure for it is a low quantile of its run's step times, warm-up excluded
(``zdsl.tune.measure.run_of``: the steps no spell of the host slowed). Over the
rounds a candidate has a **median** (of its round figures) and a **spread**:
the interquartile range of its round figures (the middle half; with two
rounds, both figures). The spread describes this machine's run-to-run noise,
so more rounds sharpen the median but do not narrow it.

A is **faster** than B only when all hold, over at least :data:`MIN_ROUNDS`
rounds that both ran. A round runs the candidates back to back, so a load that
slows one run slows its neighbours too: the rounds are compared in pairs, by
the ratio of B's figure to A's in each round, which cancels that load.

1. the pairs' spread is past the difference of none: the interquartile range
   of the round ratios lies entirely above 1 (the difference exceeds the
   spread of the differences);
2. A was faster in so many of the rounds that an even coin would do it less
   than :data:`SIGN_LEVEL` of the time (7 of 7, 10 of 10, 10 of 11, 11 of 12,
   14 of 16, 16 of 20, 22 of 30): noise flips some rounds, a real difference few;
3. the median ratio is at least ``1 +`` :data:`MIN_DIFFERENCE`: smaller
   differences are ties, too small to act on or to confirm on a shared host.

The spreads of the candidates' own round figures (the table's "spread"
column) include the drift between rounds, which the pairs cancel: on a shared
host a real difference of a few percent can keep the spreads overlapping for
many rounds while B is slower in nearly every one. Under noise of a few
percent per run and per round, judged after every round as the race does,
(1)-(3) claim a difference that is not there in a few percent of pairs and
find nearly every real 5% one, never the wrong way round; more rounds at a
stricter level buy both. Hence up to :data:`zdsl.tune.rounds.DEFAULT_MAX_ROUNDS`
rounds, which a round in one launch (``zdsl.tune.measure.measure_round``) makes
affordable. benchmarks/tune_quality.py checks the picks and verdicts against
an exhaustive truth.

Otherwise the verdict is a **tie**. Among the candidates tied with the fastest
median, those of **equal speed** are the ones no other tied one beats by
:data:`MIN_DIFFERENCE` or more at the median round ratio: a tie that fails only
(1) or (2) is a difference the rounds have not confirmed, not an equal speed,
and it is not traded for memory (less prefetch is both less memory and slower:
a lag the rounds cannot yet confirm would otherwise hand the pick to the slow
end). Medians of ratios need not be transitive: the
one of equal speed may itself be 2% behind another at the median ratio the
other way round (8 rounds, an even count), and where every tied one trails
another the one trailing least wins; the verdicts say so rather than "the
fastest". Among those of equal speed the winner is the one with the lower
peak device memory (peaks within 1% are equal), then the
**simpler** schedule: fewer varied values that differ from the file's own,
then the smaller value of each varied key in ``--vary`` order (a shallower
prefetch, a smaller bucket; values that are not numbers by their place in
the list), then the faster median. With fewer than :data:`MIN_ROUNDS` rounds
nothing is decided: the fastest median wins and the table says "undecided".
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from zdsl.tune.search import Candidate, value_ranks

MIN_ROUNDS = 7            # no verdict on fewer shared rounds ((2) cannot hold on 6)
SIGN_LEVEL = 0.01         # (2): the chance an even coin wins as many rounds (7 of 7 is 0.008)
MIN_DIFFERENCE = 0.02     # (3): a median round ratio under 1.02 is a tie
MEMORY_TOLERANCE = 0.01   # peaks this close count as equal memory
MODEL_EQUAL = 0.01        # predictions this close count as "the model sees no difference"


def spread(values: list[float]) -> tuple[float, float]:
    """The interquartile range of ``values`` (both values with two, the value with one)."""
    xs = sorted(values)
    if len(xs) < 3:
        return xs[0], xs[-1]
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q3


@dataclass
class Comparison:
    """``a`` against ``b`` (``b`` has the lower median): is ``b`` faster beyond the noise?"""
    a: Candidate
    b: Candidate
    shared: int              # rounds both ran
    b_wins: int              # of those, rounds where b was faster
    ratios: tuple[float, float, float]   # a's figure over b's per shared round: lower quartile, median, upper

    @property
    def apart(self) -> bool:
        """(1): the round ratios' interquartile range lies above 1."""
        return self.shared > 0 and self.ratios[0] > 1.0

    @property
    def faster(self) -> bool:
        return (self.shared >= MIN_ROUNDS and self.apart and sign_chance(self.b_wins, self.shared) <= SIGN_LEVEL
                and self.ratios[1] >= 1.0 + MIN_DIFFERENCE)


def sign_chance(wins: int, n: int) -> float:
    """The chance that an even coin wins at least ``wins`` of ``n`` rounds."""
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def wins_needed(n: int) -> int:
    """The fewest rounds of ``n`` one candidate must win for (2) to hold (``n + 1``: it cannot)."""
    return next((w for w in range(n + 1) if sign_chance(w, n) <= SIGN_LEVEL), n + 1)


def compare(a: Candidate, b: Candidate) -> Comparison:
    """Is ``b`` faster than ``a``? (order them so that ``b``'s median is the lower one)."""
    shared = sorted(set(a.rounds) & set(b.rounds))
    wins = sum(1 for r in shared if b.rounds[r] < a.rounds[r])
    ratios = [a.rounds[r] / b.rounds[r] for r in shared]
    if ratios:
        lo, hi = spread(ratios)
        quartiles = (lo, statistics.median(ratios), hi)
    else:
        quartiles = (1.0, 1.0, 1.0)
    return Comparison(a, b, len(shared), wins, quartiles)


def clearly_slower(cand: Candidate, leader: Candidate) -> bool:
    return cand is not leader and compare(cand, leader).faster


def leader(cands: list[Candidate]) -> Candidate | None:
    """The measured candidate with the lowest median (the order given breaks exact ties)."""
    measured = [c for c in cands if c.rounds and not c.failed]
    return min(measured, key=lambda c: c.median) if measured else None


def undominated(cands: list[Candidate]) -> list[Candidate]:
    """The measured candidates no other is faster than (beyond the noise): the fastest median and its ties."""
    measured = [c for c in cands if c.rounds and not c.failed]
    return [c for c in measured if not any(clearly_slower(c, o) for o in measured)]


def peak_key(cand: Candidate) -> int:
    return cand.measured_peak.get("device") or cand.predicted_peak.get("device") or 0


def choose_winner(cands: list[Candidate], order: dict[str, list[str]]) -> tuple[Candidate | None, str]:
    """The winner among measured candidates and why: the fastest median, unless others tie with it.

    ``order`` maps each varied key to its values in ``--vary`` order (smaller first, for
    simplicity); ``cand.changes`` is how many varied values differ from the file's own.
    """
    best = leader(cands)
    if best is None:
        return None, ""
    if len([c for c in cands if c.rounds and not c.failed]) == 1:
        return best, "the only one measured"
    if len(best.rounds) < MIN_ROUNDS:    # no verdicts yet: ties are unknown, not shown
        return best, (f"the fastest median, undecided: {len(best.rounds)} round(s), a verdict needs "
                      f"{MIN_ROUNDS} (give more --budget or fewer --measure)")
    # by the rounds compared in pairs, not by the medians: a candidate dropped early has its median
    # from the early rounds only, which the host's drift can put below the winner's
    tied = undominated(cands) or [best]
    if len(tied) == 1:
        return tied[0], "faster than every other measured one beyond the spread"
    worst = trailing(tied)
    even = equal_speed(tied, worst)
    least = worst[id(even[0])]
    if len(even) == 1 and least >= 1.0 + MIN_DIFFERENCE:      # every one trails another: no fastest
        return even[0], (f"{len(tied)} tie, each trailing another by {MIN_DIFFERENCE:.0%} or more round by round "
                         f"(the rounds do not order them); it trails least, by {least - 1:.1%}")
    head = f"{len(tied)} tie"
    if len(even) < len(tied):
        head += (f" ({len(tied) - len(even)} trailing another by {MIN_DIFFERENCE:.0%} or more round by round, "
                 f"unconfirmed)")
    if len(even) == 1:
        return even[0], f"{head}; the only one no other beats by {MIN_DIFFERENCE:.0%} or more round by round"
    low = min(peak_key(c) for c in even)
    by_memory = [c for c in even if peak_key(c) <= low * (1 + MEMORY_TOLERANCE)]
    if len(by_memory) == 1:
        return by_memory[0], f"{head}; it has the lowest peak device memory"
    pick = min(by_memory, key=lambda c: simplicity(c, order) + (c.measured_s,))
    simplest = [c for c in by_memory if simplicity(c, order) == simplicity(pick, order)]
    why = "the simplest" if len(simplest) == 1 else "the fastest median of the simplest"
    return pick, f"{head}; {why} with equal peak memory (fewest changes from the file, then smaller values)"


def equal_speed(tied: list[Candidate], worst: dict[int, float] | None = None) -> list[Candidate]:
    """The ones of ``tied`` no other of them beats by :data:`MIN_DIFFERENCE` or more at the median
    round ratio; where every one trails another (medians of ratios need not be transitive), the
    one trailing least. ``worst``: :func:`trailing` of ``tied``, where the caller has it."""
    worst = worst or trailing(tied)
    even = [c for c in tied if worst[id(c)] < 1.0 + MIN_DIFFERENCE]
    return even or [min(tied, key=lambda c: worst[id(c)])]


def trailing(tied: list[Candidate]) -> dict[int, float]:
    """Per candidate (by ``id``), the most it trails another of ``tied``: the largest of its median
    round ratios to them (1.0: it trails none)."""
    def lag(c: Candidate, o: Candidate) -> float:      # c's figures over o's, the median round
        return compare(c, o).ratios[1] if c is not o else 1.0
    return {id(c): max(lag(c, o) for o in tied) for c in tied}


def simplicity(cand: Candidate, order: dict[str, list[str]]) -> tuple:
    return (cand.changes if cand.changes is not None else len(cand.combo),) + value_ranks(cand, order)


def slower_than(cand: Candidate, winner: Candidate, cands: list[Candidate]) -> Candidate | None:
    """Whom the table says ``cand`` is slower than: the winner, else the fastest median, else nobody."""
    for other in (winner, leader(cands)):
        if other is not None and clearly_slower(cand, other):
            return other
    return None


def verdict(cand: Candidate, winner: Candidate, cands: list[Candidate]) -> str:
    """The table's verdict for a measured candidate (not the winner), against the winner.

    A candidate slower beyond the noise than the winner, or else than the fastest
    median, says so with the numbers; any other is a tie, with why it is one.
    """
    other = slower_than(cand, winner, cands)
    if other is not None:
        cmp = compare(cand, other)
        whom = "" if other is winner else f" than {other.label} (fastest median)"
        return (f"slower{whom} by {cmp.ratios[1] - 1:.0%} "
                f"({_ms(cand, other)}; round by round {ratio_text(cmp)}; "
                f"slower in {cmp.b_wins}/{cmp.shared} rounds)")
    fast, slow = (winner, cand) if cand.median >= winner.median else (cand, winner)
    cmp = compare(slow, fast)
    if cmp.shared < MIN_ROUNDS:
        return f"undecided ({_ms(cand, winner)}; {cmp.shared} shared round(s): a verdict needs {MIN_ROUNDS})"
    # the row's own figures over the best's, as the medians before it: the median of the ratios
    # can lean the other way from the ratio of the medians, and then a bare "0.977x" misleads
    mine = f"{ratio_text(compare(cand, winner))} the best's round by round"
    if not cmp.apart:
        return f"tie with best ({_ms(cand, winner)}; {mine}: the spread reaches no difference)"
    if cmp.ratios[1] < 1.0 + MIN_DIFFERENCE:
        return f"tie with best ({_ms(cand, winner)}; {mine}: under {MIN_DIFFERENCE:.0%} apart)"
    return (f"tie with best ({_ms(cand, winner)}; {mine}, but "
            f"{'faster' if fast is cand else 'slower'} in only {cmp.b_wins}/{cmp.shared} rounds)")


def ratio_text(cmp: Comparison) -> str:
    """``cmp.a``'s round figures over ``cmp.b``'s: median and interquartile range."""
    lo, mid, hi = cmp.ratios
    return f"{mid:.3f}x (spread {lo:.3f}..{hi:.3f})"


def _ms(a: Candidate, b: Candidate) -> str:
    return f"{a.median * 1e3:.2f} vs {b.median * 1e3:.2f} ms"


def _iqr(cand: Candidate) -> str:
    lo, hi = spread(list(cand.rounds.values()))
    return f"{lo * 1e3:.2f}..{hi * 1e3:.2f}"


def model_gaps(cands: list[Candidate]) -> list[str]:
    """Pairs the planner predicts within 1% of each other that measure apart beyond the noise."""
    measured = sorted((c for c in cands if c.rounds and not c.failed and c.predicted_s),
                      key=lambda c: c.median)
    lines = []
    for i, fast in enumerate(measured):
        for slow in measured[i + 1:]:
            pa, pb = fast.predicted, slow.predicted
            if abs(pa - pb) > MODEL_EQUAL * min(pa, pb) or not compare(slow, fast).faster:
                continue
            lines.append(f"the cost model does not see the difference between {fast.label} and {slow.label} "
                         f"(predicted {pa * 1e3:.2f} vs {pb * 1e3:.2f} ms, measured "
                         f"{fast.median * 1e3:.2f} vs {slow.median * 1e3:.2f} ms, spreads "
                         f"{_iqr(fast)} and {_iqr(slow)})")
    return lines


# Every candidate's typical step this far off its prediction, the same way, is the profile's
# error more than any one schedule's: a plan's target is within 15% (benchmarks/prediction_error.py).
PROFILE_OFF = 0.15


def profile_off(cands: list[Candidate]) -> str | None:
    """Where every measured candidate's typical step is off its prediction by more than
    :data:`PROFILE_OFF` the same way, what that says (the rates' own words follow it); else None."""
    ratios = sorted(c.typical_s / c.predicted_s for c in cands
                    if c.rounds and not c.failed and c.predicted_s and c.typical_s is not None)
    if not ratios or not (ratios[-1] < 1 - PROFILE_OFF or ratios[0] > 1 + PROFILE_OFF):
        return None
    way = "faster" if ratios[-1] < 1 else "slower"
    offs = sorted(round(abs(1 - r) * 100) for r in ratios)
    span = f"{offs[0]}%" if offs[0] == offs[-1] else f"{offs[0]}-{offs[-1]}%"
    return (f"every candidate ran {span} {way} than planned (step/pred {ratios[0]:.2f}-{ratios[-1]:.2f}): "
            "the machine's speed has moved since its profile was measured, or the cost model misses "
            "something of this schedule")

