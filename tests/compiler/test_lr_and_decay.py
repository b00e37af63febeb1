"""The rate schedule's formula, the weight-decay groups, and their bad values as positioned errors.

The runtime's bits against torch (LambdaLR, two param groups) are in tests/parity/test_lr_schedule.py.
"""
from __future__ import annotations

import math

import pytest

from zdsl.check.checker import check_text
from zdsl.model.decay import decay_groups
from zdsl.model.units import gpt_units
from zdsl.driver import compile_file
from zdsl.lang.errors import ZsError
from zdsl.lr import LrSchedule

HEADER = ("model gpt(layers=2, width=64, heads=4, vocab=256, context=32)\n"
          "data corpus(\"stdlib\", context=32)\n"
          "train steps=10, batch=4\n")


# -- the formula ------------------------------------------------------------------------------

def test_warmup_then_cosine_to_min_lr_by_hand():
    r = LrSchedule(lr=1.0, steps=10, warmup=3, decay="cosine", min_lr=0.1)
    assert [r.factor(s) for s in range(3)] == [1 / 4, 2 / 4, 3 / 4]      # step 0 runs at lr/(W+1)
    for s in range(3, 10):                                                 # decay over the other 7 steps
        p = (s + 1 - 3) / 7
        assert r.factor(s) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)), abs=1e-15)
    assert r.at(9) == pytest.approx(0.1, abs=1e-15)                      # the last step reaches min_lr


@pytest.mark.parametrize("lr,min_lr", [(3e-3, 3e-4), (4.0, 1.0)])
def test_cosine_decays_to_min_lr_as_a_rate_at_rates_other_than_one(lr, min_lr):
    # lr 1 hides min_lr read as a factor of lr (min_lr * lr == min_lr there): these rates do not.
    # 10 steps, 2 of warmup, cosine over the other 8: p = (s - 1) / 8, so step 5 is mid-cosine.
    r = LrSchedule(lr=lr, steps=10, warmup=2, decay="cosine", min_lr=min_lr)
    assert [r.at(0), r.at(1)] == pytest.approx([lr / 3, 2 * lr / 3], rel=1e-15)    # lr (s+1)/(W+1)
    assert r.at(5) == pytest.approx((lr + min_lr) / 2, rel=1e-14)                 # cos(pi/2) = 0: halfway
    quarter = min_lr + (lr - min_lr) * (1 + math.sqrt(0.5)) / 2                   # p = 1/4: cos(pi/4)
    assert r.at(3) == pytest.approx(quarter, rel=1e-14)
    assert r.at(9) == pytest.approx(min_lr, rel=1e-14)                            # the last step: min_lr


def test_linear_decays_to_min_lr_as_a_rate():
    r = LrSchedule(lr=2.0, steps=10, warmup=2, decay="linear", min_lr=0.5, decay_steps=4)
    assert [r.at(s) for s in range(10)] == pytest.approx(      # 0.5 + 1.5 * (1 - p), p = 1/4 .. 1
        [2 / 3, 4 / 3, 2, 2, 2, 2, 1.625, 1.25, 0.875, 0.5], rel=1e-15)


def test_linear_with_a_stable_stretch_and_decay_steps():
    r = LrSchedule(lr=2.0, steps=10, warmup=2, decay="linear", min_lr=0.0, decay_steps=4)
    assert [r.at(s) for s in range(10)] == pytest.approx(
        [2 / 3, 4 / 3, 2, 2, 2, 2, 1.5, 1.0, 0.5, 0.0], abs=1e-15)


def test_constant_is_exactly_lr_and_a_long_warmup_is_clamped_to_the_steps():
    assert all(LrSchedule(lr=3e-3, steps=5).at(s) == 3e-3 for s in range(5))
    assert LrSchedule(lr=3e-3, steps=5).constant
    long = LrSchedule(lr=1.0, steps=4, warmup=100, decay="cosine")        # torchtitan: warmup = steps
    assert [long.factor(s) for s in range(4)] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]


def test_of_reads_the_graph_config_with_defaults():
    r = LrSchedule.of({"lr": 0.5, "warmup": 1, "decay": "linear", "min_lr": 0.1}, steps=3)
    assert (r.lr, r.warmup, r.decay, r.min_lr, r.decay_steps, r.steps) == (0.5, 1, "linear", 0.1, None, 3)
    assert LrSchedule.of({"lr": 0.5}, steps=3).constant


# -- bad values: positioned ---------------------------------------------------------------------

def first_error(optimizer: str):
    with pytest.raises(ZsError) as exc:
        check_text(HEADER + f"optimizer {optimizer}\n", "t.zs")
    d = [x for x in exc.value.diagnostics if x.is_error][0]
    return d, (d.span.line, d.span.column)


@pytest.mark.parametrize("optimizer, at, words", [    # at: the text the error must point at
    ("adamw(lr=1e-3, warmup=-1)", "-1", "warmup must be at least 0"),
    ("adamw(lr=1e-3, decay=cosin)", "cosin", "unknown decay"),
    ("adamw(lr=1e-3, decay=cosine, min_lr=2e-3)", "2e-3", "min_lr 0.002 is above lr 0.001"),
    ("adamw(lr=1e-3, min_lr=1e-4)", "1e-4", "no effect with decay=constant"),
    ("adamw(lr=1e-3, warmup=4, decay=linear, decay_steps=7)", "7", "more than the 10 training steps"),
    ("adamw(lr=1e-3, no_decay=(biases, norm))", "norm)", "no_decay takes biases, norms, embeddings"),
    ("sgd(lr=0.1, no_decay=3)", "3", "no_decay takes"),
])
def test_bad_values_are_positioned_errors(optimizer, at, words):
    d, where = first_error(optimizer)
    assert where == (4, len("optimizer ") + optimizer.rindex(at) + 1) and words in d.message, (where, d.message)


def test_misspelt_decay_and_class_get_the_nearest():
    assert "cosine" in first_error("adamw(lr=1e-3, decay=cosin)")[0].hint
    assert "'norms'" in first_error("adamw(lr=1e-3, no_decay=(biases, norm))")[0].hint


def test_warmup_longer_than_training_warns_as_torchtitan_does():
    s, diags = check_text(HEADER + "optimizer adamw(lr=1e-3, warmup=20)\n", "t.zs")
    assert s.optimizer.warmup == 20
    (w,) = [d for d in diags if d.severity == "warning"]
    assert (w.span.line, w.span.column) == (4, 33) and "longer than the 10 training steps" in w.message


def test_no_decay_without_weight_decay_warns():
    _, diags = check_text(HEADER + "optimizer adamw(lr=1e-3, no_decay=(biases, norms))\n", "t.zs")
    (w,) = [d for d in diags if d.severity == "warning"]
    assert (w.span.line, w.span.column) == (4, 26) and "no_decay has no effect" in w.message


def test_unmatched_glob_is_positioned_with_the_closest_names(tmp_path):
    path = tmp_path / "t.zs"
    path.write_text(HEADER + 'optimizer adamw(lr=1e-3, weight_decay=0.1, no_decay=(norms, "*c_atn*"))\n')
    c = compile_file(str(path), {}, simulate=False)
    (d,) = [x for x in c.diagnostics if x.is_error]
    assert (d.span.line, d.span.column) == (4, 44) and "'*c_atn*' matches no parameter" in d.message
    assert "attn.c_attn" in d.hint


# -- the groups ---------------------------------------------------------------------------------

UNITS = gpt_units(layers=2, width=64, heads=4, vocab=256, context=32)


def test_classes_by_name_and_shape():
    g = decay_groups(UNITS, ("biases", "norms"), ())
    d, V, T = 64, 256, 32
    biases = 2 * (d + 3 * d + d + d + 4 * d + d) + d          # per block: ln_1, c_attn, c_proj, ln_2, c_fc, proj
    norms = 2 * (2 * d) + d
    assert g.exempt == {"biases": biases, "norms": norms}
    assert g.decay == V * d + T * d + 2 * 12 * d * d          # nanoGPT: every >=2-D weight, embeddings too
    assert g.ranges[0] == [(0, V * d + T * d)] and g.ranges[3] == []
    # block: ln_1 (2d) first, then c_attn.weight (3d x d) decays; its bias does not
    assert g.ranges[1][0] == (2 * d, 2 * d + 3 * d * d)
    emb = decay_groups(UNITS, ("embeddings",), ())
    assert emb.exempt == {"embeddings": V * d + T * d} and emb.ranges[0] == []


def test_globs_match_the_name_within_the_unit_or_with_the_unit_in_front():
    a = decay_groups(UNITS, (), ("ln_*",))
    b = decay_groups(UNITS, (), ("block.*.ln_*", "head.ln_f.*"))
    # ln_1 and ln_2 (weight and bias) in two blocks, ln_f in the head
    assert a.ranges == b.ranges and a.exempt == b.exempt == {"names": 2 * 4 * 64 + 2 * 64}
    assert decay_groups(UNITS, (), ("block.1.*",)).ranges[1] == [(0, UNITS[1].numel)]
    assert decay_groups(UNITS, (), ("block.1.*",)).ranges[2] == []


def test_graph_carries_the_ranges_and_the_digest_moves_only_with_the_options(tmp_path):
    plain = tmp_path / "plain.zs"
    plain.write_text(HEADER + "optimizer adamw(lr=1e-3, weight_decay=0.1)\nranks 2\nzero 3\n")
    grouped = tmp_path / "grouped.zs"
    grouped.write_text(HEADER + "optimizer adamw(lr=1e-3, weight_decay=0.1, no_decay=(biases, norms))\n"
                                "ranks 2\nzero 3\n")
    scheduled = tmp_path / "scheduled.zs"
    scheduled.write_text(HEADER + "optimizer adamw(lr=1e-3, weight_decay=0.1, warmup=2)\nranks 2\nzero 3\n")
    p, g, s = (compile_file(str(f), {}, simulate=False).graph for f in (plain, grouped, scheduled))
    assert all(u.decay is None for u in p.units)
    assert p.config["optimizer"]["warmup"] == 0 and p.config["optimizer"]["no_decay"] == []
    assert [u.decay for u in g.units] == [[tuple(r) for r in x] for x in
                                          decay_groups(UNITS, ("biases", "norms"), ()).ranges]
    assert len({p.digest(), g.digest(), s.digest()}) == 3
    from zdsl.ir import TaskGraph
    assert TaskGraph.from_json(g.to_json()).to_json() == g.to_json()


def test_plan_lists_the_groups_and_the_rate(tmp_path):
    from zdsl.planner.report import build_plan, render_plan
    path = tmp_path / "t.zs"
    path.write_text(HEADER + "optimizer adamw(lr=1e-3, weight_decay=0.1, warmup=2, decay=cosine, min_lr=1e-4, "
                             "no_decay=(biases, norms))\n")
    c = compile_file(str(path), {}, simulate=True)
    plan = build_plan(c.graph, c.schedule, c.sim)
    text = render_plan(plan)
    g = decay_groups(UNITS, ("biases", "norms"), ())
    assert plan.to_json()["weight_decay_groups"] == {"decay": g.decay, "no_decay": sum(g.exempt.values())}
    assert f"weight decay 0.1 on {g.decay:,} parameters" in text
    assert f"none on {sum(g.exempt.values()):,}" in text and "biases, norms" in text
    assert "lr 0.001: warmup 2 steps, then cosine to 0.0001" in text
