"""Memory per rank per tier: model states (parameters, gradients, optimizer) and working buffers.

Model states are the graph's persistent buffers: live the whole step, summed
by the state they belong to and the tier they live on. Their totals are what
the ZeRO paper's formulas predict (2Ψ + 2Ψ + 12Ψ at stage 0 ... 16Ψ/N at stage
3 for mixed-precision Adam), up to the padding of each unit's shard.

Working buffers (gathered units at stage 3, activations, gradients before
they are reduced, staging copies) live from the first op that writes them
until the ``mem.free`` that releases them (or the end of the step). Their peak
depends on *when* ops run, so it is measured on the simulated timeline: this
is where prefetch depth shows up as memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zdsl import schedule
from zdsl.ir import TIERS, TaskGraph, optimizer_bytes_per_param

STATES = tuple(reversed(schedule.STATES))   # the plan's columns: parameters first, as a reader meets them

# What a working buffer is, for the breakdown of the working peak.
WORKING_KINDS = {"param_full": "gathered_parameters", "act": "activations", "act_inner": "activations",
                 "act_grad": "activations", "grad_full": "gradients", "grad_shard": "gradients"}


def working_kind(name: str) -> str:
    """gathered_parameters / activations / gradients, or staging (copies between tiers, shards in flight)."""
    base, _, tier = name.partition("@")
    if tier:
        return "staging"
    return WORKING_KINDS.get(base.split("[", 1)[0], "staging")


@dataclass
class Interval:
    """One allocation of a working buffer: from the op that writes it to the op that frees it."""
    buffer: str
    tier: str
    bytes: int
    alloc: int                  # graph position of the allocating op
    free: int | None            # graph position of the mem.free, None = held to the end of the step


def model_states(graph: TaskGraph) -> dict[str, dict[str, int]]:
    """tier -> {parameters, gradients, optimizer} -> bytes held by persistent buffers."""
    out = {tier: dict.fromkeys(STATES, 0) for tier in TIERS}
    for buf in graph.buffers.values():
        if buf.persistent and buf.state:
            out.setdefault(buf.tier, dict.fromkeys(STATES, 0))[buf.state] += buf.bytes
    return out


def working_intervals(graph: TaskGraph) -> list[Interval]:
    """Allocations of non-persistent buffers, walking ops in graph order.

    A write to a buffer that is not live allocates it; ``mem.free`` releases
    every buffer it names. Per buffer, graph order is the order the ops run
    in (the derived deps enforce it), so this needs no timing.
    """
    live: dict[str, Interval] = {}
    done: list[Interval] = []
    buffers = graph.buffers
    working = {name for name, buf in buffers.items() if not buf.persistent}
    for i, op in enumerate(graph.ops):
        if op.kind == "mem.free":
            for name in (*op.reads, *op.writes):
                iv = live.pop(name, None)
                if iv is not None:
                    iv.free = i
                    done.append(iv)
            continue
        for name in op.writes:
            if name in working and name not in live:
                buf = buffers[name]
                live[name] = Interval(name, buf.tier, buf.bytes, i, None)
    done.extend(live.values())
    return done


class Series(list):
    """A plain list that also answers the two numpy calls callers used when this was an array
    (``runtime/exec/tracing.py``: ``.any()``, ``.tolist()``); the planner avoids numpy's import time."""

    def any(self) -> bool:
        return any(self)

    def tolist(self) -> list:
        return list(self)


@dataclass
class TierTimeline:
    times: Series               # seconds, sorted
    working: Series             # working bytes live just after each time
    model_states: int           # constant over the step

    @property
    def working_peak(self) -> int:
        return max(self.working, default=0)

    @property
    def peak(self) -> int:
        return self.model_states + self.working_peak

    @property
    def peak_time(self) -> float:
        return self.times[self.working.index(self.working_peak)] if self.working else 0.0


@dataclass
class MemoryTimeline:
    tiers: dict[str, TierTimeline]
    states: dict[str, dict[str, int]]           # tier -> state -> bytes (model states)
    intervals: list[Interval] = field(default_factory=list)
    alloc_time: list[float] = field(default_factory=list)   # per interval
    free_time: list[float] = field(default_factory=list)    # per interval (inf: held to the end)

    def peak(self, tier: str) -> int:
        tl = self.tiers.get(tier)
        return tl.peak if tl else sum(self.states.get(tier, {}).values())

    def live_at_peak(self, tier: str) -> list[Interval]:
        """Working buffers held on ``tier`` when its peak is reached, largest first."""
        tl = self.tiers.get(tier)
        if tl is None or not self.intervals:
            return []
        t = tl.peak_time
        live = [iv for iv, a, f in zip(self.intervals, self.alloc_time, self.free_time)
                if iv.tier == tier and a <= t < f]
        return sorted(live, key=lambda iv: -iv.bytes)

    def working_at_peak(self, tier: str) -> dict[str, int]:
        """The working peak of ``tier`` split into gathered parameters, activations, gradients, staging."""
        out: dict[str, int] = {}
        for iv in self.live_at_peak(tier):
            kind = working_kind(iv.buffer)
            out[kind] = out.get(kind, 0) + iv.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_json(self) -> dict:
        """tier -> {model_states: {parameters, gradients, optimizer}, working, working_at_peak, peak}."""
        out = {}
        for tier in TIERS:
            states = self.states.get(tier, dict.fromkeys(STATES, 0))
            tl = self.tiers.get(tier)
            working = tl.working_peak if tl else 0
            out[tier] = {"model_states": dict(states), "working": working,
                         "working_at_peak": self.working_at_peak(tier) if working else {},
                         "peak": sum(states.values()) + working}
        return out


def memory_timeline(graph: TaskGraph, start: list[float], end: list[float]) -> MemoryTimeline:
    """Bytes live per tier over the simulated step (``start``/``end`` per op position)."""
    states = model_states(graph)
    intervals = working_intervals(graph)
    step_end = max(end, default=0.0)
    inf = float("inf")
    alloc_t = [start[iv.alloc] for iv in intervals]
    free_t = [end[iv.free] if iv.free is not None else inf for iv in intervals]
    events: dict[str, list[tuple[float, int, int]]] = {tier: [(0.0, 0, 0)] for tier in set(TIERS) | set(states)}
    for iv, a, f in zip(intervals, alloc_t, free_t):
        ev = events.setdefault(iv.tier, [(0.0, 0, 0)])
        ev.append((a, 1, iv.bytes))
        if f != inf:
            # (time, 0) sorts before (time, 1): a buffer released at t can be reused at t
            ev.append((f, 0, -iv.bytes))
    tiers = {}
    for tier, ev in sorted(events.items()):
        ev.sort()
        times, working, live = [], [], 0
        for t, _, delta in ev:
            live += delta
            times.append(min(t, step_end))
            working.append(live)
        tiers[tier] = TierTimeline(times=Series(times), working=Series(working),
                                   model_states=sum(states.get(tier, {}).values()))
    return MemoryTimeline(tiers=tiers, states=states, intervals=intervals,
                          alloc_time=alloc_t, free_time=free_t)


def zero_model_states(parameters: int, ranks: int, stage: int, precision: str,
                      optimizer: str = "adamw", momentum: float = 0.0) -> dict[str, float]:
    """The ZeRO paper's model-state bytes per rank, split by state (before padding).

    A reference the graph's own sizes are compared with, so it does not read the graph: K, the
    optimizer's bytes per parameter, has the paper's master copy (in mixed precision only; the
    graph's ``UnitInfo.master`` also says where offload adds one)."""
    k_p = 4 if precision == "fp32" else 2
    k_o = optimizer_bytes_per_param(optimizer, momentum, master=precision in ("bf16", "fp16"))
    psi, n = parameters, ranks
    return {
        "parameters": k_p * psi / (n if stage >= 3 else 1),
        "gradients": k_p * psi / (n if stage >= 2 else 1),
        "optimizer": k_o * psi / (n if stage >= 1 else 1),
    }
