"""Communication volume per step per rank.

ZeRO's accounting: data parallelism (stage 0) all-reduces the gradients, 2Ψ
elements per rank with a ring (reduce-scatter + all-gather); stages 1 and 2
reduce-scatter the gradients and all-gather the updated parameters, again 2Ψ;
stage 3 gathers parameters in forward and again in backward and
reduce-scatters gradients, 3Ψ. These are payload elements (the size of the
full tensor each collective produces); a ring moves (N-1)/N of each over the
wire, which we report separately as the bus factor, as nccl-tests does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zdsl.ir import COLLECTIVE_KINDS

from zdsl.ir import TaskGraph
from zdsl.sim.simulate import collective_payload
from zdsl.ir import DTYPE_BYTES



@dataclass
class CommPlan:
    ranks: int
    payload_bytes: int                  # sum of collective payloads (all-reduce counted twice)
    by_kind: dict[str, int] = field(default_factory=dict)
    collectives: int = 0                # collective calls per step

    @property
    def bus_factor(self) -> float:
        """Share of the payload a rank sends (and receives) in a ring collective."""
        return (self.ranks - 1) / self.ranks if self.ranks > 0 else 0.0

    @property
    def wire_bytes(self) -> float:
        return self.payload_bytes * self.bus_factor

    def to_json(self) -> dict:
        return {"payload_bytes": self.payload_bytes, "bus_factor": self.bus_factor,
                "wire_bytes": self.wire_bytes, "by_kind": dict(self.by_kind),
                "collectives": self.collectives}


def comm_plan(graph: TaskGraph) -> CommPlan:
    """What the graph's collectives move per step per rank."""
    by_kind = dict.fromkeys(COLLECTIVE_KINDS, 0)
    count = 0
    for op in graph.ops:
        if op.is_collective:
            times = 2 if op.kind == "comm.all_reduce" else 1
            by_kind[op.kind] += times * collective_payload(graph, op)
            count += 1
    return CommPlan(ranks=graph.ranks, payload_bytes=sum(by_kind.values()), by_kind=by_kind,
                    collectives=count)


def zero_comm_elements(parameters: int, stage: int) -> int:
    """ZeRO paper: elements communicated per step per rank (payload): 2Ψ at stages 0-2, 3Ψ at 3."""
    return (3 if stage == 3 else 2) * parameters
