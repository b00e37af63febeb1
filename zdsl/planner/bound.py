"""The worst working-memory peak over every execution order the graph allows.

Why: the simulated peak (:mod:`zdsl.planner.memory`) comes from one timeline,
but the runtime runs lanes concurrently with real timings, so a lane can run
further ahead than the simulation says and hold more at once. A figure the
measured peak must stay within has to cover every order.

Model: an execution state is the set D of ops that have started. D is closed
downward: an op in D has its deps in D (they completed) and the previous op of
its lane in D (a lane runs in graph order). A working buffer instance is live
while its allocating op is in D and the ``mem.free`` that ends it is not, so

    live bytes(D) = sum of weight(op) over D,

with weight = + bytes an op allocates on a tier, - bytes a ``mem.free`` releases.
The largest such sum over closed sets is a maximum-weight closure, solved
exactly by one minimum s-t cut (Picard 1976): source -> v with capacity w(v)
for w > 0, v -> sink with -w(v) for w < 0, an infinite edge v -> u for every
u that v requires; the answer is the sum of positive weights minus the cut.

Before the flow, per tier, two exact reductions shrink the network: ops that
are no ancestor of an allocation are never worth including, and ops with no
free among their ancestors (themselves included) are always worth including.
"""
from __future__ import annotations

from collections import deque

from zdsl.ir import TIERS, TaskGraph
from zdsl.planner.memory import working_intervals
from zdsl.planner.simulate import CyclicGraphError, predecessors, topological_order


def tier_weights(graph: TaskGraph) -> dict[str, list[int]]:
    """tier -> per op position: bytes of working buffers it allocates minus bytes it frees."""
    n = len(graph.ops)
    out: dict[str, list[int]] = {}
    for iv in working_intervals(graph):
        if iv.bytes <= 0:
            continue   # the zero-byte ordering token (and anything else that holds nothing)
        w = out.get(iv.tier)
        if w is None:
            w = out[iv.tier] = [0] * n
        w[iv.alloc] += iv.bytes
        if iv.free is not None:
            w[iv.free] -= iv.bytes
    return out


def requirements(graph: TaskGraph) -> tuple[list[list[int]], list[int]]:
    """Per op position, the ops it requires (deps and its lane's previous op), and a topological order."""
    deps, lane_prev = predecessors(graph)
    order = topological_order(deps, lane_prev)
    if isinstance(order, int):
        raise CyclicGraphError(order)
    req = [list(ds) + [p] if p >= 0 else list(ds) for ds, p in zip(deps, lane_prev)]
    return req, order


def max_closure(weights: list[int], req: list[list[int]], order: list[int] | None = None) -> int:
    """Largest sum of ``weights`` over a set closed under ``req`` (op -> ops it requires); >= 0.

    ``order`` is a topological order of ``req`` (prerequisites first), graph order if omitted.
    """
    n = len(weights)
    order = list(range(n)) if order is None else order
    positive = sum(w for w in weights if w > 0)
    if positive == 0:
        return 0
    # ancestors (or self) of an allocation: the only ops an optimal closure needs
    useful = [False] * n
    for v in reversed(order):
        if weights[v] > 0:
            useful[v] = True
        if useful[v]:
            for u in req[v]:
                useful[u] = True
    # ops with a free among their ancestors (or self): the only ops whose inclusion costs anything
    costly = [False] * n
    for v in order:
        if weights[v] < 0:
            costly[v] = True
        else:
            for u in req[v]:
                if costly[u]:
                    costly[v] = True
                    break
    # always included: free of cost (a downward-closed set of non-negative weights)
    free_gain = sum(weights[v] for v in range(n) if weights[v] > 0 and not costly[v])
    keep = [v for v in range(n) if useful[v] and costly[v]]
    if not any(weights[v] > 0 for v in keep):
        return free_gain
    index = {v: i for i, v in enumerate(keep)}
    m = len(keep)
    source, sink = m, m + 1
    net = _Network(m + 2)
    inf = positive + 1   # no cut is larger than `positive`: this capacity never saturates
    gain = 0
    for i, v in enumerate(keep):
        w = weights[v]
        if w > 0:
            net.add(source, i, w)
            gain += w
        elif w < 0:
            net.add(i, sink, -w)
        for u in set(req[v]):
            j = index.get(u)
            if j is not None:   # a requirement outside `keep` is always included: no constraint
                net.add(i, j, inf)
    return free_gain + gain - net.max_flow(source, sink)


class _Network:
    """A flow network in flat lists (Dinic: BFS levels, then blocking flows by iterative DFS)."""

    def __init__(self, n: int):
        self.n = n
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[int] = []

    def add(self, u: int, v: int, cap: int) -> None:
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(cap)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0)

    def max_flow(self, s: int, t: int) -> int:
        adj, to, cap, n = self.adj, self.to, self.cap, self.n
        total = 0
        while True:
            level = [-1] * n
            level[s] = 0
            queue = deque([s])
            while queue:
                u = queue.popleft()
                lu = level[u] + 1
                for e in adj[u]:
                    v = to[e]
                    if cap[e] > 0 and level[v] < 0:
                        level[v] = lu
                        queue.append(v)
            if level[t] < 0:
                return total
            total += self._blocking_flow(s, t, level)

    def _blocking_flow(self, s: int, t: int, level: list[int]) -> int:
        adj, to, cap = self.adj, self.to, self.cap
        arc = [0] * self.n          # current arc per node
        pushed = 0
        path: list[int] = []        # edges from s to the current node
        u = s
        while True:
            if u == t:
                f = min(cap[e] for e in path)
                for e in path:
                    cap[e] -= f
                    cap[e ^ 1] += f
                pushed += f
                # back up to the tail of the first saturated edge
                k = next(k for k, e in enumerate(path) if cap[e] == 0)
                del path[k:]
                u = to[path[-1]] if path else s
                continue
            edges = adj[u]
            i = arc[u]
            lu = level[u] + 1
            while i < len(edges):
                e = edges[i]
                if cap[e] > 0 and level[to[e]] == lu:
                    break
                i += 1
            arc[u] = i
            if i < len(edges):
                path.append(edges[i])
                u = to[edges[i]]
                continue
            if u == s:
                return pushed
            level[u] = -1           # dead end: never visit again this phase
            e = path.pop()
            u = to[e ^ 1]
            arc[u] += 1


def worst_working(graph: TaskGraph, simulated: dict[str, int] | None = None) -> dict[str, int]:
    """tier -> the largest working bytes live at once over every order the graph allows.

    ``simulated`` (tier -> simulated working peak), when given, skips the flow on a tier whose
    simulated peak already holds every working byte of that tier (the bound can be no larger).
    """
    weights = tier_weights(graph)
    out = dict.fromkeys(TIERS, 0)
    if not weights:
        return out
    req, order = requirements(graph)
    for tier, w in weights.items():
        positive = sum(x for x in w if x > 0)
        if simulated is not None and simulated.get(tier, 0) >= positive:
            out[tier] = positive
            continue
        out[tier] = max_closure(w, req, order)
    return out
