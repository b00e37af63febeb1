"""`zdsl tune`'s rounds: a round's candidates run as variants of one launch (`zdsl run --variants`).

Each variant is a fresh run of its own (the same per-step losses as its separate `zdsl run`, bit for
bit); a variant that fails in its run is named, by the launch and by the tuner's one-by-one rerun; a bad variants file or a
variant that does not check is a message before any rank starts; the order changes each round.
2 ranks, 3 steps a run, six launches: about 20 s on a quiet 2-core machine (a round measured in one
launch end to end is tests/e2e/test_tune.py's).
"""
from __future__ import annotations

import json

import pytest

from helpers import SMALL, zdsl

from zdsl.tune.measure import Run, RunFailed, measure_round
from zdsl.tune.rounds import race, round_order
from zdsl.tune.search import Candidate


def losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def cand(**combo) -> Candidate:
    return Candidate(dict(combo), dict(combo), predicted_s=0.01, predicted_peak={"device": 1000})


@pytest.mark.slow      # spawns ranks
def test_each_variant_is_a_fresh_run_with_its_own_schedule_and_metrics(tmp_path):
    zs = tmp_path / "small.zs"
    zs.write_text(SMALL)
    first, second, alone = tmp_path / "v1.jsonl", tmp_path / "v2.jsonl", tmp_path / "alone.jsonl"
    spec = tmp_path / "variants.json"
    spec.write_text(json.dumps([{"overrides": ["prefetch=0"], "metrics": str(first)},
                                {"overrides": ["prefetch=1", "seed=7"], "metrics": str(second)}]))
    batched = zdsl("run", str(zs), "--set", "steps=3", "--variants", str(spec), "--quiet")
    assert batched.returncode == 0, batched.stderr
    single = zdsl("run", str(zs), "--set", "steps=3", "--set", "prefetch=1", "--set", "seed=7",
                  "--metrics", str(alone), "--quiet")
    assert single.returncode == 0, single.stderr
    assert len(losses(first)) == 3 and len(losses(second)) == 3
    assert losses(second) == losses(alone)              # started afresh after the first, bit for bit
    assert losses(first) != losses(second)              # its own seed: its own compiled schedule


def test_a_variant_that_does_not_check_is_named_before_any_rank_starts(tmp_path):
    zs = tmp_path / "small.zs"
    zs.write_text(SMALL)
    spec = tmp_path / "variants.json"
    spec.write_text(json.dumps([{"overrides": ["prefetch=0"], "metrics": str(tmp_path / "a.jsonl")},
                                {"overrides": ["prefetch=banana"], "metrics": str(tmp_path / "b.jsonl")}]))
    proc = zdsl("run", str(zs), "--variants", str(spec))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "variant 2 of 2 (prefetch=banana) does not check" in proc.stderr, proc.stderr
    assert not (tmp_path / "a.jsonl").exists()                # nothing ran
    spec.write_text("{not json")
    proc = zdsl("run", str(zs), "--variants", str(spec))
    assert proc.returncode == 2 and "cannot read the variants file" in proc.stderr and "Traceback" not in proc.stderr
    spec.write_text(json.dumps([{"overrides": ["prefetch=0"]}]))
    proc = zdsl("run", str(zs), "--variants", str(spec))
    assert proc.returncode == 2 and "variant 1: \"metrics\" must be" in proc.stderr


DATA = """\
import torch
def tokens(seed, step, micro, rank, world, batch):
    if seed == 7 and step >= 1:
        raise ValueError("no batches for seed 7 after step 1")
    g = torch.Generator().manual_seed(seed * 100003 + step * 1009 + micro * 101 + rank)
    rows = torch.randint(64, (batch, 9), generator=g)
    return rows[:, :-1], rows[:, 1:]
"""


@pytest.mark.slow      # spawns ranks
def test_a_candidate_failing_in_its_run_is_named_and_the_others_still_measured(tmp_path):
    """Seed 7's data fails at step 2, inside the ranks: the launch names the variant, and the
    tuner, running the round's candidates one by one, gives the failure to that candidate only."""
    (tmp_path / "data.py").write_text(DATA)
    zs = tmp_path / "small.zs"
    zs.write_text(SMALL.replace("synthetic(vocab=64, context=8)", 'python("data.py:tokens")'))
    spec = tmp_path / "variants.json"
    spec.write_text(json.dumps([{"overrides": ["prefetch=0"], "metrics": str(tmp_path / "a.jsonl")},
                                {"overrides": ["prefetch=1", "seed=7"], "metrics": str(tmp_path / "b.jsonl")}]))
    proc = zdsl("run", str(zs), "--set", "steps=3", "--variants", str(spec), "--quiet")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert ("no batches for seed 7 after step 1 (in variant 2 of 2 (prefetch=1 seed=7))" in proc.stderr), proc.stderr
    good, bad = cand(prefetch="0"), cand(prefetch="1", seed="7")
    out = measure_round(str(zs), [good, bad], steps=3, warmup=1, timeout_s=120)
    assert isinstance(out[good.label], Run) and out[good.label].step_s > 0 and out[good.label].peak
    assert isinstance(out[bad.label], RunFailed) and "tokens(seed=7, step=1" in str(out[bad.label]), out


def test_the_order_changes_each_round_and_follows_the_candidates_left():
    a, b, c = cand(name="a"), cand(name="b"), cand(name="c")
    orders = []

    def fake(cands):
        orders.append([x.label for x in cands])
        return {x.label: (RunFailed("out of memory") if x is c and len(orders) == 2 else Run(0.01, {}))
                for x in cands}

    race([a, b, c], fake, budget_s=1e9, max_rounds=6, say=lambda line: None)
    assert orders[:2] == [["name=a", "name=b", "name=c"], ["name=a", "name=c", "name=b"]]
    assert c.failed == "out of memory" and list(c.rounds) == [1]           # not run again
    assert orders[2:] == [["name=a", "name=b"], ["name=b", "name=a"], ["name=a", "name=b"], ["name=b", "name=a"]]


@pytest.mark.parametrize("n", range(1, 10))
def test_over_a_cycle_of_rounds_each_candidate_runs_in_each_place_and_after_each_other_equally(n):
    """A rotation (A B C, B C A, C A B) keeps every candidate behind the same one, whose warm heap
    or caches it inherits round after round; the rounds' orders must not."""
    from collections import Counter
    cycle = n if n % 2 == 0 else 2 * n
    rows = [round_order(list(range(n)), r) for r in range(cycle)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    places = Counter((i, x) for row in rows for i, x in enumerate(row))
    after = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    assert set(places.values()) == {cycle // n}
    assert len(after) == n * (n - 1) and set(after.values()) <= {cycle // n}
