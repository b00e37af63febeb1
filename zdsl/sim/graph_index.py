"""The order a task graph's ops must run in: each op's predecessors and one topological order.

An op waits for its ``deps`` and for the previous op of its lane (a lane runs in
graph order). The verifier, the simulator, the worst-order memory bound and the
overlap analysis of a measured step all walk the graph in an order that respects
both; it is computed here, once per graph where they share it (:class:`GraphIndex`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from zdsl.ir import TaskGraph


class CyclicGraphError(ValueError):
    """The graph has a cycle (the verifier names it; the simulator cannot order it)."""

    def __init__(self, op_index: int):
        super().__init__(f"op {op_index} is on a dependency cycle")
        self.op_index = op_index


def predecessors(graph: TaskGraph) -> tuple[list[list[int]], list[int]]:
    """Per op position: its deps as positions, and the previous op on its lane (-1 if first)."""
    ops = graph.ops
    n = len(ops)
    last_on_lane: dict[str, int] = {}
    lane_prev = [0] * n
    deps = [op.deps for op in ops]
    positional = True                   # ids are positions and deps point inside (the compiler's case)
    for i, op in enumerate(ops):
        lane = op.lane
        lane_prev[i] = last_on_lane.get(lane, -1)
        last_on_lane[lane] = i
        ds = op.deps
        if positional and (op.id != i or (ds and (min(ds) < 0 or max(ds) >= n))):
            positional = False
    if not positional:
        index = {op.id: i for i, op in enumerate(ops)}
        deps = [[index[d] for d in op.deps if d in index] for op in ops]
    return deps, lane_prev


@dataclass
class GraphIndex:
    """Predecessors and a topological order, computed once and shared by verifier and simulator."""
    deps: list[list[int]]
    lane_prev: list[int]
    order: list[int] | int              # an int: a position on a cycle


def index_graph(graph: TaskGraph) -> GraphIndex:
    deps, lane_prev = predecessors(graph)
    return GraphIndex(deps, lane_prev, topological_order(deps, lane_prev))


def topological_order(deps: Sequence[Sequence[int]], lane_prev: Sequence[int] | None = None) -> list[int] | int:
    """Positions in an order where every op comes after its ``deps`` and its ``lane_prev``
    (one more predecessor per op, earlier than it, -1 for none; omitted: none); on a cycle,
    the position of an op that lies on it (an int). Every longest path and every schedule
    computed over the order is the same whichever valid order this is."""
    n = len(deps)
    if lane_prev is None:
        lane_prev = [-1] * n
    if all(not ds or max(ds) < i for i, ds in enumerate(deps)):
        return list(range(n))              # the common case: graph order is already topological
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i in range(n):
        preds = list(deps[i]) + ([lane_prev[i]] if lane_prev[i] >= 0 else [])
        for p in preds:
            succ[p].append(i)
        indeg[i] = len(preds)
    ready = [i for i in range(n) if indeg[i] == 0]
    ready.reverse()
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for s in succ[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(order) == n:
        return order
    return cycle_member(deps, lane_prev, indeg)


def cycle_member(deps, lane_prev, indeg) -> int:
    """Walk predecessors among the ops left with indegree > 0 until one repeats: it is on a cycle."""
    stuck = {i for i, d in enumerate(indeg) if d > 0}
    i = min(stuck)
    seen = set()
    while i not in seen:
        seen.add(i)
        preds = [p for p in (*deps[i], lane_prev[i]) if p >= 0 and p in stuck]
        i = preds[0]
    return i
