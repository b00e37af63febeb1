"""Communication volume per step per rank.

ZeRO's accounting: data parallelism (stage 0) all-reduces the gradients, 2Ψ
elements per rank with a ring (reduce-scatter + all-gather); stages 1 and 2
reduce-scatter the gradients and all-gather the updated parameters, again 2Ψ;
stage 3 gathers parameters in forward and again in backward and
reduce-scatters gradients, 3Ψ. These are payload elements (the size of the
full tensor each collective produces); a ring moves (N-1)/N of each over the
wire, which we report separately as the bus factor, as nccl-tests does. A
collective over a group of n ranks (a node, a group(K), the replicas of a
shard: ``Op.group``) moves (n-1)/n of its own payload.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zdsl.ir import ALL, COLLECTIVE_KINDS, TaskGraph, group_size
from zdsl.sim.simulate import collective_payload


@dataclass
class CommPlan:
    ranks: int
    payload_bytes: int                  # sum of collective payloads (all-reduce counted twice)
    by_kind: dict[str, int] = field(default_factory=dict)
    collectives: int = 0                # collective calls per step
    # kind -> bytes on the wire where some collective runs over fewer ranks than all (each its
    # group's (n-1)/n); None: every one over all ranks, the bus factor's
    wire_by_kind: dict[str, float] | None = None

    @property
    def bus_factor(self) -> float:
        """Share of the payload a rank sends (and receives) in a ring collective (over groups:
        the wire's share of the payload)."""
        if self.wire_by_kind is not None:
            return self.wire_bytes / self.payload_bytes if self.payload_bytes else 0.0
        return (self.ranks - 1) / self.ranks if self.ranks > 0 else 0.0

    @property
    def wire_bytes(self) -> float:
        if self.wire_by_kind is not None:
            return sum(self.wire_by_kind.values())
        return self.payload_bytes * self.bus_factor

    def wire(self, kind: str) -> float:
        """Bytes on the wire of one kind of collective."""
        if self.wire_by_kind is not None:
            return self.wire_by_kind[kind]
        return self.by_kind[kind] * self.bus_factor

    def to_json(self) -> dict:
        return {"payload_bytes": self.payload_bytes, "bus_factor": self.bus_factor,
                "wire_bytes": self.wire_bytes, "by_kind": dict(self.by_kind),
                "collectives": self.collectives}


def comm_plan(graph: TaskGraph) -> CommPlan:
    """What the graph's collectives move per step per rank."""
    by_kind = dict.fromkeys(COLLECTIVE_KINDS, 0)
    wire = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    count, grouped = 0, False
    for op in graph.ops:
        if op.is_collective:
            times = 2 if op.kind == "comm.all_reduce" else 1
            payload = times * collective_payload(graph, op)
            by_kind[op.kind] += payload
            n = group_size(op.group, graph.ranks)
            wire[op.kind] += payload * (n - 1) / n
            grouped = grouped or op.group != ALL
            count += 1
    return CommPlan(ranks=graph.ranks, payload_bytes=sum(by_kind.values()), by_kind=by_kind,
                    collectives=count, wire_by_kind=wire if grouped else None)


def zero_comm_elements(parameters: int, stage: int) -> int:
    """ZeRO paper: elements communicated per step per rank (payload): 2Ψ at stages 0-2, 3Ψ at 3."""
    return (3 if stage == 3 else 2) * parameters
