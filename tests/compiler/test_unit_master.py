"""The graph says, per unit, whether an fp32 master copy lives with the optimizer state, and the
optimizer buffer is sized by that same fact (the runtime reads it, it does not re-derive it)."""
import pytest

from zdsl.driver import compile_schedule
from zdsl.model.units import gpt_units
from zdsl.ir import TaskGraph
from zdsl.ir import optimizer_bytes_per_param
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Placement
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec

UNITS = gpt_units(layers=2, width=16, heads=2, vocab=31, context=8)


def graph(stage: int, precision: str, placement=None, optimizer="adamw", momentum=0.0) -> TaskGraph:
    s = Schedule(name="t", ranks=2, stage=stage, train=TrainSpec(precision=precision, batch=2),
                 optimizer=OptimizerSpec(kind=optimizer, momentum=momentum), placement=placement or {})
    return compile_schedule(s, UNITS)


@pytest.mark.parametrize("stage, precision, placement, master", [
    (0, "fp32", None, False),
    (2, "fp32", None, False),
    (3, "fp32", None, False),
    (1, "bf16", None, True),
    (3, "fp16", None, True),
    (2, "fp32", {"optimizer": Placement("cpu")}, True),     # a step away from the parameters
    (3, "fp32", {"parameters": Placement("cpu")}, True),
])
def test_master_per_unit(stage, precision, placement, master):
    g = graph(stage, precision, placement)
    assert [u.master for u in g.units] == [master] * len(g.units)


@pytest.mark.parametrize("optimizer, momentum", [("adamw", 0.0), ("sgd", 0.9), ("sgd", 0.0)])
@pytest.mark.parametrize("precision, placement", [("fp32", None), ("bf16", None),
                                                  ("fp32", {"optimizer": Placement("cpu")})])
def test_optimizer_buffers_are_sized_by_the_units_master(optimizer, momentum, precision, placement):
    g = graph(2, precision, placement, optimizer, momentum)
    for b in g.buffers.values():
        if b.kind == "optim":
            u = g.units[b.unit]
            assert b.bytes == u.shard_numel * optimizer_bytes_per_param(optimizer, momentum, u.master)


def test_master_survives_serialisation():
    g = graph(1, "bf16")
    assert [u.master for u in TaskGraph.from_json(g.to_json()).units] == [True] * len(g.units)
