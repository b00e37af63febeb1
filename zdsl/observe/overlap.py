"""How well a step overlapped: lane busy shares, critical path, overlap efficiency.

A step of a task graph cannot finish sooner than either of two bounds:

* the **busiest serial lane**: ops within a lane that runs one op at a time
  run one after another, so the step takes at least the sum of that lane's
  op times (its own times: a wait in the lane's queue is not work). A lane
  whose backend runs several ops at once (gloo's collective threads,
  ``comm_slots`` > 1) bounds nothing by its busy time: its ops could have
  overlapped more than they did;
* the **dependency chain**: the longest chain of ops linked by ``deps``
  (cross-lane data dependencies), as if every op had a lane of its own.

``lower bound = max(busiest serial lane, dependency chain)`` and
``overlap efficiency = lower bound / step time``. Both terms are paths of
the critical path's graph, so for measured times
``dependency chain <= lower bound <= critical path <= step time``: a lower
bound never exceeds the step it bounds. An efficiency of 1 means the
schedule is as overlapped as the op times allow; lower values say how much
time went to waiting that no reordering of the given lanes' work explains
away.

The **critical path** is the longest path through deps *and* lane order
(each op waits for the op before it in its lane), weighted by op durations
(an op issued before its lane's previous op ended, like an asynchronous
collective queued behind another, counts only from that end):
the chain that set the step time if every op started as soon as its
predecessors ended. ``step time - critical path`` is therefore time the
runtime lost between ops (dispatch, polling, thread hand-offs).

Op times are ``(start, end)`` pairs in seconds, from a measured trace
(:func:`times_from_trace`) or the planner's simulation. Pure Python, linear
in ops plus deps: 50k ops take well under a second.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from zdsl.ir import Op, TaskGraph
from zdsl.sim.graph_index import topological_order
from zdsl.sim.lanes import BackendThreads, comm_slots, union_length

Times = Mapping[int, tuple[float, float]]


@dataclass
class OverlapReport:
    """The figures of one rank's step (seconds unless said otherwise)."""
    step_time: float                       # last end - first start over the graph's ops
    lane_busy: dict[str, float]            # lane -> time with an op running (union of intervals)
    lane_share: dict[str, float]           # lane -> busy / step time
    busiest_lane: str                      # by busy time (a lane of several threads included)
    dep_chain: float                       # longest chain through deps only
    critical_length: float                 # longest chain through deps + lane order
    critical_path: list[int]               # op ids along it, first to last
    critical_by_kind: dict[str, float]     # op kind -> seconds on the critical path
    lower_bound: float                     # max(busiest serial lane's own op time, dep_chain)
    efficiency: float                      # lower_bound / step_time (1.0 for an empty step)
    rank: int | None = None
    ops: int = 0
    notes: list[str] = field(default_factory=list)
    bound_by: str = "dependency chain"     # what sets lower_bound: "lane NAME" or "dependency chain"

    def to_metrics(self) -> dict:
        """Plain JSON for ``--metrics`` (the path as a count and its kinds, not 50k ids)."""
        return {
            "rank": self.rank,
            "step_time_s": self.step_time,
            "lane_busy_s": dict(self.lane_busy),
            "lane_share": dict(self.lane_share),
            "busiest_lane": self.busiest_lane,
            "dependency_chain_s": self.dep_chain,
            "critical_path_s": self.critical_length,
            "critical_path_ops": len(self.critical_path),
            "critical_path_by_kind_s": dict(self.critical_by_kind),
            "lower_bound_s": self.lower_bound,
            "overlap_efficiency": self.efficiency,
        }

    def format(self, graph: TaskGraph | None = None, show_path: int = 8) -> str:
        """A short text report for the end of a run."""
        ms = lambda s: f"{s * 1e3:9.2f} ms"  # noqa: E731
        who = "" if self.rank is None else f" (rank {self.rank})"
        lines = [
            f"overlap{who}: step {ms(self.step_time).strip()}, "
            f"efficiency {self.efficiency:.2f} (lower bound {ms(self.lower_bound).strip()}, set by {self.bound_by})",
            "  lane busy:",
        ]
        for lane, busy in sorted(self.lane_busy.items(), key=lambda kv: -kv[1]):
            bar = "#" * round(20 * min(1.0, self.lane_share[lane]))
            lines.append(f"    {lane:<8}{ms(busy)}  {self.lane_share[lane]:6.1%}  {bar}")
        lines.append(f"  dependency chain {ms(self.dep_chain).strip()}; critical path (deps + lane order) "
                     f"{ms(self.critical_length).strip()} over {len(self.critical_path)} ops; "
                     f"time between ops {ms(max(0.0, self.step_time - self.critical_length)).strip()}")
        kinds = [(k, v) for k, v in sorted(self.critical_by_kind.items(), key=lambda kv: -kv[1]) if v > 0]
        if kinds:
            lines.append("  critical path by kind: " + ", ".join(
                f"{k} {v * 1e3:.2f} ms" for k, v in kinds[:6]) + (", ..." if len(kinds) > 6 else ""))
        if graph is not None and self.critical_path and show_path:
            by_id = {op.id: op for op in graph.ops}
            steps = [by_id[i] for i in self.critical_path if by_id[i].kind != "mem.free"]
            half = max(1, show_path // 2)
            shown: list[Op | None] = [*steps] if len(steps) <= show_path else [*steps[:half], None, *steps[-half:]]
            lines.append("  path: " + " -> ".join(
                "..." if op is None else (f"{op.kind}[{op.unit}]" if op.unit is not None else op.kind)
                for op in shown))
        lines.extend("  note: " + n for n in self.notes)
        return "\n".join(lines)


def _ordered(order: list[int] | int) -> list[int]:
    if isinstance(order, int):           # a position on a cycle
        raise ValueError("the task graph has a dependency cycle; no critical path exists")
    return order


def _longest_path(order: list[int], preds: Sequence[Sequence[int]],
                  dur: Sequence[float]) -> tuple[float, list[int]]:
    """Longest duration-weighted path in a DAG; returns its length and op ids."""
    n = len(dur)
    finish = [0.0] * n
    best_pred = [-1] * n
    for i in order:
        start, bp = 0.0, -1
        for p in preds[i]:
            if finish[p] > start:
                start, bp = finish[p], p
        finish[i] = start + dur[i]
        best_pred[i] = bp
    if n == 0:
        return 0.0, []
    last = max(range(n), key=finish.__getitem__)
    path = []
    while last >= 0:
        path.append(last)
        last = best_pred[last]
    path.reverse()
    return finish[path[-1]] if path else 0.0, path


def analyze(graph: TaskGraph, times: Times | Sequence[tuple[float, float] | None],
            rank: int | None = None, step_time: float | None = None) -> OverlapReport:
    """Overlap figures of one step from per-op ``(start, end)`` seconds.

    ``times`` maps op id -> (start, end), or is a list indexed by op id
    (``None`` for ops without a time). Ops without a time count as zero
    length (``mem.free`` often has none). ``step_time`` defaults to the span
    of the given times; pass the measured wall time of the step when the
    runtime spent time outside any op (it should count against efficiency).
    """
    ops = graph.ops
    slots = comm_slots(graph)
    own = _own_times(ops, _time_of(times), slots)
    span = own.last - own.first if own.last >= own.first else 0.0
    step = span if step_time is None else float(step_time)
    dep_preds, lane_preds, lane_gate = _predecessors(ops, own.gate, slots)
    dep_chain, _ = _longest_path(_ordered(topological_order(dep_preds)), dep_preds, own.dur)
    crit_len, crit_path = _longest_path(_ordered(topological_order(dep_preds, lane_gate)), lane_preds, own.dur)
    lane_busy = {lane: union_length(iv) for lane, iv in own.lane_intervals.items()}
    busiest = max(lane_busy, key=lane_busy.__getitem__) if lane_busy else "compute"
    lane_share = {lane: (b / step if step > 0 else 0.0) for lane, b in lane_busy.items()}
    lower, bound_by = _lower_bound(ops, own.dur, slots, dep_chain)
    by_kind: dict[str, float] = {}
    for i in crit_path:
        by_kind[ops[i].kind] = by_kind.get(ops[i].kind, 0.0) + own.dur[i]
    efficiency = min(1.0, lower / step) if step > 0 else 1.0
    return OverlapReport(step_time=step, lane_busy=lane_busy, lane_share=lane_share,
                         busiest_lane=busiest, dep_chain=dep_chain, critical_length=crit_len,
                         critical_path=[ops[i].id for i in crit_path], critical_by_kind=by_kind,
                         lower_bound=lower, efficiency=efficiency, rank=rank, ops=len(ops),
                         notes=own.notes(), bound_by=bound_by)


def _time_of(times: Times | Sequence[tuple[float, float] | None]):
    """Op id -> its (start, end), or None, from either form :func:`analyze` takes."""
    if isinstance(times, Mapping):
        return times.get
    return lambda k: times[k] if 0 <= k < len(times) else None


@dataclass
class _OwnTimes:
    """Each op's own time (the part of it after its lane let it start) and what the lanes held."""
    dur: list[float]                                 # by graph position
    gate: list[int | None]                           # comm ops of k slots: the op whose end freed its slot
    lane_intervals: dict[str, list[tuple[float, float]]]
    first: float = float("inf")                      # the earliest start and latest end of any op
    last: float = float("-inf")
    missing: int = 0                                 # ops other than frees without a time
    queued: int = 0                                  # ops issued before their lane could start them

    def notes(self) -> list[str]:
        notes = []
        if self.missing:
            notes.append(f"{self.missing} ops had no time and counted as zero length")
        if self.queued:
            notes.append(f"{self.queued} ops were issued before the previous op of their lane ended; "
                         f"their time in the queue is not counted as theirs")
        return notes


def _own_times(ops: Sequence, get, slots: int) -> _OwnTimes:
    """Each op's own time from ``get`` (op id -> (start, end) or None); ``slots``: the comm lane's."""
    n = len(ops)
    own = _OwnTimes(dur=[0.0] * n, gate=[None] * n, lane_intervals={})
    lane_end: dict[str, float] = {}
    held: dict[str, BackendThreads] = {}            # a lane that runs k ops at once
    for i, op in enumerate(ops):
        t = get(op.id)
        own.lane_intervals.setdefault(op.lane, [])
        if t is None:
            if op.kind != "mem.free":
                own.missing += 1
            continue
        s, e = float(t[0]), float(t[1])
        if e < s:
            raise ValueError(f"op {op.id} ({op.kind}) ends before it starts: {s} > {e}")
        # An op issued while the one before it in its lane is still running (an async
        # collective) waits in the lane's queue: only the time after that op ends is its own.
        # Where the backend runs k collectives at once (gloo's threads), it waits only while k
        # issued before it are still running: until the k-th latest end.
        k = slots if op.lane == "comm" else 1
        if k == 1:
            own_start = max(s, lane_end.get(op.lane, s))
        else:
            own_start, own.gate[i] = held.setdefault(op.lane, BackendThreads(k)).take(s, e, i)
        if own_start > s:
            own.queued += 1
        own.dur[i] = max(0.0, e - own_start)
        lane_end[op.lane] = max(lane_end.get(op.lane, e), e)
        own.lane_intervals[op.lane].append((s, e))
        own.first, own.last = min(own.first, s), max(own.last, e)
    return own


def _predecessors(ops: Sequence, gate: list[int | None], slots: int):
    """By graph position: the deps (data), the deps and the previous op of the same lane (for a comm
    lane of several slots, the op that freed its slot: ``gate``), and that one lane predecessor (-1: none)."""
    index = {op.id: i for i, op in enumerate(ops)}
    dep_preds: list[list[int]] = []
    for op in ops:
        try:
            dep_preds.append([index[d] for d in op.deps])
        except KeyError as e:
            raise ValueError(f"op {op.id} ({op.kind}) depends on unknown op {e.args[0]}") from None
    lane_preds: list[list[int]] = []
    lane_gate: list[int] = []
    prev_in_lane: dict[str, int] = {}
    for i, op in enumerate(ops):
        p = prev_in_lane.get(op.lane) if not (slots > 1 and op.lane == "comm") else gate[i]
        lane_preds.append(dep_preds[i] + [p] if p is not None else dep_preds[i])
        lane_gate.append(-1 if p is None else p)
        prev_in_lane[op.lane] = i
    return dep_preds, lane_preds, lane_gate


def _lower_bound(ops: Sequence, dur: list[float], slots: int, dep_chain: float) -> tuple[float, str]:
    """The step's lower bound and what sets it: the busiest serial lane's own op times, or the
    dependency chain. A serial lane's own op times all lie on one path of the critical path's graph
    (lane order), so their sum never exceeds the critical path; a lane of several threads is left out."""
    serial_work: dict[str, float] = {}
    for i, op in enumerate(ops):
        if not (slots > 1 and op.lane == "comm"):
            serial_work[op.lane] = serial_work.get(op.lane, 0.0) + dur[i]
    bound_lane = max(serial_work, key=serial_work.__getitem__) if serial_work else None
    if bound_lane is not None and serial_work[bound_lane] > dep_chain:
        return serial_work[bound_lane], "lane " + bound_lane
    return dep_chain, "dependency chain"


def typical(reports: Iterable[OverlapReport]) -> OverlapReport | None:
    """The report of the median step (by step time): what a run summary should show,
    unaffected by a slow first step or one hiccup."""
    ordered = sorted(reports, key=lambda r: r.step_time)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def summarize(reports: Iterable[OverlapReport]) -> dict:
    """All ranks together: the step is as slow as its slowest rank.

    efficiency = max lower bound / max step time, lane shares from the
    slowest rank (the one the user should look at).
    """
    reports = list(reports)
    if not reports:
        return {}
    slow = max(reports, key=lambda r: r.step_time)
    step = slow.step_time
    lower = max(r.lower_bound for r in reports)
    return {
        "ranks": len(reports),
        "step_time_s": step,
        "lower_bound_s": lower,
        "overlap_efficiency": min(1.0, lower / step) if step > 0 else 1.0,
        "slowest_rank": slow.rank,
        "per_rank": [r.to_metrics() for r in reports],
    }


def times_from_trace(trace: dict | list, rank: int = 0, step: int | None = None
                     ) -> dict[int, tuple[float, float]]:
    """Op id -> (start, end) seconds from a Chrome trace (``zdsl run --trace``).

    Uses "X" events of ``pid == rank`` whose ``args.op`` holds the op id.
    When events carry ``args.step``, takes ``step`` (default: the last one).
    Times are relative to the first op of that step.
    """
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else list(trace)
    mine = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
            and e.get("pid", 0) == rank and isinstance(e.get("args"), dict)
            and isinstance(e["args"].get("op"), int)]
    steps = {e["args"]["step"] for e in mine if "step" in e["args"]}
    if steps:
        want = max(steps) if step is None else step
        mine = [e for e in mine if e["args"].get("step") == want]
    if not mine:
        return {}
    t0 = min(float(e["ts"]) for e in mine)
    return {e["args"]["op"]: ((float(e["ts"]) - t0) * 1e-6,
                              (float(e["ts"]) + float(e.get("dur", 0.0)) - t0) * 1e-6)
            for e in mine}
