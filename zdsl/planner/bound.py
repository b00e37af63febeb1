"""The worst working-memory peak over every execution order the graph allows.

Why: the simulated peak (:mod:`zdsl.sim.memory`) comes from one timeline,
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

from zdsl.ir import TIERS, TaskGraph
from zdsl.sim.graph_index import CyclicGraphError, index_graph
from zdsl.sim.memory import working_intervals


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
    index = index_graph(graph)
    if isinstance(index.order, int):
        raise CyclicGraphError(index.order)
    req = [list(ds) + [p] if p >= 0 else list(ds) for ds, p in zip(index.deps, index.lane_prev)]
    return req, index.order


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
    excess = [max(weights[v], 0) for v in keep]
    drain = [max(-weights[v], 0) for v in keep]
    net = _Residual(len(keep))
    for i, v in enumerate(keep):
        for u in set(req[v]):
            j = index.get(u)
            if j is not None:   # a requirement outside `keep` is always included: no constraint
                net.add(i, j)
    return free_gain + sum(excess) - net.max_flow(excess, drain)


class _Residual:
    """The closure's flow network without its source and sink, in flat lists.

    Source edges are each allocation's ``excess``, sink edges each free's
    ``drain``; between ops only infinite edges (op -> what it requires) and
    their reverses (capacity = the flow they carry). Max flow by augmenting
    paths: from each allocation in turn, breadth first to the nearest free
    with drain left. A search that finds none leaves a set of ops closed
    under residual edges; no later augmenting path can enter it (it could
    not leave to the sink), so those ops are marked dead and never searched
    again. Nearest-first keeps searches short: an allocation usually cancels
    the free its buffer's previous instance ended with, one edge away.
    """

    INF = -1   # capacity marker of an infinite edge

    def __init__(self, n: int):
        self.n = n
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[int] = []   # INF forward edges; reverse edges hold the flow on their twin

    def add(self, u: int, v: int) -> None:
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(self.INF)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0)

    def max_flow(self, excess: list[int], drain: list[int]) -> int:
        adj, to, cap, n = self.adj, self.to, self.cap, self.n
        dead = [False] * n
        seen = [0] * n              # search stamp per op
        via = [-1] * n              # edge a search reached the op by
        stamp = 0
        total = 0
        for a in range(n):
            while excess[a] > 0 and not dead[a]:
                stamp += 1
                seen[a] = stamp     # an op's weight is net: one with excess has no drain
                queue = [a]
                found = -1
                head = 0
                while head < len(queue) and found < 0:
                    u = queue[head]
                    head += 1
                    for e in adj[u]:
                        v = to[e]
                        if seen[v] == stamp or dead[v] or cap[e] == 0:
                            continue
                        seen[v] = stamp
                        via[v] = e
                        if drain[v] > 0:
                            found = v
                            break
                        queue.append(v)
                if found < 0:
                    for u in queue:
                        dead[u] = True
                    break
                f = min(excess[a], drain[found])
                v = found
                while v != a:
                    e = via[v]
                    if cap[e] != self.INF and cap[e] < f:
                        f = cap[e]
                    v = to[e ^ 1]
                v = found
                while v != a:
                    e = via[v]
                    if cap[e] != self.INF:
                        cap[e] -= f
                    if cap[e ^ 1] != self.INF:
                        cap[e ^ 1] += f
                    v = to[e ^ 1]
                excess[a] -= f
                drain[found] -= f
                total += f
        return total


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
