"""Hierarchical sharding in the task graph (issue 57): every collective carries its group; HSDP's
and MiCS's shards live in their group, their gradients are reduce-scattered within it and then
all-reduced across its replicas; hpZ keeps a node-local secondary shard after the first gather and
gathers from it within the node; the verifier holds one collective order per group; a flat
schedule's graph is the one it was."""
from __future__ import annotations

import dataclasses

import pytest

from zdsl.check.checker import check_text
from zdsl.compile.eval_graph import instantiate_eval
from zdsl.compile.instantiate import instantiate
from zdsl.compile.lower import lower_policies
from zdsl.compile.verify import verify
from zdsl.ir import Op
from zdsl.ir import TaskGraph
from zdsl.ir import crosses_nodes
from zdsl.ir import group_members
from zdsl.ir import group_ranks
from zdsl.model.units import gpt_units

MODEL = dict(layers=2, width=32, heads=4, vocab=64, context=8)
HEAD = f"model gpt({', '.join(f'{k}={v}' for k, v in MODEL.items())})\ntrain steps=2, batch=2"
STATES3 = "optimizer, gradients, parameters"
HSDP = f"ranks 4 on cpu, 2 per node\nshard {STATES3} over node"
HPZ = "ranks 4 on cpu, 2 per node\nzero 3\nsecondary parameters over node"
MICS = f"ranks 8 on cpu, 4 per node\nshard {STATES3} over group(2)"


def compile_text(text: str, overrides=None) -> tuple:
    schedule, _ = check_text(f"{HEAD}\n{text}", "g.zs", overrides)
    units = gpt_units(**MODEL)
    graph = instantiate(schedule, units, lower_policies(schedule, units))
    assert [d.message for d in verify(graph, schedule) if d.severity == "error"] == []
    return schedule, graph


def collectives(graph: TaskGraph, kind: str, **fields) -> list[Op]:
    return [op for op in graph.ops if op.kind == kind and all(getattr(op, k) == v for k, v in fields.items())]


def test_groups_name_their_ranks():
    assert group_ranks("within:2", 3, 8) == [2, 3]
    assert group_ranks("across:2", 3, 8) == [1, 3, 5, 7]
    assert group_members("across:4", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_members("within:4", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [crosses_nodes(g, 8, 4) for g in ("all", "within:4", "within:2", "across:4", "across:2")] == \
        [True, False, False, True, True]
    assert not crosses_nodes("all", 8, 0) and not crosses_nodes("all", 8, 8)
    assert crosses_nodes("within:3", 12, 4)     # [3, 6) straddles ranks 3 and 4


@pytest.mark.parametrize("accumulate", [1, 2])
def test_hsdp_shards_within_the_node_and_all_reduces_across(accumulate):
    _, graph = compile_text(HSDP, {"accumulate": str(accumulate)})
    assert graph.per_node == 2
    for unit in graph.units:
        assert unit.shard_numel * 2 == unit.padded_numel            # a shard of the node, not of the 4 ranks
    for kind in ("comm.all_gather", "comm.reduce_scatter"):
        assert {op.group for op in collectives(graph, kind)} == {"within:2"}
    reduced = collectives(graph, "comm.all_reduce", phase="backward")
    assert {op.group for op in reduced} == {"across:2"}
    # once per step per unit and part, after the last micro-batch's reduce-scatter into the shard
    assert sorted((op.unit, op.micro) for op in reduced) == [(u, accumulate - 1) for u in range(len(graph.units))]
    for op in reduced:
        scatter = next(o for o in graph.ops if o.kind == "comm.reduce_scatter" and o.unit == op.unit
                       and o.micro == op.micro)
        assert scatter.id in op.deps and op.reads == op.writes == scatter.writes
        assert op.bytes * 2 == scatter.bytes                         # the shard's part, not the full part


def test_gradients_accumulating_on_the_host_are_all_reduced_before_each_copy():
    _, graph = compile_text(f"ranks 4 on cpu, 2 per node\nshard optimizer, gradients over node\n"
                            f"offload optimizer -> cpu\noptimizer adamw(clip=1.0)", {"accumulate": "2"})
    for copy in collectives(graph, "copy.d2h"):
        reduced = [graph.ops[d] for d in copy.deps if graph.ops[d].kind == "comm.all_reduce"]
        assert [op.group for op in reduced] == ["across:2"], copy
    norm = collectives(graph, "comm.all_reduce", unit=None)
    assert [op.group for op in norm] == ["within:2"]              # each replica holds the same shards


def test_hpz_gathers_the_backward_from_the_node_local_shard():
    _, graph = compile_text(HPZ, {"accumulate": "2"})
    for unit in graph.units:
        assert unit.shard_numel * 4 == unit.padded_numel             # the primary shard spans every rank
        assert graph.buffers[f"param_sec[{unit.index}]"].bytes == unit.padded_numel // 2 * 4
    gathers = collectives(graph, "comm.all_gather")
    primary = [op for op in gathers if op.group == "all"]
    # the first forward's gathers come from the primary shard and keep the secondary one; every later
    # gather before the step (the backward's, the second micro-batch's forward) reads that, in the node
    assert primary and all(op.phase == "forward" and op.micro == 0 for op in primary)
    assert all(op.writes == [op.writes[0], f"param_sec[{op.unit}]"] for op in primary)
    secondary = [op for op in gathers if op.group == "within:2"]
    assert {(op.phase, op.micro) for op in secondary} == {("backward", 0), ("forward", 1), ("backward", 1),
                                                          ("forward", 0)}
    tied = {j for unit in graph.units for j in unit.uses}     # the head's gather of the embedding it ties to
    assert {op.unit for op in secondary if (op.phase, op.micro) == ("forward", 0)} == tied == {0}
    assert all(op.reads == [f"param_sec[{op.unit}]"] for op in secondary)
    assert {op.group for op in collectives(graph, "comm.reduce_scatter")} == {"all"}
    assert collectives(graph, "comm.all_reduce", phase="backward") == []
    assert all(not name.startswith("param_sec") for name in graph.buffers if graph.buffers[name].persistent)


def test_hpz_evaluation_keeps_no_secondary_shard():
    schedule, _ = compile_text(HPZ)
    units = gpt_units(**MODEL)
    evaluation = instantiate_eval(schedule, units, lower_policies(schedule, units))
    assert not any(name.startswith("param_sec") for name in evaluation.buffers)


def test_mics_groups_of_two_at_eight_ranks():
    _, graph = compile_text(MICS)
    assert {op.group for op in collectives(graph, "comm.all_gather")} == {"within:2"}
    assert {op.group for op in collectives(graph, "comm.all_reduce", phase="backward")} == {"across:2"}
    assert all(u.shard_numel * 2 == u.padded_numel for u in graph.units)


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_one_and_two_gather_the_updated_shard_within_the_group(stage):
    _, graph = compile_text(f"ranks 4 on cpu, 2 per node\nshard {', '.join(STATES3.split(', ')[:stage])} over node")
    gathers = collectives(graph, "comm.all_gather")
    assert gathers and {(op.phase, op.group) for op in gathers} == {("step", "within:2")}


def test_flat_schedules_keep_their_graph():
    """One node, or groups of every rank, is the flat graph: the same ops and units, every group "all"."""
    _, flat = compile_text("ranks 4 on cpu\nzero 3")
    for same in ("ranks 4 on cpu, 4 per node\nzero 3", f"ranks 4 on cpu\nshard {STATES3} over group(4)",
                 f"ranks 4 on cpu, 2 per node\nshard {STATES3} over all"):
        schedule, graph = compile_text(same)
        assert [dataclasses.replace(op) for op in graph.ops] == flat.ops, same
        assert graph.units == flat.units
    assert {op.group for op in flat.ops} == {"all"} and flat.per_node == 0


def test_json_round_trip_keeps_groups():
    _, graph = compile_text(HPZ)
    again = TaskGraph.from_json(graph.to_json())
    assert again.per_node == 2 and [op.group for op in again.ops] == [op.group for op in graph.ops]
    assert again.digest() == graph.digest()


def test_cluster_scale_compiles_rank_free():
    """1024 ranks as 128 nodes of 8 compile to the same number of ops as 4 ranks."""
    _, small = compile_text(HSDP)
    _, big = compile_text(HSDP, {"ranks": "1024", "per_node": "8"})
    assert len(big.ops) == len(small.ops) and big.per_node == 8
    assert {op.group for op in big.ops if op.is_collective} == {"within:8", "across:8"}


def test_verifier_orders_collectives_per_group():
    """A collective issued apart from the comm lane, after its group's previous one and before its
    group's next, may run before a collective of another group (another process group), not before
    one of its own."""
    schedule, graph = compile_text(HSDP)
    coll = [op for op in graph.ops if op.is_collective]
    i = next(i for i in range(len(coll) - 1) if coll[i].group == "across:2" and coll[i + 1].group == "within:2")
    a, b = coll[i], coll[i + 1]
    before = [op for op in coll[:i] if op.group == b.group][-1]
    after = next(op for op in coll[i + 2:] if op.group == b.group)

    def issued_apart(group: str) -> list[str]:
        ops = list(graph.ops)
        ops[b.id] = dataclasses.replace(b, lane="h2d", deps=sorted({*b.deps, before.id}), group=group)
        ops[after.id] = dataclasses.replace(after, deps=sorted({*after.deps, b.id}))
        found = verify(dataclasses.replace(graph, ops=ops), schedule)
        return [d.message for d in found if "may be issued before" in d.message]

    assert issued_apart("within:2") == []
    found = issued_apart(a.group)
    assert found and f"op {a.id}" in found[0] and "of group across:2" in found[0]


def test_verifier_refuses_a_group_that_does_not_tile_the_ranks():
    schedule, graph = compile_text(HSDP)
    ops = [dataclasses.replace(op, group="within:3") if op.is_collective else op for op in graph.ops]
    messages = [d.message for d in verify(dataclasses.replace(graph, ops=ops), schedule)]
    assert any("within:3, which does not divide the 4 ranks" in m for m in messages)
