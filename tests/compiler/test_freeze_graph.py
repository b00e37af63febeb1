"""``freeze`` in the task graph: a unit with nothing to train has no gradient or optimizer
buffers, no reduce-scatter or all-reduce, no step and (when nothing before it trains) no
backward; its parameters are still gathered for every use. ``zdsl plan`` shows the saving."""
from __future__ import annotations

import dataclasses
import math

import pytest

from zdsl.check.checker import check_text
from zdsl.model.layout import unit_layout
from zdsl.compile.instantiate import LoweringError
from zdsl.model.units import UnitSpec
from zdsl.model.units import gpt_units
from zdsl.driver import compile_schedule
from zdsl.planner.report import build_plan

UNITS = gpt_units(layers=2, width=64, heads=4, vocab=256, context=32)   # embedding, block.0, block.1, head


def graph_of(freeze: str, stage: int = 3, extra: str = ""):
    text = f"""schedule t
model gpt(layers=2, width=64, heads=4)
data corpus("stdlib", context=32)
train steps=4, batch=2
ranks 2
zero {stage}
{extra}
{freeze}
"""
    schedule = check_text(text, "t.zs", {})[0]
    return schedule, compile_schedule(schedule, UNITS)


def ops_of(graph, kind: str, unit: int):
    return [op for op in graph.ops if op.kind == kind and op.unit == unit]


def state_buffers(graph, unit: int) -> set[str]:
    return {b.kind for b in graph.buffers.values() if b.unit == unit and b.kind in ("grad_full", "grad_shard", "optim")}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_frozen_unit_has_no_gradients_optimizer_reductions_or_step(stage):
    _, g = graph_of("freeze embedding.*", stage)
    _, plain = graph_of("", stage)
    assert [u.trains for u in g.units] == [False, True, True, True]
    assert g.units[0].frozen == [0, 1] and g.units[1].frozen is None
    assert state_buffers(g, 0) == set() and state_buffers(plain, 0)
    assert state_buffers(g, 1) == state_buffers(plain, 1)
    for kind in ("comm.reduce_scatter", "comm.all_reduce", "compute.step", "compute.backward"):
        assert not ops_of(g, kind, 0), kind
    assert ops_of(g, "compute.step", 1) and ops_of(g, "compute.forward", 0)
    # the head reads the tied wte, frozen there too: its backward writes no gradient of unit 0
    head = ops_of(g, "compute.backward", 3)[0]
    assert "grad_full[0]" not in head.writes and "param_full[0]" in head.reads
    # nothing before block.0 trains: it does not hand back an input gradient
    assert "act_grad[1]" not in ops_of(g, "compute.backward", 1)[0].writes
    if stage == 3:      # the frozen unit is still gathered, for the forward and for the head's use
        assert {op.phase for op in ops_of(g, "comm.all_gather", 0)} == {"forward"}
        assert len(ops_of(g, "comm.all_gather", 0)) == len(ops_of(plain, "comm.all_gather", 0))


def test_a_frozen_middle_unit_still_passes_the_gradient_back():
    _, g = graph_of("freeze block.0.*", 3)
    backward = ops_of(g, "compute.backward", 1)
    assert len(backward) == 1 and backward[0].writes == ["act_grad[1]"]
    assert not ops_of(g, "comm.reduce_scatter", 1) and not ops_of(g, "compute.step", 1)
    assert ops_of(g, "compute.backward", 0) and ops_of(g, "compute.step", 0)


def test_a_frozen_head_still_runs_its_backward_for_the_tied_weight():
    _, g = graph_of("freeze head.*, block.*", 3)
    assert [u.trains for u in g.units] == [True, False, False, False]
    head = ops_of(g, "compute.backward", 3)[0]
    assert "grad_full[0]" in head.writes and "grad_full[3]" not in head.writes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_partly_frozen_unit_holds_and_reduces_only_its_trainable_parts(stage):
    _, g = graph_of('freeze "*.bias", "*.ln_?.weight"', stage, "bucket 4KiB")
    _, plain = graph_of("", stage, "bucket 4KiB")
    spec, unit = UNITS[1], g.units[1]
    frozen = [i for i, (n, _) in enumerate(spec.params) if n.endswith(".bias") or n.startswith("ln_")]
    assert all(u.trains for u in g.units[1:3]) and not g.units[3].trains and unit.frozen == frozen
    lay, plain_lay = unit_layout(unit, 2), unit_layout(plain.units[1], 2)
    trainable = sum(math.prod(spec.params[i][1]) for i in range(len(spec.params)) if i not in frozen)
    assert lay.frozen_parts >= 1 and trainable <= lay.trainable_numel < plain_lay.padded_numel
    assert lay.padded_numel < plain_lay.padded_numel + 2 * 4096    # two regions: at most a part more padding
    for kind in ("grad_full", "grad_shard", "optim"):
        mine = [b.bytes for b in g.buffers.values() if b.kind == kind and b.unit == 1]
        theirs = [b.bytes for b in plain.buffers.values() if b.kind == kind and b.unit == 1]
        assert len(mine) == len(theirs) and (not theirs or sum(mine) < sum(theirs)), kind
    reductions = ("comm.reduce_scatter", "comm.all_reduce")
    sent = sum(op.bytes for op in g.ops if op.unit == 1 and op.kind in reductions)
    assert sent == lay.trainable_numel * 4 < sum(op.bytes for op in plain.ops if op.unit == 1 and op.kind in reductions)
    if stage == 3:    # every part is gathered, frozen ones too
        gathered = [op for op in g.ops if op.unit == 1 and op.kind == "comm.all_gather" and op.phase == "forward"]
        assert sum(op.bytes for op in gathered) == lay.padded_numel * 4 and len(gathered) == lay.parts
    # registration order -> flat buffer: the trainable parameters first, then the frozen ones
    first_trainable = sum(math.prod(spec.params[i][1]) for i in range(min(set(range(len(spec.params))) - set(frozen))))
    assert (first_trainable, 0) in {(lo, flat) for lo, flat, _ in lay.runs}
    assert (0, lay.trainable_numel) in {(lo, flat) for lo, flat, _ in lay.runs}     # ln_1.weight, frozen


def test_decay_ranges_follow_the_frozen_layout():
    _, g = graph_of('freeze "*.ln_?.weight"', 3, "optimizer adamw(weight_decay=0.1, no_decay=(biases))")
    unit, spec = g.units[1], UNITS[1]
    lay = unit_layout(unit, 2)
    offsets, logical = {}, 0
    for i, (name, shape) in enumerate(spec.params):
        for lo, flat, n in lay.runs:
            if lo <= logical < lo + n:
                offsets[name] = (flat + logical - lo, math.prod(shape))
        logical += math.prod(shape)
    decays = {name for name, (o, n) in offsets.items() if any(a <= o and o + n <= b for a, b in unit.decay)}
    assert decays == {name for name, _ in spec.params if not name.endswith(".bias")}


def test_a_frozen_graph_round_trips_its_json():
    _, frozen = graph_of("freeze embedding.*", 3)
    assert type(frozen).from_json(frozen.to_json()).digest() == frozen.digest()


def test_plan_shows_what_freeze_saves():
    schedule, g = graph_of("freeze embedding.*", 3, "offload optimizer -> cpu")
    _, plain = graph_of("", 3, "offload optimizer -> cpu")
    plan = build_plan(g, schedule, units=UNITS).freeze
    assert plan.frozen == UNITS[0].numel and plan.units_frozen == 1
    shard = plain.units[0].shard_numel
    assert plan.not_held["host"] == {"gradients": shard * 4, "optimizer": shard * 12}
    assert plan.not_sent == shard * 2 * 4            # the reduce-scatter of unit 0, its payload
    assert "frozen" in plan.line() and build_plan(plain, dataclasses.replace(schedule, freeze=()), units=UNITS).freeze is None


def test_an_unmatched_freeze_glob_on_a_model_sized_later_is_a_positioned_error():
    schedule, _ = graph_of("freeze embedding.*", 3)
    units = [UnitSpec("a", [("w", (4, 4))]), UnitSpec("b", [("w", (4, 4))])]
    with pytest.raises(LoweringError) as info:
        compile_schedule(schedule, units)
    assert "matches no parameter" in str(info.value) and "a.w" in info.value.hint
    assert info.value.span is not None and info.value.span.line == 8
