"""Chrome trace JSON (opens in Perfetto and chrome://tracing) for predicted and measured steps.

One format for both, so a prediction and a measurement open side by side:
one process (pid) per rank, one thread (tid) per lane, a complete event
("X") per op, flow arrows ("s"/"f") for dependencies that cross lanes, and
counter events ("C") named ``memory.<tier>`` for the bytes held per tier
(``args.bytes``, split into ``model_states`` and ``working``). Times are microseconds.
The runtime records :class:`TraceSpan` and :class:`TraceCounter` and calls
:func:`chrome_trace`; the planner calls :func:`predicted_trace`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from zdsl.ir import LANES, TaskGraph

US = 1e6


@dataclass
class TraceSpan:
    rank: int
    lane: str
    name: str
    start_s: float
    end_s: float
    op: int | None = None               # op id in the task graph
    args: dict = field(default_factory=dict)


@dataclass
class TraceCounter:
    rank: int
    name: str                           # "memory.<tier>" for bytes held on a tier
    time_s: float
    values: dict[str, float]            # series -> value; memory counters carry "bytes" (the total)


def lane_tid(lane: str) -> int:
    return LANES.index(lane) + 1 if lane in LANES else len(LANES) + 1


def op_label(op) -> str:
    """``forward 3``, ``all_gather 3.1`` (part 1), ``free 3``."""
    verb = op.kind.split(".", 1)[1]
    if op.unit is None:
        return verb
    return f"{verb} {op.unit}" + (f".{op.part}" if op.parts > 1 else "")


def chrome_trace(spans: list[TraceSpan], deps: dict[int, list[int]] | None = None,
                 counters: list[TraceCounter] | None = None, metadata: dict | None = None) -> dict:
    """Build the trace object; ``deps`` (op id -> op ids it waits for) draws cross-lane flows."""
    events: list[dict] = []
    ranks = sorted({s.rank for s in spans} | {c.rank for c in counters or []})
    lanes_of: dict[int, set[str]] = {r: set() for r in ranks}
    for s in spans:
        lanes_of[s.rank].add(s.lane)
    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for lane in sorted(lanes_of[r], key=lane_tid):
            tid = lane_tid(lane)
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid,
                           "args": {"sort_index": tid}})
    where: dict[tuple[int, int], TraceSpan] = {}
    for s in spans:
        args = dict(s.args)
        if s.op is not None:
            args["op"] = s.op
            where[(s.rank, s.op)] = s
        events.append({"ph": "X", "name": s.name, "cat": s.name.split(" ", 1)[0], "pid": s.rank,
                       "tid": lane_tid(s.lane), "ts": s.start_s * US,
                       "dur": max(s.end_s - s.start_s, 0.0) * US, "args": args})
    flow = 0
    links = deps or {}
    for (rank, op), s in where.items() if links else ():
        for d in links.get(op, ()):
            src = where.get((rank, d))
            if src is None or src.lane == s.lane:
                continue
            flow += 1
            # the start binds to the slice enclosing its time: the producer's middle is inside it
            events.append({"ph": "s", "name": "dep", "cat": "dep", "id": flow, "pid": rank,
                           "tid": lane_tid(src.lane), "ts": (src.start_s + src.end_s) / 2 * US})
            events.append({"ph": "f", "bp": "e", "name": "dep", "cat": "dep", "id": flow, "pid": rank,
                           "tid": lane_tid(s.lane), "ts": s.start_s * US})
    for c in counters or []:
        events.append({"ph": "C", "name": c.name, "pid": c.rank, "tid": 0, "ts": c.time_s * US,
                       "args": dict(c.values)})
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata or {}}


def predicted_trace(graph: TaskGraph, sim, ranks: int | None = None) -> dict:
    """The simulated step (``zdsl.sim.simulate.Simulation``) for every rank (SPMD: all alike)."""
    ranks = graph.ranks if ranks is None else ranks
    spans, counters = [], []
    base = [(op, float(sim.start[i]), float(sim.end[i])) for i, op in enumerate(graph.ops)]
    for r in range(ranks):
        for op, t0, t1 in base:
            spans.append(TraceSpan(r, op.lane, op_label(op), t0, t1, op.id,
                                   {"kind": op.kind, "unit": op.unit, "micro": op.micro,
                                    "part": op.part, "bytes": op.bytes, "flops": op.flops}))
        for tier, tl in sim.memory.tiers.items():
            if not tl.model_states and not any(tl.working):
                continue
            for t, w in zip(tl.times, tl.working):
                counters.append(TraceCounter(r, f"memory.{tier}", t,
                                             {"bytes": tl.model_states + int(w),
                                              "model_states": tl.model_states, "working": int(w)}))
    deps = {op.id: list(op.deps) for op in graph.ops}
    return chrome_trace(spans, deps, counters,
                        {"source": "zdsl plan (predicted)", "schedule": graph.schedule,
                         "step_s": sim.step_s})


def write_trace(path: str | Path, trace: dict) -> None:
    Path(path).write_text(json.dumps(trace, separators=(",", ":")))


def read_trace(path: str | Path) -> tuple[list[TraceSpan], list[TraceCounter]]:
    """The spans and counters of a trace written by :func:`chrome_trace` (predicted or measured)."""
    raw = json.loads(Path(path).read_text())
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    lane_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                  if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans, counters = [], []
    for e in events:
        if e.get("ph") == "X":
            args = dict(e.get("args", {}))
            op = args.pop("op", None)
            t0 = e["ts"] / US
            spans.append(TraceSpan(e["pid"], lane_names.get((e["pid"], e["tid"]), str(e["tid"])),
                                   e["name"], t0, t0 + e.get("dur", 0) / US, op, args))
        elif e.get("ph") == "C":
            counters.append(TraceCounter(e["pid"], e["name"], e["ts"] / US, dict(e.get("args", {}))))
    return spans, counters
