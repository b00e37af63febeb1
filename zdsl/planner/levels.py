"""The plan by level: what each rank sends within its node and across nodes, and what a
hierarchical form (issue 57: HSDP, MiCS, hpZ) costs in memory per rank.

The bytes are a ring's: a collective over a group of n ranks sends (n-1)/n of its payload from
each rank, an all-reduce twice that (a reduce-scatter, then an all-gather); they count across
nodes where the collective's group spans nodes (``zdsl.ir.crosses_nodes``), else within the node
(on one node, everything). Torch-free.
"""
from __future__ import annotations

from fractions import Fraction

from zdsl.ir import TaskGraph, crosses_nodes, group_size
from zdsl.lang.sizes import human_bytes
from zdsl.sim.simulate import collective_payload

LEVELS = ("within_node", "across_nodes")


def bytes_by_level(graph: TaskGraph) -> dict[str, int]:
    """``{"within_node": B, "across_nodes": B}``: bytes each rank sends per step (rounded once,
    after summing exactly)."""
    sent = dict.fromkeys(LEVELS, Fraction(0))
    for op in graph.ops:
        if op.is_collective:
            n = group_size(op.group, graph.ranks)
            level = "across_nodes" if crosses_nodes(op.group, graph.ranks, graph.per_node) else "within_node"
            rings = 2 if op.kind == "comm.all_reduce" else 1
            sent[level] += rings * Fraction(collective_payload(graph, op) * (n - 1), n)
    return {level: round(b) for level, b in sent.items()}


def nodes(graph: TaskGraph) -> int:
    """How many nodes the graph's ranks are on."""
    return graph.ranks // graph.per_node if 0 < graph.per_node < graph.ranks else 1


def hierarchy_json(graph: TaskGraph, schedule) -> dict | None:
    """The sharding's shape where the ranks are on several nodes: the shard group and its
    replicas, and hpZ's secondary shards (their bytes per rank, all units' together)."""
    if nodes(graph) == 1:
        return None
    shard = schedule.shard_group()
    size = group_size(shard, graph.ranks)
    out = {"nodes": nodes(graph), "per_node": graph.per_node, "shard_group": shard, "shard_ranks": size,
           "replicas": graph.ranks // size}
    if schedule.secondary_group() is not None:
        out["secondary_group"] = schedule.secondary_group()
        out["secondary_bytes"] = sum(b.bytes for b in graph.buffers.values() if b.kind == "param_sec")
    return out


def hierarchy_lines(graph: TaskGraph, schedule, model_state_bytes: float) -> list[str]:
    """What the plan says of the form beside the memory table: a shard replicated across nodes
    is larger than one over every rank, and hpZ keeps a second shard of the parameters."""
    shape = hierarchy_json(graph, schedule)
    if shape is None:
        return []
    n, size, replicas = graph.ranks, shape["shard_ranks"], shape["replicas"]
    out = [f"{n} ranks on {shape['nodes']} nodes of {graph.per_node}"]
    if graph.stage and replicas > 1:
        out += [f"  sharded within groups of {size} ranks ({shape['shard_group']}), replicated {replicas}x: "
                f"a rank holds 1/{size} of each sharded state,",
                f"  {replicas}x what sharding over all {n} would: {human_bytes(model_state_bytes)} of model "
                f"states per rank against {human_bytes(model_state_bytes / replicas)}"]
    if "secondary_group" in shape:
        out += [f"  secondary parameters within the node ({shape['secondary_group']}): each unit's node-local "
                f"slice, kept from its forward to its backward,",
                f"  {human_bytes(shape['secondary_bytes'])} per rank for all units (working memory), which the "
                f"backward gathers from instead of across nodes"]
    return out


def level_lines(graph: TaskGraph, machine) -> list[str]:
    """Bytes sent per level and the link each level is priced at."""
    if nodes(graph) == 1:
        return []
    sent = bytes_by_level(graph)
    node, cluster = machine.collectives.node, machine.collectives.level(True)
    out = [f"sent per step per rank: {human_bytes(sent['within_node'])} within its node, "
           f"{human_bytes(sent['across_nodes'])} across nodes",
           f"  priced at link node=({node.bandwidth:.3g} B/s, {node.latency:.3g} s) within a node, "
           f"cluster=({cluster.bandwidth:.3g} B/s, {cluster.latency:.3g} s) across"]
    if cluster is node:
        out.append("  the profile gives no rate across nodes (link cluster=(RATE, LATENCY)): collectives across "
                   "nodes are priced at the link within one, which a cluster's network seldom matches")
    return out
