"""The op stream: ops in issue order, and which buffers hold data at each point of it.

Contract: every op of a step graph is issued through :meth:`OpStream.issue`, which names its
buffers in the table and tracks liveness, so that a later statement can ask whether a buffer
holds data now (:meth:`OpStream.is_valid`) and be dropped where it does not apply. Frees go
through :meth:`OpStream.free`: on the lane that produced the buffer (that lane cannot run ahead
of its consumers, which bounds prefetch memory), never of model state, and left out where the
host budget keeps a host copy of NVMe state (``keep``: (host copy, end) pairs,
:mod:`zdsl.compile.residency`). A kept copy is *resting*: held, but to every statement as
absent as if freed, until the read it replaces revives it, so a build with ``keep`` makes the
same decisions as the build it was chosen on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zdsl.compile.buffers import BufferTable
from zdsl.compile.homes import UnitHomes
from zdsl.ir import ALL, OP_LANES, buffer_name, parse_buffer_name
from zdsl.schedule import PipeStmt


@dataclass
class Draft:
    """An op before its dependencies are derived (:mod:`zdsl.compile.finish`)."""
    kind: str
    lane: str
    unit: int | None
    reads: list[str]
    writes: list[str]
    phase: str
    micro: int
    bytes: int = 0
    flops: float = 0.0
    kernels: int = 0
    part: int = 0
    parts: int = 1
    accumulate: bool = False
    span: tuple[int, int] | None = None
    fresh: set[str] = field(default_factory=set)   # writes that start a new instance of the buffer
    group: str = ALL                               # a collective's ranks (zdsl.ir.ALL)


class OpStream:
    def __init__(self, homes: UnitHomes, buffers: BufferTable, keep: frozenset = frozenset()):
        self.homes = homes
        self.buffers = buffers
        self.keep = keep                         # (host copy, end): frees left out (zdsl/compile/residency.py)
        self.drafts: list[Draft] = []
        self.live: set[str] = set()
        self.stale: set[str] = set()             # gathered parameters a step has since updated
        self.resting: set[str] = set()           # kept copies between their left-out free and next read
        self.ends: dict[str, int] = {}           # host copy of NVMe state -> frees issued (or left out) so far
        self.free_drafts: list[tuple[Draft, str, int]] = []
        self.producer_lane: dict[str, str] = {}
        self.waiting_users: dict[int, set[int]] = {}   # unit -> tied users gathered but not yet computed

    def issue(self, kind, unit, reads, writes, phase, micro, stmt, lane=None, **kw) -> Draft:
        """Append one op (``kw``: the other ``Draft`` fields) and track what it makes live."""
        span = (stmt.span.line, stmt.span.column) if stmt is not None and stmt.span else None
        draft = Draft(kind, lane or OP_LANES[kind], unit, list(reads), list(writes), phase, micro, span=span, **kw)
        for name in draft.reads + draft.writes:
            self.buffers.get(name)
        for name in draft.writes:
            self.resting.discard(name)
            if draft.kind == "mem.free":
                self.live.discard(name)
                continue
            if name not in self.live and not self.buffers.by_name[name].persistent:
                self.producer_lane[name] = draft.lane
            self.live.add(name)
            if draft.kind == "comm.all_gather":
                self.stale.discard(name)
        self.drafts.append(draft)
        return draft

    def is_valid(self, name: str) -> bool:
        """Holds data now: persistent model state, or a live working buffer."""
        return name in self.buffers.persistent or (name in self.live and name not in self.resting)

    def collective(self, kind, u, reads, writes, phase, micro, stmt, accumulate=False, trained=False,
                   group=ALL, shard=False) -> int:
        """One op per part over ``group``: every part for a gather, the trainable ones for a
        gradient reduction or a gather of what a step updated (``trained``). Each moves its part of
        the full buffer, or with ``shard`` its part of the shard (an all-reduce across replicas).
        Returns the position of the first."""
        layout = self.homes.layouts[u]
        parts = layout.parts if kind == "comm.all_gather" and not trained else layout.trainable_parts
        first = len(self.drafts)
        for part in range(parts):
            numel = layout.part_size(part) // (self.homes.shard_ranks if shard else 1)
            self.issue(kind, u, reads, writes, phase, micro, stmt, bytes=numel * self.homes.elem_bytes,
                       part=part, parts=parts, accumulate=accumulate, group=group)
        return first

    def consume(self, name: str, phase: str, micro: int) -> None:
        """A staging copy of a shard is used up by the copy or collective that reads it."""
        self.free(name, phase, micro, None)

    def free(self, name: str, phase: str, micro: int, stmt: PipeStmt | None) -> None:
        if not self.is_valid(name) or name in self.buffers.persistent:
            return
        kind, u, tier = parse_buffer_name(name)
        if kind == "param_full" and u is not None and self.waiting_users.get(u):
            return   # a tied user gathered it ahead and has not computed yet: its last use frees it
        end = None
        if tier == "host" and self.homes.nvme_home(kind, u):
            end = self.ends.get(name, 0)
            self.ends[name] = end + 1
            if (name, end) in self.keep:
                self.resting.add(name)
                return
        lane = self.producer_lane.get(name, "compute")
        draft = self.issue("mem.free", self.buffers.by_name[name].unit, [], [name], phase, micro, stmt, lane=lane)
        if end is not None:
            self.free_drafts.append((draft, name, end))

    def read_nvme(self, kind: str, u: int, phase: str, micro: int, stmt: PipeStmt | None) -> None:
        """Bring ``kind`` of unit ``u`` from NVMe to its host copy; a resting (kept) copy is
        already there, and is live again instead."""
        host = buffer_name(kind, u, "host")
        if host in self.resting:
            self.resting.discard(host)
            return
        on_disk = buffer_name(kind, u, "nvme")
        self.issue("nvme.read", u, [on_disk], [host], phase, micro, stmt, bytes=self.buffers.get(on_disk).bytes,
                   fresh={host})

    def free_positions(self) -> dict[int, tuple[str, int]]:
        """Graph position -> (host copy, end) of every free of a host copy of NVMe state."""
        position = {id(draft): i for i, draft in enumerate(self.drafts)}
        return {position[id(draft)]: (name, end) for draft, name, end in self.free_drafts}
