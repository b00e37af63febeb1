"""``freeze`` in the task graph: a unit with nothing to train has no gradient or optimizer
buffers, no reduce-scatter or all-reduce, no step and (when nothing before it trains) no
backward; its parameters are still gathered for every use. ``zdsl plan`` shows the saving."""
from __future__ import annotations

import dataclasses
import json

import pytest

from zdsl.check.checker import check_text
from zdsl.compile.instantiate import LoweringError
from zdsl.compile.units import UnitSpec
from zdsl.compile.units import gpt_units
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


def test_partly_frozen_units_train_and_say_which_parameters_do_not():
    _, g = graph_of('freeze "*.bias"', 3)
    assert all(u.trains for u in g.units)
    assert g.units[1].frozen == [i for i, (n, _) in enumerate(UNITS[1].params) if n.endswith(".bias")]


def test_graphs_without_freeze_keep_their_json():
    _, g = graph_of("", 3)
    raw = json.loads(g.to_json())
    assert all("frozen" not in u and "trains" not in u for u in raw["units"])
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
