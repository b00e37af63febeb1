"""How a lane runs its ops: one at a time, or the collectives lane ``comm_slots`` at once.

A lane runs its ops in graph order. Most run one op at a time; the collectives lane
runs as many at once as the backend has threads (gloo takes them off a queue with two;
NCCL's one stream runs them one at a time), started in issue order. The simulator
schedules with this model; the overlap analysis of a measured step
(:mod:`zdsl.observe.overlap`) and the calibration fits replay measured times through
it, so a measured op's own time is comparable to the simulated one.
"""
from __future__ import annotations

from zdsl.ir import TaskGraph, crosses_nodes, group_size
from zdsl.machine_profile import CollectiveRates, MachineProfile


def lane_slots(graph: TaskGraph, machine: MachineProfile) -> dict[str, int]:
    """Ops a lane runs at once, where more than one: the collectives lane runs
    :func:`slots_of` (gloo works off a queue with two threads, so a collective issued behind
    another starts when either is free; NCCL's one stream runs them one at a time)."""
    n = slots_of(graph, machine)
    return {"comm": n} if n > 1 else {}


def shared_memory_group(graph: TaskGraph, group: str, on_host: bool) -> bool:
    """Whether the runtime runs a collective over ``group`` through shared memory
    (runtime/dist/shm.py serves any 2-rank group whose ranks share a host): tensors on the host
    (``on_host``: a cpu machine's), 2 ranks in the group, and both on one node, at any size. A pair
    across nodes is on two hosts and goes over the network (``zdsl run``'s simulated nodes run it
    through shared memory and then delay it, as the cluster link prices it)."""
    return (on_host and group_size(group, graph.ranks) == 2
            and not crosses_nodes(group, graph.ranks, graph.per_node))


def slots_of(graph: TaskGraph, machine: MachineProfile) -> int:
    """Collectives ``graph``'s ranks run at once on ``machine``: its ``comm_slots``, except where
    every collective goes through shared memory (:func:`shared_memory_group`): one at a time on
    the pair's worker thread."""
    on_host = machine.name == "cpu"
    groups = {op.group for op in graph.collectives()}
    if groups and all(shared_memory_group(graph, group, on_host) for group in groups):
        return 1
    return max(1, int(machine.collectives.slots))


def comm_slots(graph: TaskGraph) -> int:
    """:func:`slots_of` the graph's machine (where the graph carries no machine, the default
    profile, as the planner reads it)."""
    try:
        return slots_of(graph, MachineProfile.of_config(graph.config))
    except (TypeError, ValueError):      # a graph file written by hand
        return CollectiveRates.slots


class BackendThreads:
    """A backend that runs ``slots`` of a lane's collectives at once, in issue order (gloo's
    worker threads), replayed from measured times: an op issued while ``slots`` issued before it
    are still running starts when the first of them ends (the ``slots``-th latest end)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.ends: list[tuple[float, int | None]] = []   # the latest ``slots`` ends, earliest first

    def take(self, issued: float, ended: float, op: int | None = None) -> tuple[float, int | None]:
        """When the op issued at ``issued`` (ended at ``ended``) had a thread, and the op whose end
        freed it (None where one was free at issue)."""
        start, freed_by = issued, None
        if len(self.ends) >= self.slots and self.ends[0][0] > issued:
            start, freed_by = self.ends[0]
        self.ends.append((ended, op))
        self.ends.sort(key=lambda end: end[0])
        del self.ends[:-self.slots]
        return start, freed_by


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by intervals (ops of one lane may touch or, measured, overlap)."""
    total = 0.0
    ordered = sorted(intervals)
    if not ordered:
        return total
    cur_s, cur_e = ordered[0]
    for s, e in ordered[1:]:
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    return total + (cur_e - cur_s)
