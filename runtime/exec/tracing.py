"""Measured traces: every op's start and end per rank and lane, one Chrome trace for the run.

Each rank writes its own part next to the output; after a barrier rank 0
merges them, so the file holds one pid per rank and one tid per lane, flow
arrows for cross-lane dependencies and counters for the bytes held per tier
(replayed from the measured op times with the planner's own memory model).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from zdsl.ir import TaskGraph
from zdsl.observe.timeline import render_timeline
from zdsl.observe.trace import TraceCounter, TraceSpan, chrome_trace, op_label
from zdsl.runtime.exec.executor import StepRecord
from zdsl.sim.memory import memory_timeline


def rank_events(graph: TaskGraph, records: list[tuple[int, StepRecord]], rank: int):
    """Spans and memory counters of the recorded steps, laid end to end."""
    spans, counters = [], []
    offset = 0.0
    for step, rec in records:
        start = [t.start for t in rec.timings]
        end = [t.end for t in rec.timings]
        for op, t0, t1 in zip(graph.ops, start, end):
            if op.kind == "mem.free":
                continue
            spans.append(TraceSpan(rank, op.lane, op_label(op), offset + t0, offset + t1, op.id,
                                   {"kind": op.kind, "unit": op.unit, "micro": op.micro, "part": op.part,
                                    "bytes": op.bytes, "step": step}))
        mem = memory_timeline(graph, start, end)
        for tier, tl in mem.tiers.items():
            if not tl.model_states and not tl.working.any():
                continue
            for t, w in zip(tl.times.tolist(), tl.working.tolist()):
                counters.append(TraceCounter(rank, f"memory.{tier}", offset + t,
                                             {"bytes": tl.model_states + int(w), "model_states": tl.model_states,
                                              "working": int(w)}))
        offset += rec.seconds
    return spans, counters


def write_measured_trace(graph: TaskGraph, records, rank: int, world: int, options, state=None) -> None:
    spans, counters = rank_events(graph, records, rank)
    target = Path(options.trace or options.timeline + ".trace.json")
    part = target.with_name(f".{target.name}.rank{rank}")
    part.write_text(json.dumps({"spans": [s.__dict__ for s in spans], "counters": [c.__dict__ for c in counters]}))
    dist.barrier()
    if rank != 0:
        return
    all_spans, all_counters = [], []
    for r in range(world):
        p = target.with_name(f".{target.name}.rank{r}")
        raw = json.loads(p.read_text())
        all_spans += [TraceSpan(**s) for s in raw["spans"]]
        all_counters += [TraceCounter(**c) for c in raw["counters"]]
        os.unlink(p)
    deps = {op.id: list(op.deps) for op in graph.ops}
    trace = chrome_trace(all_spans, deps, all_counters,
                         {"source": "zdsl run (measured)", "schedule": graph.schedule,
                          "steps": [s for s, _ in records]})
    if options.trace:
        Path(options.trace).write_text(json.dumps(trace, separators=(",", ":")))
    if options.timeline:
        render_timeline(trace, options.timeline, title=f"{graph.schedule}: measured step", step=None)
