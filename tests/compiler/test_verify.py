"""The verifier accepts every compiled schedule and rejects each kind of broken graph at its statement."""
from __future__ import annotations

import time

import pytest

from zdsl.driver import compile_schedule
from zdsl.ir import Buffer
from zdsl.ir import Op
from zdsl.ir import TaskGraph
from zdsl.ir import UnitInfo
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Placement
from zdsl.schedule import Schedule
from zdsl.schedule import Span
from zdsl.schedule import TrainSpec
from zdsl.model.units import gpt_units
from zdsl.compile.verify import verify

UNITS = gpt_units(layers=2, width=32, heads=4, vocab=64, context=8)
FILE = "bad.zs"


def schedule(**kw) -> Schedule:
    s = Schedule(name="t", file=FILE, ranks=kw.pop("ranks", 2), train=TrainSpec(batch=2, accumulate=kw.pop("accumulate", 1),
                 precision=kw.pop("precision", "fp32")), optimizer=OptimizerSpec(clip=kw.pop("clip", None)), **kw)
    return s


def errors(diags):
    return [d for d in diags if d.severity == "error"]


# -- compiled schedules pass -----------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("extra", [
    {}, {"accumulate": 2}, {"precision": "bf16", "clip": 1.0}, {"prefetch": 2},
    {"placement": {"optimizer": Placement("cpu")}},
    {"recompute": {1, 2}}, {"bucket_bytes": 4096}, {"overlap": set()},
])
def test_compiled_schedules_verify_clean(stage, extra):
    if extra.get("placement") and stage == 0:
        pytest.skip("offload needs sharded state")
    s = schedule(stage=stage, **extra)
    g = compile_schedule(s, UNITS)
    assert errors(verify(g, s)) == []


@pytest.mark.parametrize("placement", [
    {"parameters": Placement("nvme", paths=("/tmp/x",)), "optimizer": Placement("nvme", paths=("/tmp/x",))},
    {"parameters": Placement("cpu"), "optimizer": Placement("cpu")},
])
def test_offloaded_stage_3_verifies_clean(placement):
    s = schedule(stage=3, placement=placement, prefetch=2)
    assert errors(verify(compile_schedule(s, UNITS), s)) == []


def test_prefetch_past_the_tied_head_verifies_clean():
    # The head gathers the embedding's parameters (tied) in the prologue; unit 0's free must not drop them.
    s = schedule(stage=3, prefetch=3)
    assert errors(verify(compile_schedule(s, UNITS), s)) == []


# -- hand-built broken graphs --------------------------------------------------------------

def graph(ops: list[Op], buffers: list[Buffer]) -> TaskGraph:
    units = [UnitInfo(i, f"u{i}", 8, 8, 4) for i in range(2)]
    return TaskGraph("hand", 2, 3, "fp32", 1, units, {b.name: b for b in buffers}, ops)


def buffers(persistent=("param_shard[0]", "param_shard[1]")) -> list[Buffer]:
    out = []
    for u in (0, 1):
        out += [Buffer(f"param_shard[{u}]", "param_shard", u, "device", 16),
                Buffer(f"param_full[{u}]", "param_full", u, "device", 32),
                Buffer(f"act[{u}]", "act", u, "device", 8),
                Buffer(f"grad_full[{u}]", "grad_full", u, "device", 32),
                Buffer(f"grad_shard[{u}]", "grad_shard", u, "device", 16)]
    for b in out:
        b.persistent = b.name in persistent or b.kind == "grad_shard"
    return out


def gather(i, u, deps=(), line=3, lane="comm"):
    return Op(i, "comm.all_gather", lane, u, reads=[f"param_shard[{u}]"], writes=[f"param_full[{u}]"],
              bytes=32, deps=list(deps), span=(line, 5))


def forward(i, u, deps=(), line=4):
    reads = [f"param_full[{u}]"] + ([f"act[{u - 1}]"] if u else [])
    return Op(i, "compute.forward", "compute", u, reads=reads, writes=[f"act[{u}]"], flops=10,
              deps=list(deps), span=(line, 5))


def free(i, name, deps=(), line=6, lane="comm"):
    return Op(i, "mem.free", lane, None, writes=[name], deps=list(deps), span=(line, 5))


def at(diag, line):
    return diag.span == Span(FILE, line, 5)


def test_hand_graph_that_is_right_passes():
    ops = [gather(0, 0), gather(1, 1), forward(2, 0, [0]), forward(3, 1, [1, 2]),
           free(4, "param_full[0]", [2]), free(5, "param_full[1]", [3])]
    assert verify(graph(ops, buffers()), schedule()) == []


def test_cycle_is_rejected():
    ops = [gather(0, 0, deps=[1]), forward(1, 0, deps=[0])]
    errs = errors(verify(graph(ops, buffers()), schedule()))
    assert len(errs) == 1 and "cycle" in errs[0].message
    assert errs[0].span is not None and errs[0].span.file == FILE


def test_cycle_through_lane_order_is_rejected():
    # op 0 (compute) waits for op 2 (comm), which comes after op 1 on comm, which waits for op 0
    ops = [Op(0, "compute.forward", "compute", 0, reads=[], writes=["act[0]"], deps=[2], span=(7, 5)),
           Op(1, "comm.all_gather", "comm", 1, reads=["param_shard[1]", "act[0]"], writes=["param_full[1]"],
              deps=[0], span=(8, 5)),
           gather(2, 0)]
    errs = errors(verify(graph(ops, buffers()), schedule()))
    assert "cycle" in errs[0].message


def test_read_of_unproduced_buffer_is_rejected():
    ops = [forward(0, 0, line=9)]          # param_full[0] is working memory nothing gathered
    errs = errors(verify(graph(ops, buffers()), schedule()))
    assert len(errs) == 1 and "param_full[0]" in errs[0].message and "produce" in errs[0].message
    assert at(errs[0], 9)


def test_persistent_model_state_counts_as_produced():
    ops = [Op(0, "compute.forward", "compute", 0, reads=["param_full[0]"], writes=["act[0]"], span=(2, 5))]
    bufs = buffers(persistent=("param_full[0]",))
    assert errors(verify(graph(ops, bufs), schedule())) == []


def test_use_after_free_is_rejected_at_the_user():
    ops = [gather(0, 0), free(1, "param_full[0]", [0], line=5), forward(2, 0, [1], line=11)]
    errs = errors(verify(graph(ops, buffers()), schedule()))
    assert len(errs) == 1 and "after it was freed" in errs[0].message and at(errs[0], 11)
    assert "line 5" in errs[0].message and errs[0].hint


def test_regather_after_free_is_fine():
    ops = [gather(0, 0), forward(1, 0, [0]), free(2, "param_full[0]", [1]), gather(3, 0, [2]),
           forward(4, 0, [1, 3])]
    assert errors(verify(graph(ops, buffers()), schedule())) == []


def test_unordered_producer_and_consumer_is_a_race():
    ops = [gather(0, 0), forward(1, 0, deps=[], line=12)]     # forward does not wait for the gather
    errs = errors(verify(graph(ops, buffers()), schedule()))
    assert len(errs) == 1 and "nothing orders" in errs[0].message and at(errs[0], 12)


def test_free_racing_its_reader_is_rejected():
    ops = [gather(0, 0), forward(1, 0, [0]), free(2, "param_full[0]", deps=[0], line=13)]
    errs = errors(verify(graph(ops, buffers()), schedule()))
    assert len(errs) == 1 and "frees" in errs[0].message and at(errs[0], 13)


def test_collectives_on_two_lanes_without_order_are_rejected():
    ops = [gather(0, 0, line=3), gather(1, 1, line=14, lane="h2d")]
    errs = errors(verify(graph(ops, buffers()), schedule()))
    assert len(errs) == 1 and "collective" in errs[0].message and "different orders" in errs[0].message
    assert at(errs[0], 14)


def test_collectives_on_two_lanes_ordered_by_deps_pass():
    ops = [gather(0, 0), gather(1, 1, deps=[0], lane="h2d")]
    assert errors(verify(graph(ops, buffers()), schedule())) == []


def test_dangling_dep_and_unknown_buffer_are_rejected():
    ops = [gather(0, 0, deps=[42])]
    assert "not in the graph" in errors(verify(graph(ops, buffers()), schedule()))[0].message
    ops = [Op(0, "compute.forward", "compute", 0, reads=["param_full[7]"], writes=[], span=(2, 1))]
    assert "does not declare" in errors(verify(graph(ops, buffers()), schedule()))[0].message


# -- memory budgets -----------------------------------------------------------------------------

def test_device_budget_points_at_prefetch_when_gathered_parameters_dominate():
    units = gpt_units(layers=6, width=256, heads=4, vocab=64, context=8)
    prefetch_span = Span(FILE, 7, 1)
    s = schedule(stage=3, prefetch=4, spans={"prefetch": prefetch_span, "memory": Span(FILE, 9, 1)})
    g = compile_schedule(s, units)
    from zdsl.sim.simulate import simulate
    peak = simulate(g).memory.peak("device")
    s.memory = {"device": peak - 1}
    errs = errors(verify(g, s))
    assert len(errs) == 1
    msg = errs[0].message
    assert "device" in msg and "exceeds the budget" in msg and "line 9" in msg
    from zdsl.lang.sizes import human_bytes
    assert human_bytes(peak) in msg and human_bytes(peak - 1) in msg
    assert errs[0].span == prefetch_span and "prefetch" in errs[0].hint
    s.memory = {"device": peak}
    assert errors(verify(g, s)) == []


def test_host_budget_points_at_the_offload_statement():
    offload = Span(FILE, 5, 1)
    s = schedule(stage=2, placement={"optimizer": Placement("cpu")}, memory={"host": 1024},
                 spans={"offload.optimizer": offload})
    errs = errors(verify(compile_schedule(s, UNITS), s))
    assert len(errs) == 1 and "host" in errs[0].message and errs[0].span == offload


def test_budget_for_an_unused_tier_warns():
    s = schedule(stage=1, memory={"nvme": 1 << 40}, spans={"memory": Span(FILE, 4, 1)})
    diags = verify(compile_schedule(s, UNITS), s)
    assert errors(diags) == []
    assert [d.severity for d in diags] == ["warning"] and "never reached" in diags[0].message


def test_verifier_is_fast_on_1000_units():
    units = gpt_units(layers=998, width=32, heads=4, vocab=64, context=8)
    s = schedule(stage=3, prefetch=2, ranks=8)
    g = compile_schedule(s, units)
    t = time.perf_counter()
    assert errors(verify(g, s)) == []
    assert time.perf_counter() - t < 3.0     # a guard against quadratic checks, not a benchmark
