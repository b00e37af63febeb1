"""Which host copies of NVMe-homed state stay resident between uses: Belady's rule.

ZeRO-Infinity treats host memory as a cache over NVMe, managed by a recency policy. A compiled
step knows every future access before the first step, so it can do what no online policy can:
keep the copy whose next use is nearest and evict the one used furthest in the future (Belady's
MIN). The step's access sequence is read off the graph built without residency:

* a **gap** is the time between the free of a host staging copy (``param_shard[u]@host``,
  ``optim[u]@host``, ...) and the next op that writes that copy again. When that op is an
  ``nvme.read``, keeping the copy resident across the gap saves the read (a *reread* gap: the
  parameters a unit reads in forward and again in backward, unchanged in between). When it is
  a fresh overwrite (the step writes new parameters) or nothing in the step, holding the copy
  saves nothing: the data is dead;
* the **room** a gap may use is the host budget (``memory host``) less the host model states
  and the working buffers the simulated step holds at each moment (the verifier's memory
  timeline, :mod:`zdsl.sim.memory`);
* :func:`belady` sweeps the reread gaps by start time, admits each and, wherever the room is
  exceeded, evicts the held copy whose next use is furthest in the future (possibly the new
  one). :func:`lru` runs a recency cache of the same room on the same sequence, holding every
  freed copy (it cannot tell a dead one from a live one), for the plan's comparison.

The result is a set of (buffer, end) pairs: the ``end``-th free the op stream issues for that
buffer is left out, so the copy stays live and the next read finds it
(:mod:`zdsl.compile.emission`); every such copy is released by the step's end. Residency is the
last of the three mechanisms that mean "ahead" (:mod:`zdsl.compile.lower` states how they
relate); :mod:`zdsl.compile.host_budget` runs it.

Across the step boundary the one form a one-step graph can state is a copy held through the
whole cycle: the state's home moves to the host for that unit (read and written nowhere else, as
under ``offload ... -> cpu``; checkpoints and exports read it there). :func:`hold_through_cycle`
picks those first, in Belady's order at the boundary (the state the next step uses soonest
first), from the room free at every moment of the step; the gaps within the step then share what
is left. A copy carried over the boundary and evicted later in the step (write-back on eviction)
would need the runtime to hold working buffers between steps, which it does not.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from zdsl.ir import TaskGraph

# choices made before residency gives up, each in a room shrunk by the last one's excess over the budget
MAX_TRIES = 4


@dataclass(frozen=True)
class Gap:
    """A host copy's time off the host between two uses (seconds of the simulated step)."""
    buffer: str          # the host copy, e.g. ``param_shard[3]@host``
    end: int             # which of the op stream's frees of ``buffer`` opens the gap (0-based; -1: not one)
    bytes: int
    start: float         # the copy is released (end of its free)
    stop: float          # the next use starts: an nvme.read (reread) or an overwrite / the step's end
    reread: bool         # the next use reads it back from NVMe: holding it saves ``bytes``


@dataclass(frozen=True)
class Hold:
    """NVMe state a step could hold on the host through the whole cycle (home there instead)."""
    state: str           # "parameters" or "optimizer"
    unit: int
    buffer: str          # its NVMe home, e.g. ``optim[3]@nvme``
    bytes: int
    moved: int           # NVMe bytes per step its reads and writes move now
    read: int            # ... of them read
    first: float         # when the step first uses it: its next use after the step boundary


@dataclass
class Residency:
    """The copies kept and what they save per step, against a recency cache of the same room."""
    keep: frozenset = frozenset()         # (buffer, end) pairs whose free is left out
    saved: int = 0                        # NVMe read bytes per step the kept copies save
    lru_saved: int = 0                    # ... that an LRU cache of the same room would save (within the step)
    reread: int = 0                       # NVMe read bytes per step a cache could save at most
    gaps: int = 0                         # reread gaps (candidates)
    budget: int = 0                       # the host budget the room came from
    kept: list[str] = field(default_factory=list)    # buffers kept at least once, in graph order
    held: list[Hold] = field(default_factory=list)   # states held on the host through the cycle

    def to_json(self) -> dict:
        return {"policy": "belady", "host_budget": self.budget, "candidates": self.gaps,
                "kept": len(self.keep), "buffers": self.kept, "saved_bytes": self.saved,
                "lru_saved_bytes": self.lru_saved, "max_saved_bytes": self.reread,
                "held": [h.buffer for h in self.held], "held_saved_bytes": sum(h.moved for h in self.held),
                "held_read_bytes": sum(h.read for h in self.held)}


def cycle_candidates(graph: TaskGraph, start: list[float]) -> list[Hold]:
    """Every parameter shard and optimizer state whose home is NVMe, with what it moves per step."""
    moved: dict[str, int] = {}
    read: dict[str, int] = {}
    first: dict[str, float] = {}
    for i, op in enumerate(graph.ops):
        if op.kind in ("nvme.read", "nvme.write"):
            for name in (*op.reads, *op.writes):
                if name.endswith("@nvme"):
                    moved[name] = moved.get(name, 0) + op.bytes
                    read[name] = read.get(name, 0) + (op.bytes if op.kind == "nvme.read" else 0)
                    first.setdefault(name, start[i])
    states = {"param_shard": "parameters", "optim": "optimizer"}
    return [Hold(states[buf.kind], buf.unit, name, buf.bytes, moved.get(name, 0), read.get(name, 0),
                 first.get(name, float("inf")))
            for name, buf in graph.buffers.items()
            if buf.persistent and buf.tier == "nvme" and buf.kind in states and moved.get(name)
            and buf.unit is not None]


def hold_through_cycle(candidates: list[Hold], room: int) -> list[Hold]:
    """Belady's rule at the step boundary, for copies held all the time: the state the next step
    uses soonest first (the first units' parameters, then the optimizer state in step order),
    each while it fits in ``room``, the bytes free at every moment of the step."""
    held, used = [], 0
    for hold in sorted(candidates, key=lambda h: (h.first, h.unit, h.state)):
        if used + hold.bytes <= room:
            held.append(hold)
            used += hold.bytes
    return held


def nvme_staging(graph: TaskGraph) -> set[str]:
    """Host copies of buffers whose home is NVMe (``X@host`` where ``X@nvme`` exists)."""
    out = set()
    for name in graph.buffers:
        base, _, tier = name.partition("@")
        if tier == "nvme" and f"{base}@host" in graph.buffers:
            out.add(f"{base}@host")
    return out


def find_gaps(graph: TaskGraph, start: list[float], end: list[float], step_s: float,
              frees: dict[int, tuple[str, int]]) -> list[Gap]:
    """Every gap in the step: one per free of a host copy of NVMe state. ``frees`` (op position
    -> (buffer, end)) are the op stream's own, which residency may leave out; the others (the
    frees after a last use auto-free adds) get ``end`` -1: a recency cache holds those copies
    too, but they cannot be kept."""
    staging = nvme_staging(graph)
    writes: dict[str, list[int]] = {}
    ends: list[tuple[int, str]] = []
    for i, op in enumerate(graph.ops):
        for name in op.writes:
            if name in staging and op.kind == "mem.free":
                ends.append((i, name))
            elif name in staging:
                writes.setdefault(name, []).append(i)
    out = []
    for i, name in ends:
        after = writes.get(name, [])
        j = bisect.bisect_right(after, i)
        if j < len(after):
            stop, reread = start[after[j]], graph.ops[after[j]].kind == "nvme.read"
        else:
            stop, reread = step_s, False
        k = frees[i][1] if i in frees else -1
        out.append(Gap(name, k, graph.buffers[name].bytes, end[i], max(stop, end[i]), reread))
    return out


class Room:
    """The host bytes free for resident copies over the step: a step function of time."""

    def __init__(self, times: list[float], working: list[float], budget: int, states: int, gaps: list[Gap]):
        points = sorted({*times, *(g.start for g in gaps), *(g.stop for g in gaps)})
        self.points = points
        self.free: list[float] = []
        j = 0
        live: float = 0
        for t in points:
            while j < len(times) and times[j] <= t:   # the value after every event at t
                live = working[j]
                j += 1
            self.free.append(budget - states - live)

    def span(self, gap: Gap) -> range:
        """The segments [points[s], points[s+1]) a gap covers."""
        return range(bisect.bisect_left(self.points, gap.start), bisect.bisect_left(self.points, gap.stop))


def belady(gaps: list[Gap], room: Room, margin: int = 0) -> list[Gap]:
    """The reread gaps to hold: admitted in start order; where the room (less ``margin``) is
    exceeded, the held copy whose next use is furthest away goes (Belady's rule)."""
    load = [0] * len(room.points)
    held: list[Gap] = []
    for gap in sorted((g for g in gaps if g.reread and g.end >= 0), key=lambda g: (g.start, g.stop, g.buffer, g.end)):
        held.append(gap)
        for s in room.span(gap):
            load[s] += gap.bytes
        while True:
            over = next((s for s in room.span(gap) if load[s] > max(room.free[s] - margin, 0)), None)
            if over is None:
                break
            victim = max((h for h in held if over in room.span(h)),
                         key=lambda h: (h.stop, h.bytes, h.buffer, h.end))
            held.remove(victim)
            for s in room.span(victim):
                load[s] -= victim.bytes
    return held


def lru(gaps: list[Gap], room: Room) -> list[Gap]:
    """The reread gaps a least-recently-used cache of the same room would hit: every freed copy
    enters the cache; while the cache exceeds the room, the copy used longest ago leaves."""
    starts: dict[int, list[Gap]] = {}
    stops: dict[int, list[Gap]] = {}
    for gap in gaps:
        span = room.span(gap)
        if len(span):
            starts.setdefault(span.start, []).append(gap)
            stops.setdefault(span.stop, []).append(gap)
    cache: dict[Gap, None] = {}       # insertion order = recency order (oldest first)
    hits, load = [], 0
    for s in range(len(room.points)):
        for gap in stops.get(s, ()):
            if gap in cache:
                del cache[gap]
                load -= gap.bytes
                if gap.reread:
                    hits.append(gap)
        for gap in sorted(starts.get(s, ()), key=lambda g: (g.buffer, g.end)):
            cache[gap] = None
            load += gap.bytes
        while cache and load > room.free[s]:
            oldest = next(iter(cache))
            del cache[oldest]
            load -= oldest.bytes
    return hits


def summarize(gaps: list[Gap], held: list[Gap], room: Room, budget: int, cycle: Sequence[Hold] = ()) -> Residency:
    """What keeping ``held`` (and holding ``cycle``) saves, beside an LRU cache of the same room
    within the step and the most a cache within the step could."""
    kept = {g.buffer for g in held}
    return Residency(keep=frozenset((g.buffer, g.end) for g in held), saved=sum(g.bytes for g in held),
                     held=list(cycle),
                     lru_saved=sum(g.bytes for g in lru(gaps, room)),
                     reread=sum(g.bytes for g in gaps if g.reread), gaps=sum(g.reread for g in gaps),
                     budget=budget, kept=list(dict.fromkeys(g.buffer for g in sorted(gaps, key=lambda g: g.start)
                                                            if g.buffer in kept)))


def lru_saved(graph: TaskGraph, start: list[float], end: list[float], step_s: float, host, budget: int,
              frees: dict[int, tuple[str, int]]) -> int:
    """NVMe read bytes per step an LRU cache of the whole room would save on ``graph`` (the graph
    before any state is held: a recency cache has only the step's sequence to go by)."""
    gaps = find_gaps(graph, start, end, step_s, frees)
    return sum(g.bytes for g in lru(gaps, Room(host.times, host.working, budget, host.model_states, gaps)))
