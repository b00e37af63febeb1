"""The task graph contract: names, JSON round trip, digest, queries."""
from __future__ import annotations

import pytest

from zdsl.driver import compile_schedule
from zdsl.ir import (COLLECTIVE_KINDS, LANES, OP_LANES, TIERS, Buffer, Op, TaskGraph, buffer_name,
                     parse_buffer_name)
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Placement
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec
from zdsl.model.units import gpt_units

UNITS = gpt_units(layers=2, width=32, heads=4, vocab=64, context=8)


def compiled(**kw) -> TaskGraph:
    s = Schedule(name="ir", ranks=2, train=TrainSpec(batch=2, precision=kw.pop("precision", "fp32")),
                 optimizer=OptimizerSpec(clip=1.0), **kw)
    return compile_schedule(s, UNITS)


@pytest.mark.parametrize("name,parts", [
    ("param_full[3]", ("param_full", 3, None)), ("grad_shard[0]@host", ("grad_shard", 0, "host")),
    ("optim[12]@nvme", ("optim", 12, "nvme")), ("norm", ("norm", None, None)), ("loss@host", ("loss", None, "host")),
])
def test_buffer_names_round_trip(name, parts):
    assert parse_buffer_name(name) == parts
    assert buffer_name(*parts) == name


@pytest.mark.parametrize("kw", [dict(stage=0), dict(stage=2, precision="bf16"),
                                dict(stage=3, prefetch=2, bucket_bytes=4096,
                                     placement={"optimizer": Placement("cpu")})])
def test_json_round_trip_and_digest(kw):
    g = compiled(**kw)
    text = g.to_json()
    back = TaskGraph.from_json(text)
    assert back == g
    assert back.to_json() == text and back.digest() == g.digest()
    assert all(isinstance(op.span, tuple) or op.span is None for op in back.ops)


def test_digest_changes_with_the_graph():
    assert compiled(stage=3).digest() != compiled(stage=3, prefetch=2).digest()
    assert compiled(stage=3).digest() == compiled(stage=3).digest()


def test_compiled_graph_is_well_formed():
    g = compiled(stage=3, prefetch=2, placement={"optimizer": Placement("cpu")})
    assert [op.id for op in g.ops] == list(range(len(g.ops)))
    for op in g.ops:
        assert op.kind in OP_LANES and op.lane in LANES
        assert all(d < op.id for d in op.deps)              # deps point back in issue order
        for name in op.reads + op.writes:
            assert name in g.buffers
    for buf in g.buffers.values():
        assert buf.tier in TIERS and buf.bytes >= 0
    assert g.collectives() == [op for op in g.ops if op.kind in COLLECTIVE_KINDS]
    assert g.lane_ops("host") and all(op.lane == "host" for op in g.lane_ops("host"))


def test_buffer_state_is_only_for_model_states():
    assert Buffer("param_full[0]", "param_full", 0, "device", 8, persistent=True).state == "parameters"
    assert Buffer("param_full[0]", "param_full", 0, "device", 8, persistent=False).state is None
    assert Buffer("optim[0]", "optim", 0, "host", 8, persistent=True).state == "optimizer"
    assert Op(0, "comm.all_gather", "comm", 0).is_collective
    assert not Op(0, "copy.h2d", "h2d", 0).is_collective
