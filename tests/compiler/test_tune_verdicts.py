"""`zdsl tune`'s measuring and judging on synthetic measurements (a fake measure function: no real runs).

Interleaved rounds and when they stop, the verdicts (faster only beyond the spread and in every
round), tie-breaking, the cost-model-gap line, --vary ranges and the planner's pruning.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zdsl.cli import main
from zdsl.tune import noise, ranges
from zdsl.tune.measure import Run, RunFailed, run_of
from zdsl.tune.rounds import race
from zdsl.driver import compile_file
from zdsl.tune.search import (Candidate, TuneUsageError, combinations, parse_vary, predict, prune, run_identity,
                               same_runs)

ZERO3 = str(Path(__file__).parents[2] / "programs" / "zero3.zs")


def cand(label: str, predicted_ms: float = 10.0, peak: int = 1000, **combo) -> Candidate:
    c = Candidate(combo or {"name": label}, combo or {"name": label}, predicted_s=predicted_ms / 1e3,
                  predicted_peak={"device": peak})
    c.changes = 1
    return c


class Fake:
    """A round's measure function: each candidate's step time per round from a table; records the run order."""

    def __init__(self, times: dict[str, list[float]], clock=None, run_s: float = 1.0):
        self.times, self.calls, self.clock, self.run_s = times, [], clock, run_s

    def __call__(self, cands: list[Candidate]) -> dict[str, Run | RunFailed]:
        return {c.label: self.one(c) for c in cands}

    def one(self, c: Candidate) -> Run | RunFailed:
        self.calls.append(c.label)
        if self.clock is not None:
            self.clock.now += self.run_s
        seq = self.times[c.label]
        value = seq[sum(1 for x in self.calls if x == c.label) - 1]
        if value is None:
            return RunFailed("rank 1 ran out of memory")
        return Run(value / 1e3, {"device": c.predicted_peak["device"]})


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def with_rounds(c: Candidate, ms: list[float]) -> Candidate:
    c.rounds = {r: v / 1e3 for r, v in enumerate(ms, 1)}
    return c


def quiet(_line):
    pass


# -- rounds ---------------------------------------------------------------------------------------

def test_rounds_interleave_and_a_clearly_slower_candidate_is_not_run_again():
    a, b, c = cand("a"), cand("b"), cand("c")
    fake = Fake({"name=a": [10, 11, 10, 12, 11, 10, 11], "name=b": [11, 10, 12, 10, 10, 11, 10],
                 "name=c": [20, 21, 19, 22, 20, 21, 20]})
    said = []
    result = race([a, b, c], fake, budget_s=1e9, max_rounds=7, say=said.append)
    orders = ["abc", "acb", "cab", "cba", "bca", "bac", "abc"]     # rounds.round_order's
    assert fake.calls == [f"name={x}" for order in orders for x in order]
    assert c.dropped == 7 and a.dropped is None and b.dropped is None
    assert result.rounds == 7 and "the 2 left tie after 7 rounds" in result.stopped
    assert len(said) == 7 and all(line.startswith(f"zdsl tune: round {i}:") for i, line in enumerate(said, 1))
    assert "1 clearly slower" in said[-1]


def test_rounds_stop_when_one_candidate_beats_every_other():
    a, b = cand("a"), cand("b")
    fake = Fake({"name=a": [10] * 9, "name=b": [15, 16, 15, 17, 15, 16, 15, 16, 15]})
    result = race([a, b], fake, budget_s=1e9, max_rounds=9, say=quiet)
    assert result.rounds == noise.MIN_ROUNDS
    assert result.stopped == "name=a is faster than every other beyond the spread"


def test_rounds_start_only_when_they_fit_the_budget_and_the_first_always_runs():
    clock = Clock()
    a, b = cand("a"), cand("b")
    fake = Fake({"name=a": [10] * 9, "name=b": [10] * 9}, clock=clock, run_s=10.0)
    result = race([a, b], fake, budget_s=65, max_rounds=9, clock=clock, say=quiet)
    assert result.rounds == 3 and len(a.rounds) == 3           # round 4 would end at 80 s
    assert "the budget (65 s) would end during round 4" in result.stopped
    clock.now = 0.0
    c, d = cand("a"), cand("b")
    result = race([c, d], Fake({"name=a": [10], "name=b": [10]}, clock=clock, run_s=10.0), budget_s=5,
                  clock=clock, say=quiet)
    assert result.rounds == 1 and c.rounds and d.rounds


def test_the_default_budget_grows_to_hold_the_rounds_a_verdict_needs_where_it_can():
    """30 s a round against 120 s: the default budget holds 4 rounds, so it grows to the 7 a verdict
    needs (210 s, within the 360 s it may reach) and says so once; a user's own budget never grows,
    nor one that could not reach round 7 within the stretch (60 s a round: 420 s)."""
    times = {"name=a": [10, 11, 10, 12, 11, 10, 11, 10, 10], "name=b": [11, 10, 12, 10, 10, 11, 10, 11, 11]}
    for run_s, stretch_s, rounds in ((15.0, 360.0, noise.MIN_ROUNDS), (15.0, 0.0, 4), (30.0, 360.0, 2)):
        clock, said = Clock(), []
        a, b = cand("a"), cand("b")
        result = race([a, b], Fake(times, clock=clock, run_s=run_s), budget_s=120, max_rounds=30, clock=clock,
                      say=said.append, stretch_s=stretch_s)
        assert result.rounds == rounds, (run_s, stretch_s, result)
        grew = [line for line in said if "default budget" in line]
        if rounds == noise.MIN_ROUNDS:
            assert grew == ["zdsl tune: the default budget (120 s) ends before round 7, the fewest a verdict "
                            "needs; measuring on to it (~210 s; --budget sets the time)"]
            assert "the budget (210 s) would end during round 8" in result.stopped
        else:
            assert grew == [] and "the budget (120 s) would end" in result.stopped


def test_a_failed_run_marks_its_candidate_and_the_others_go_on():
    a, b = cand("a"), cand("b")
    race([a, b], Fake({"name=a": [None], "name=b": [10] * 6}), budget_s=1e9, say=quiet)
    assert a.failed == "rank 1 ran out of memory" and not a.rounds
    assert len(b.rounds) == 1                                    # alone: nothing to compare it with


# -- verdicts ---------------------------------------------------------------------------------------

def test_faster_needs_the_round_pairs_apart_nearly_every_round_and_two_percent():
    fast = with_rounds(cand("fast"), [10, 10.5, 10.2, 10.1, 10.3, 10.4, 10.25])
    slow = with_rounds(cand("slow"), [12, 12.5, 12.2, 12.1, 12.3, 12.4, 12.25])
    assert noise.compare(slow, fast).faster
    text = noise.verdict(slow, fast, [fast, slow])
    assert text.startswith("slower by 20% (12.25 vs 10.25 ms; round by round 1.195x (spread ") \
        and "slower in 7/7 rounds" in text
    flipped = with_rounds(cand("flip"), [12, 12.5, 12.2, 12.1, 10.2, 12.4, 12.25])    # round 5: faster than fast
    cmp = noise.compare(flipped, fast)
    assert cmp.apart and not cmp.faster                          # 6 of 7: an even coin does that 6% of the time
    assert "tie with best" in noise.verdict(flipped, fast, [fast, flipped]) and "6/7 rounds" in \
        noise.verdict(flipped, fast, [fast, flipped])
    close = with_rounds(cand("close"), [10.1, 10.6, 10.3, 10.2, 10.4, 10.5, 10.35])   # slower every round, by 1%
    assert noise.compare(close, fast).apart and not noise.compare(close, fast).faster
    assert "under 2%" in noise.verdict(close, fast, [fast, close])
    # 5% slower in every round while the candidates' own spreads overlap (the rounds drift together): faster
    drift = [10, 11, 10.4, 11.6, 10.2, 11.2, 10.8, 11.4]
    a = with_rounds(cand("a"), drift)
    b = with_rounds(cand("b"), [x * 1.05 for x in drift])
    cmp = noise.compare(b, a)
    assert noise.spread(list(b.rounds.values()))[0] < noise.spread(list(a.rounds.values()))[1] and cmp.faster
    noisy = with_rounds(cand("noisy"), [10.5, 11.55, 10.0, 12.2, 10.7, 11.0, 11.3, 11.9])  # slower in 6 of 8 rounds
    assert not noise.compare(noisy, a).faster
    assert "in only 6/8 rounds" in noise.verdict(noisy, a, [a, noisy])


def test_the_spread_is_the_interquartile_range_of_the_round_figures():
    assert noise.spread([1.0]) == (1.0, 1.0)
    assert noise.spread([3.0, 1.0]) == (1.0, 3.0)
    assert noise.spread([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)


def test_a_runs_figure_is_its_fast_tenth_past_the_warm_up_so_a_slow_spell_does_not_move_it():
    def rows(times_ms, peak=0):
        return [{"step_s": t / 1e3, "peak_bytes": {"0": {"device": peak}}} for t in times_ms]
    quiet = [500, 400] + [30.0 + (i % 5) * 0.5 for i in range(50)]          # 30.0..32.0 ms
    spelled = quiet[:2] + quiet[2:22] + [45.0] * 20 + quiet[42:]            # 20 steps in a row 50% slower
    assert run_of(rows(quiet), 2).step_s == run_of(rows(spelled), 2).step_s == pytest.approx(0.030)
    assert run_of(rows(quiet), 2).typical_s == pytest.approx(0.031)      # the median, for step/pred
    assert run_of(rows([10.0] * 3 + [99.0]), 3).step_s == pytest.approx(0.099)   # the warm-up never timed
    assert run_of(rows([40, 20, 30, 10, 50]), 9).step_s == pytest.approx(0.014)  # all, when warm-up leaves none
    assert run_of(rows([30] * 4, peak=7), 1).peak == {"device": 7}


def test_ties_go_to_lower_memory_then_the_simpler_schedule():
    base = [10, 10.4, 10.2, 10.1, 10.3, 10.5, 10.25]
    fast_big = with_rounds(cand("p2", peak=2000, prefetch="2"), [x - 0.1 for x in base])
    slow_small = with_rounds(cand("p0", peak=1000, prefetch="0"), base)
    winner, why = noise.choose_winner([fast_big, slow_small], {"prefetch": ["0", "1", "2"]})
    assert winner is slow_small and why == "2 tie; it has the lowest peak device memory"
    assert noise.verdict(fast_big, winner, [fast_big, slow_small]).startswith("tie with best")

    p1 = with_rounds(cand("p1", peak=1005, prefetch="1"), [x - 0.2 for x in base])   # within 1%: equal memory
    p2 = with_rounds(cand("p2", peak=1000, prefetch="2"), [x - 0.3 for x in base])
    winner, why = noise.choose_winner([p1, p2], {"prefetch": ["2", "1"]})
    assert winner is p1 and "the simplest with equal peak memory" in why      # smaller value, not listed first
    p2.changes = 0                                                           # prefetch 2 is the file's own
    winner, _ = noise.choose_winner([p1, p2], {"prefetch": ["2", "1"]})
    assert winner is p2
    b1 = with_rounds(cand("b", peak=1000, bucket="1MiB"), base)
    b2 = with_rounds(cand("b", peak=1000, bucket="256KiB"), base)
    assert noise.choose_winner([b1, b2], {"bucket": ["1MiB", "256KiB"]})[0] is b2   # sizes by value


def test_a_tie_trailing_by_2_percent_or_more_is_not_traded_for_memory():
    # p0 trails p2 by 4% at the median round but in only 5 of 8 rounds: a tie (unconfirmed), yet
    # not an equal speed; p1 is within 1% of p2: of equal speed, and it has the lower memory
    host = [10, 10.4, 10.2, 10.1, 10.3, 10.5, 10.25, 10.35]
    p2 = with_rounds(cand("p2", peak=3000, prefetch="2"), host)
    p0 = with_rounds(cand("p0", peak=1000, prefetch="0"),
                     [x * f for x, f in zip(host, [1.04, 0.97, 1.06, 1.05, 0.98, 1.04, 0.99, 1.08])])
    p1 = with_rounds(cand("p1", peak=2000, prefetch="1"), [x * 1.008 for x in host])
    order = {"prefetch": ["0", "1", "2"]}
    assert not noise.compare(p0, p2).faster and noise.compare(p0, p2).ratios[1] >= 1.02
    winner, why = noise.choose_winner([p0, p1, p2], order)
    assert winner is p1
    assert why == ("3 tie (1 trailing another by 2% or more round by round, unconfirmed); "
                   "it has the lowest peak device memory")
    assert noise.verdict(p0, winner, [p0, p1, p2]).startswith("tie with best")
    winner, why = noise.choose_winner([p0, p2], order)
    assert winner is p2 and why.endswith("; the only one no other beats by 2% or more round by round")
    # medians of ratios need not be transitive: where each trails another, the one trailing least
    a, b, c = (with_rounds(cand(n), ms) for n, ms in
               (("a", [10, 11, 12] * 3), ("b", [11, 12, 10] * 3), ("c", [12, 10, 11] * 3)))
    assert all(noise.compare(x, y).ratios[1] > 1.02 for x, y in ((a, c), (c, b), (b, a)))
    assert len(noise.equal_speed([a, b, c])) == 1
    winner, why = noise.choose_winner([a, b, c], {})
    assert winner in (a, b, c) and "the only one no other beats" not in why
    assert why.startswith("3 tie, each trailing another by 2% or more round by round (the rounds do not order them)")
    assert why.endswith(f"it trails least, by {noise.trailing([a, b, c])[id(winner)] - 1:.1%}")


def test_a_clear_winner_wins_over_less_memory_and_with_few_rounds_nothing_is_decided():
    fast = with_rounds(cand("fast", peak=5000), [10, 10.5, 10.2, 10.1, 10.3, 10.4, 10.25])
    small = with_rounds(cand("small", peak=1000), [12, 12.5, 12.2, 12.1, 12.3, 12.4, 12.25])
    winner, why = noise.choose_winner([fast, small], {})
    assert winner is fast and why == "faster than every other measured one beyond the spread"
    few_fast = with_rounds(cand("fast", peak=5000), [10, 10.5, 10.2, 10.4])
    few_small = with_rounds(cand("small", peak=1000), [10.1, 10.6, 10.3, 10.5])
    winner, why = noise.choose_winner([few_fast, few_small], {})
    assert winner is few_fast and "undecided: 4 round(s), a verdict needs 7" in why
    assert noise.verdict(few_small, winner, [few_fast, few_small]).startswith("undecided (10.40 vs 10.30 ms")


def test_the_winner_is_judged_by_the_paired_rounds_not_by_medians_over_different_rounds():
    # p0 ran 7 rounds while the host was fast and was dropped, 6% slower in each; the host then
    # slowed by 10% for p2's later rounds: p0's median is the lower, yet p2 beat it in every round
    fast_host = [10, 10.2, 10.1, 10.3, 10.0, 10.2, 10.1]
    p2 = with_rounds(cand("p2", peak=2000, prefetch="2"), fast_host + [11.2] * 12)
    p0 = with_rounds(cand("p0", peak=1000, prefetch="0"), [x * 1.06 for x in fast_host])
    assert p0.measured_s < p2.measured_s
    winner, why = noise.choose_winner([p0, p2], {"prefetch": ["0", "1", "2"]})
    assert winner is p2 and why == "faster than every other measured one beyond the spread"
    assert noise.verdict(p0, p2, [p0, p2]).startswith("slower by 6% (")


def test_the_cost_model_gap_line_names_pairs_predicted_equal_but_measured_apart():
    a = with_rounds(cand("a", predicted_ms=12.0, prefetch="2"), [10, 10.5, 10.2, 10.1, 10.3, 10.4, 10.25])
    b = with_rounds(cand("b", predicted_ms=12.1, prefetch="1"), [14, 14.5, 14.2, 14.1, 14.3, 14.4, 14.25])     # within 1%
    c = with_rounds(cand("c", predicted_ms=20.0, prefetch="0"), [18, 18.5, 18.2, 18.1, 18.3, 18.4, 18.25])  # predicted apart
    # measured a tie with a
    d = with_rounds(cand("d", predicted_ms=12.0, prefetch="3"), [10.1, 10.4, 10.3, 10.0, 10.2, 10.5, 10.35])
    lines = noise.model_gaps([a, b, c, d])
    assert len(lines) == 2, lines
    assert lines[0].startswith("the cost model does not see the difference between prefetch=2 and prefetch=1 "
                               "(predicted 12.00 vs 12.10 ms, measured 10.25 vs 14.25 ms, spreads ")
    assert lines[1].startswith("the cost model does not see the difference between prefetch=3 and prefetch=1 ")


@pytest.mark.parametrize("typical_ms, says", [
    ({"a": 8.2, "b": 8.4}, "every candidate ran 16-18% faster than planned (step/pred 0.82-0.84)"),
    ({"a": 12.0, "b": 11.8}, "every candidate ran 18-20% slower than planned (step/pred 1.18-1.20)"),
    ({"a": 8.2, "b": 9.0}, None),           # one within 15%: the profile may hold, one schedule not
    ({"a": 8.2, "b": 12.0}, None),          # off both ways: not the machine's speed
])
def test_every_candidate_far_off_its_prediction_the_same_way_says_the_profile_is_off(typical_ms, says):
    cands = []
    for label, ms in typical_ms.items():
        c = with_rounds(cand(label, predicted_ms=10.0), [ms] * 3)
        c.typical = {r: ms / 1e3 for r in c.rounds}
        cands.append(c)
    line = noise.profile_off(cands)
    assert (line is None) if says is None else line.startswith(says + ": the machine's speed has moved")


def test_the_profile_line_says_which_profile_and_how_to_measure_again():
    from zdsl.tune.cli import profile_advice
    cached = "rates: calibrated on this machine (cached 2026-11-27 07:30 UTC, /c/machine.json)"
    assert profile_advice(cached) == ("planned with calibrated on this machine (cached 2026-11-27 07:30 UTC, "
                                      "/c/machine.json); `zdsl calibrate` measures this machine again")
    default = "rates: zdsl's uncalibrated default 'cpu' profile; calibrate: zdsl calibrate"
    assert profile_advice(default) == ("planned with zdsl's uncalibrated default 'cpu' profile; "
                                       "`zdsl calibrate` measures this machine again")
    assert "schedule's own machine statement; `zdsl calibrate --out FILE`" in profile_advice(None)


# -- ranges and pruning ---------------------------------------------------------------------------------

def test_ranges_expand_integers_by_one_and_sizes_by_doubling():
    assert dict(parse_vary(["prefetch=0..4"])) == {"prefetch": ["0", "1", "2", "3", "4"]}
    assert dict(parse_vary(["bucket=256KiB..16MiB"]))["bucket"] == \
        ["256KiB", "512KiB", "1MiB", "2MiB", "4MiB", "8MiB", "16MiB"]
    assert ranges.expand("bucket", "3MiB..16MiB") == ["3MiB", "6MiB", "12MiB", "16MiB"]
    assert dict(parse_vary(["bucket=0,1KiB..4KiB"]))["bucket"] == ["0", "1KiB", "2KiB", "4KiB"]
    assert len(combinations(parse_vary(["prefetch=0..2", "bucket=1MiB..4MiB"]))) == 9
    assert dict(parse_vary(['model=hf("../a"),hf("../b")']))["model"] == ['hf("../a")', 'hf("../b")']   # paths


@pytest.mark.parametrize("item, says", [
    ("prefetch=0..", "a range needs both ends"),
    ("prefetch=..4", "a range needs both ends"),
    ("prefetch=4..1", "write prefetch=1..4"),
    ("prefetch=2..2", "write the single value prefetch=2"),
    ("bucket=1MiB..x", "'x' is neither an integer nor a size"),
    ("bucket=1MiB..4Mib", "did you mean 'MiB'"),
    ("bucket=0..16MiB", "list 0 on its own: bucket=0,1KiB..16MiB"),
    ("prefetch=0..1000", "more than 64 values; narrow the range"),
    ("prefetch=0,0..2", "listed twice"),
    ("prefetchh=0..4", "did you mean 'prefetch'"),
])
def test_bad_ranges_are_usage_errors_with_a_fix(item, says, capsys):
    with pytest.raises(TuneUsageError, match=None) as info:
        parse_vary([item])
    assert says in str(info.value)
    with pytest.raises(SystemExit) as stop:
        main(["tune", ZERO3, "--vary", item, "--measure", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "zdsl tune: error" in err and "Traceback" not in err


def test_the_planner_prunes_what_cannot_win_before_anything_runs():
    cands = predict(ZERO3, {}, combinations(parse_vary(["prefetch=0..2", "bucket=64KiB..256KiB"])))
    survivors = prune(cands, 1.5)
    best = min(c.predicted_s for c in cands)
    assert survivors and all(c.predicted_s <= 1.5 * best for c in survivors)
    pruned = [c for c in cands if c.pruned]
    assert pruned and all(c.predicted_s > 1.5 * best for c in pruned)
    assert all("x the best predicted" in c.pruned and "pruned above 1.5x" in c.pruned for c in pruned)
    fake = [cand("a", predicted_ms=10), cand("b", predicted_ms=14.9), cand("c", predicted_ms=15.1)]
    assert [c.label for c in prune(fake, 1.5)] == ["name=a", "name=b"] and fake[2].pruned.startswith("predicted 1.51x")


def test_tune_planner_only_prints_pruned_rows(tmp_path, capsys):
    status = main(["tune", ZERO3, "--vary", "prefetch=0..2", "bucket=64KiB..256KiB", "--measure", "0",
                   "--out", str(tmp_path / "w.zs"), "--json", str(tmp_path / "t.json")])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "pruned (predicted over 1.5x the best); measuring 0" in err
    assert "pruned: predicted" in out and "best (predicted; not measured)" in out
    assert (tmp_path / "w.zs").is_file()
    got = json.loads((tmp_path / "t.json").read_text())
    assert got["stopped"] == "planner only" and len(got["candidates"]) == 9
    assert got["winner"] == next(c["label"] for c in got["candidates"] if c["predicted_rank"] == 1)
    assert {c["verdict"].split(":")[0] for c in got["candidates"] if c["pruned"]} == {"pruned"}


@pytest.mark.parametrize("option, says", [
    (["--budget", "0"], "--budget must be a positive number of seconds"),
    (["--rounds", "5"], "--rounds must be at least 7"),
    (["--steps", "2", "--warmup", "2"], "--steps must exceed --warmup (2)"),
    (["--prune", "0.5"], "--prune must be 1 or more"),
])
def test_bad_measuring_options_are_usage_errors(option, says, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["tune", ZERO3, "--vary", "prefetch=0..1", *option])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_combinations_that_compile_to_the_same_task_graph_are_run_once(tmp_path, capsys):
    # zero3.zs's units' gradients are each far under 256KiB: every bucket from there up is one
    # reduce-scatter per unit, the same ops; a 4KiB bucket cuts them, another graph
    cands = predict(ZERO3, {}, combinations(parse_vary(["prefetch=1,2", "bucket=1MiB,4KiB,256KiB"])))
    keys = {(c.combo["prefetch"], c.combo["bucket"]): c.run_key for c in cands}
    assert keys["1", "1MiB"] == keys["1", "256KiB"] != keys["1", "4KiB"]
    assert keys["1", "1MiB"] != keys["2", "1MiB"]
    own = run_identity(compile_file(ZERO3, {}, simulate=False).graph)[1]
    survivors = prune(cands, 1e9)
    kept = same_runs(survivors, own, {"bucket": ["1MiB", "4KiB", "256KiB"]})
    assert len(kept) == 4 and kept == [c for c in survivors if not c.same_run]      # in predicted order
    assert {(c.combo["prefetch"], c.combo["bucket"]) for c in kept} == {("1", "4KiB"), ("2", "4KiB"),
                                                                         ("1", "256KiB"), ("2", "256KiB")}
    merged = [c for c in cands if c.same_run]
    assert [c.same_run for c in merged] == ["prefetch=1 bucket=256KiB", "prefetch=2 bucket=256KiB"]
    # the file's own bucket is kept over a smaller one listed first where both run alike
    bucket_1m = compile_file(ZERO3, {"bucket": "1MiB"}, simulate=False).graph
    again = predict(ZERO3, {}, combinations(parse_vary(["bucket=256KiB,1MiB"])))
    assert same_runs(again, run_identity(bucket_1m)[1], {})[0].combo == {"bucket": "1MiB"}

    status = main(["tune", ZERO3, "--vary", "prefetch=1,2", "bucket=1MiB,4KiB,256KiB", "--measure", "0",
                   "--out", str(tmp_path / "w.zs"), "--json", str(tmp_path / "t.json")])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "2 the same task graph as another (run once); measuring 0" in err
    assert "the same task graph as prefetch=1 bucket=256KiB (bucket changes nothing here): run once, as it" \
        in " ".join(out.split())
    rows = json.loads((tmp_path / "t.json").read_text())["candidates"]
    assert sorted(r["label"] for r in rows if r["same_run"]) == ["prefetch=1 bucket=1MiB", "prefetch=2 bucket=1MiB"]


def test_a_tie_gives_the_rows_own_figures_over_the_best_round_by_round():
    # c's median is the lower, yet c is slower in 4 of 7 rounds and 2.5% behind at the median ratio:
    # the ratio printed is c's over the best's, the way its medians are printed, not the other way
    best = with_rounds(cand("best"), [10, 11, 12, 13, 14, 15, 16])
    c = with_rounds(cand("c"), [10.3, 11.3, 12.3, 12.5, 13.5, 14.5, 16.5])
    text = noise.verdict(c, best, [best, c])
    assert text.startswith("tie with best (12.50 vs 13.00 ms; 1.025x (spread ")
    assert "the best's round by round" in text
