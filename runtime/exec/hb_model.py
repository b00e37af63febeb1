"""The happens-before model behind the CPU stream checker (``runtime/exec/hb_check.py``).

Agents are what runs work in order on CUDA: a stream per device lane, the default stream, NCCL's
own stream, and a host thread per host lane. Each has a vector clock (agent -> the last epoch of
that agent it is ordered after); an access is stamped with its agent and a fresh epoch. Recording
an event copies a clock, waiting on one merges it, as ``torch.cuda._sanitizer`` does.

Memory is tracked per block (a storage): its last write and, per agent, its last read since. A
read must be ordered after the last write; a write after the last write and every read since.

The allocator model follows CUDA's caching allocator: a block belongs to the pool of the stream
that allocated it; freed on another stream it goes back to that pool at once, unless the freeing
stream was recorded on it (``record_stream``), in which case it is reused only once the recorded
streams have passed the free. Any allocation on the pool's stream may receive any freed block of
it (what the CPU allocator's addresses would say is not used), so an allocation that is not
ordered after the free counts as a write to the block: every access to it must be ordered before
the allocation, or covered by a recorded stream. This module never imports torch.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

Clock = dict[str, int]


@dataclass(frozen=True)
class Access:
    agent: str
    epoch: int
    who: str                 # the op that made it, as a report names it
    write: bool


@dataclass
class Block:
    """One storage: where it was allocated, its accesses, the graph buffer it holds (if known)."""
    agent: str               # the stream whose pool it came from
    name: str | None = None
    write: Access | None = None
    reads: dict[str, Access] = field(default_factory=dict)      # agent -> its last read since the write

    def accesses(self) -> list[Access]:
        return ([self.write] if self.write is not None else []) + list(self.reads.values())


@dataclass
class Freed:
    """A block back in its pool: who freed it, and the clocks of the streams recorded on it."""
    block: Block
    by: str                  # the freeing op
    agent: str
    recorded: list[Clock]


@dataclass(frozen=True)
class Race:
    block: Block
    first: Access
    second: Access
    freed: Freed | None = None      # a reuse: ``second`` is an allocation that may receive the block


class Clocks:
    """Every agent's vector clock, events as recorded clocks, and the races found."""

    def __init__(self) -> None:
        self.clock: dict[str, Clock] = {}
        self.races: list[Race] = []
        self.seen: set[tuple] = set()

    def of(self, agent: str) -> Clock:
        c = self.clock.get(agent)
        if c is None:
            c = self.clock[agent] = {agent: 0}
        return c

    def tick(self, agent: str) -> int:
        c = self.of(agent)
        c[agent] += 1
        return c[agent]

    def snapshot(self, agent: str) -> Clock:
        return dict(self.of(agent))

    def merge(self, agent: str, other: Clock | None) -> None:
        if not other:
            return
        c = self.of(agent)
        for a, e in other.items():
            if c.get(a, 0) < e:
                c[a] = e

    def sync_all(self, agent: str) -> None:
        """``agent`` waits for every other (a device synchronize seen by the host)."""
        for a in list(self.clock):
            self.merge(agent, self.clock[a])

    def ordered(self, clock: Clock, agent: str, prev: Access) -> bool:
        return prev.agent == agent or clock.get(prev.agent, 0) >= prev.epoch

    # -- accesses ----------------------------------------------------------------
    def access(self, block: Block, agent: str, epoch: int, who: str, write: bool) -> None:
        now = Access(agent, epoch, who, write)
        clock = self.of(agent)
        prior = list(block.reads.values()) if write and block.reads else \
            ([block.write] if block.write is not None else [])
        for prev in prior:
            if not self.ordered(clock, agent, prev):
                self.report(Race(block, prev, now))
        if write:
            block.write, block.reads = now, {}
        else:
            block.reads[agent] = now

    def reuse(self, freed: Freed, alloc: Access, clock: Clock) -> None:
        """``alloc`` (on the block's pool stream, with ``clock``) may receive ``freed``'s block."""
        for prev in freed.block.accesses():
            if self.ordered(clock, alloc.agent, prev):
                continue
            if any(rec.get(prev.agent, 0) >= prev.epoch for rec in freed.recorded):
                continue
            self.report(Race(freed.block, prev, alloc, freed))

    def report(self, race: Race) -> None:
        key = (id(race.block), race.first.who, race.second.who, race.freed is not None)
        if key not in self.seen:
            self.seen.add(key)
            self.races.append(race)


class Pools:
    """The caching allocator's pools, one per device stream: freed blocks waiting for their next
    allocation, and the allocations made on each stream (since the last device synchronize)."""

    def __init__(self, clocks: Clocks):
        self.clocks = clocks
        self.pending: dict[str, list[Freed]] = {}
        self.allocs: dict[str, list[tuple[Access, Clock]]] = {}

    def allocate(self, agent: str, who: str) -> None:
        """An allocation on ``agent``'s stream: it may receive any block waiting in its pool."""
        epoch = self.clocks.tick(agent)
        alloc, clock = Access(agent, epoch, who, True), self.clocks.snapshot(agent)
        self.allocs.setdefault(agent, []).append((alloc, clock))     # epochs ascending
        for freed in self.pending.pop(agent, ()):
            self.clocks.reuse(freed, alloc, clock)

    def free(self, freed: Freed) -> None:
        """``freed`` goes back to its pool. An allocation on the pool's stream that the free is not
        ordered after (it could have come after the free on the device) is checked now, the
        first of them (the one ordered after least); else the next allocation checks it."""
        pool = freed.block.agent
        known = self.clocks.of(freed.agent).get(pool, 0)
        allocs = self.allocs.get(pool, [])
        first = bisect.bisect_right(allocs, known, key=lambda entry: entry[0].epoch)
        if first < len(allocs):
            self.clocks.reuse(freed, *allocs[first])
        else:
            self.pending.setdefault(pool, []).append(freed)

    def synchronized(self) -> None:
        """After a device synchronize every later allocation is ordered after every free."""
        self.pending.clear()
        self.allocs.clear()
