"""The executor: one trio task per lane, each op awaiting its dependencies.

One nursery per step. A lane takes its ops in graph order; an op waits for
the completion of every op it depends on, then launches:

* compute ops run in a worker thread (``trio.to_thread``), one lane one
  thread at a time, so the event loop stays free to issue collectives and
  I/O, which then really overlap with compute; a run of ops that are
  already ready goes over in one hand-off, and each op's completion is
  posted back at once, which keeps the executor's cost per op low;
* collectives are issued with ``async_op=True``; the lane moves on to its
  next op at once and a watcher task marks the op done when the work
  completes (waiting in a thread, so the loop never blocks);
* copies and NVMe transfers run in their lane's worker thread;
* frees are bookkeeping and run with their lane's other ops.

An op may also wait for an input from outside the graph (``gates``: the Python API's
user thread hands over a micro-batch and the gradient of its output this way); its lane
waits for it as for a dependency, and the other lanes go on meanwhile.

A failing op cancels the step's nursery; the error names the rank, the op
and the unit. Each collective issued and each op finished is written to the
rank's progress board (``runtime/proc/board.py``: two stores into a mapped
file), so the launcher can tell a rank that stopped from one that waits. On CUDA each lane's thread issues its
kernels on the lane's
own stream (see ``runtime/exec/streams.py``); completion is observed through the
stream's event, so the host waits only where a host-side op needs a result.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import trio

if sys.version_info < (3, 11):      # trio's own dependency backports it
    from exceptiongroup import BaseExceptionGroup

from zdsl.ir import LANES, Op, TaskGraph
from zdsl.runtime.exec.contract import OpState
from zdsl.runtime.exec.errors import OpError
from zdsl.runtime.proc.board import FIRST_LANE, ISSUED, LAST_DONE, LAST_ISSUED
from zdsl.runtime.proc.faults import fault_for


@dataclass
class OpTiming:
    """Start and end of one op, seconds since the step began: host times, except for ops on a
    CUDA lane's stream, whose device times replace them (runtime/exec/streams.py)."""
    op: int
    start: float
    end: float


@dataclass
class StepRecord:
    seconds: float
    timings: list[OpTiming] = field(default_factory=list)


class Executor:
    """Runs a :class:`TaskGraph` step after step against a rank's state.

    ``state`` is anything that satisfies :class:`OpState` (``runtime/exec/contract.py``):
    the real one is ``runtime/state/rank.py``'s ``RankState``.
    """

    def __init__(self, graph: TaskGraph, state: OpState, rank: int, record: bool = True, streams=None,
                 board=None, gates=None):
        """``gates``: {op id: async callable} awaited after the op's dependencies and before it
        starts, every step: an input that comes from outside the graph."""
        self.graph = graph
        self.gates = dict(gates or {})
        self.board = board                # runtime.launch's progress board (int64 slots), or None
        self.streams = streams            # runtime.streams.LaneStreams on CUDA, else None
        self.state = state
        self.rank = rank
        self.record = record
        self.lanes: dict[str, list[Op]] = {}
        for op in graph.ops:
            self.lanes.setdefault(op.lane, []).append(op)
        # one worker thread per lane (a lane is sequential by definition)
        self.limiters = {lane: trio.CapacityLimiter(1) for lane in self.lanes}
        # the board's slot for the op a lane's thread runs
        self.lane_slot = {lane: FIRST_LANE + LANES.index(lane) if board is not None else None
                          for lane in self.lanes}
        self.wait_limiter = trio.CapacityLimiter(64)
        self.fault = fault_for(rank)
        self.step = -1

    async def run_step(self) -> StepRecord:
        """Run one step of the graph; returns its time (and op times when recording)."""
        self.begin_step()
        return await self.run_begun()

    def begin_step(self) -> None:
        """Make the step's completion events (``done``), so that a caller may wait for an op of
        the step before :meth:`run_begun` starts it; call from the trio thread."""
        n = len(self.graph.ops)
        self.done = [trio.Event() for _ in range(n)]
        self.starts = [0.0] * n
        self.ends = [0.0] * n
        self.flags = [False] * n          # read by lane threads: which ops are complete
        self.token = trio.lowlevel.current_trio_token()
        self.t0 = time.perf_counter()
        self.step += 1

    async def run_begun(self) -> StepRecord:
        """Run the step :meth:`begin_step` prepared."""
        n = len(self.graph.ops)
        if self.streams is not None:
            self.streams.begin_step()
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                for lane, ops in self.lanes.items():
                    nursery.start_soon(self.run_lane, lane, ops)
        except BaseExceptionGroup as group:
            raise first_op_error(group) from None
        seconds = time.perf_counter() - self.t0
        if self.streams is not None and self.record:
            for i, (start, end) in self.streams.device_times().items():   # when it ran, not when it was queued
                self.starts[i], self.ends[i] = start, end
            seconds = max(seconds, max(self.ends, default=0.0))
        elif self.streams is not None:
            self.streams.end_step()       # the step's results are read next: wait for the device
        timings = [OpTiming(i, self.starts[i], self.ends[i]) for i in range(n)] if self.record else []
        return StepRecord(seconds, timings)

    async def run_lane(self, lane: str, ops: list[Op]) -> None:
        done, state = self.done, self.state
        limiter = self.limiters[lane]
        i = 0
        while i < len(ops):
            op = ops[i]
            for d in op.deps:
                if not done[d].is_set():
                    await done[d].wait()
            gate = self.gates.get(op.id)
            if gate is not None:
                await gate()
            if op.kind.startswith("comm."):
                tick = time.perf_counter()
                self.starts[op.id] = tick - self.t0
                try:
                    self.check_fault(op)
                    if self.streams is None:
                        handle = state.start_collective(op)
                    else:
                        with self.streams.ordered(op):
                            handle = state.start_collective(op)
                except Exception as exc:
                    raise OpError(self.rank, op, exc) from exc
                if self.board is not None:     # only this thread issues: the count stays exact
                    self.board[ISSUED] += 1
                    self.board[LAST_ISSUED] = op.id
                self.nursery.start_soon(self.watch, op, handle)
                i += 1
            elif op.kind == "mem.free" and lane == "comm":
                self.starts[op.id] = time.perf_counter() - self.t0
                self.run_one(op)
                self.finish(op)
                i += 1
            else:
                # a run of ops whose deps are met goes to the lane's thread in one hand-off
                i += await trio.to_thread.run_sync(self.run_batch, ops, i, self.lane_slot[lane], limiter=limiter)

    def run_batch(self, ops: list[Op], i: int, slot: int | None = None) -> int:
        """In the lane's worker thread: run ops[i] and the following ops that are ready.

        Each op's completion is posted to the event loop at once (without
        waiting for it), so other lanes wake as soon as their input exists.
        """
        post = self.token.run_sync_soon
        board = self.board
        n = 0
        while i + n < len(ops):
            op = ops[i + n]
            if n and (op.kind.startswith("comm.") or op.id in self.gates
                      or not all(self.flags[d] for d in op.deps)):
                break
            self.starts[op.id] = time.perf_counter() - self.t0
            if slot is not None:
                board[slot] = op.id
            self.run_one(op)
            self.ends[op.id] = time.perf_counter() - self.t0
            self.flags[op.id] = True
            post(self.done[op.id].set)
            if slot is not None:
                board[slot] = -1
                board[LAST_DONE] = op.id
            n += 1
        return n

    def run_one(self, op: Op) -> None:
        if self.streams is None:
            self._run_one(op)
        else:
            with self.streams.ordered(op):
                self._run_one(op)

    def _run_one(self, op: Op) -> None:
        kind = op.kind
        try:
            self.check_fault(op)
            if kind.startswith("compute."):
                self.state.run_compute(op)
            elif kind.startswith("copy."):
                self.state.run_copy(op)
            elif kind.startswith("nvme."):
                self.state.run_nvme(op)
            elif kind == "mem.free":
                self.state.free(op)
            else:
                raise ValueError(f"unknown op kind {kind!r}")
        except Exception as exc:  # name the rank, the op and the unit
            raise OpError(self.rank, op, exc) from exc

    def post(self, fn) -> None:
        """Run ``fn`` on the event loop, from any thread; a step already over needs nothing."""
        try:
            self.token.run_sync_soon(fn)
        except trio.RunFinishedError:
            pass

    def check_fault(self, op: Op) -> None:
        if self.fault is not None and self.fault.op == op.id and self.fault.step == self.step:
            self.fault.fire()

    async def watch(self, op: Op, handle) -> None:
        """Mark a collective done when its work completes."""
        try:
            if self.streams is not None:
                # NCCL: wait() only makes the lane's stream wait for the collective; the host goes on
                def wait_on_stream():
                    with self.streams.on_lane(op):
                        handle.wait()
                        self.streams.record(op)
                await trio.to_thread.run_sync(wait_on_stream, limiter=self.wait_limiter, abandon_on_cancel=True)
            elif handle is not None and not handle.is_completed():
                future = completion_future(handle)
                if future is not None:
                    # the work's own completion callback wakes the loop: no thread, no extra hop
                    ready = trio.Event()
                    future.add_done_callback(lambda _: self.post(ready.set))
                    await ready.wait()
                    handle.wait()          # complete now: finishes the op, raises the work's error
                else:
                    await trio.to_thread.run_sync(handle.wait, limiter=self.wait_limiter,
                                                  abandon_on_cancel=True)
        except Exception as exc:
            raise OpError(self.rank, op, exc) from exc
        self.finish(op)

    def finish(self, op: Op) -> None:
        self.ends[op.id] = time.perf_counter() - self.t0
        self.flags[op.id] = True
        self.done[op.id].set()
        if self.board is not None:
            self.board[LAST_DONE] = op.id


def completion_future(handle):
    """The torch future of a collective's work, where its backend offers one (gloo's reduce-scatter
    does not: its work raises "getFuture not implemented")."""
    getter = getattr(getattr(handle, "work", None), "get_future", None)
    if getter is None:
        return None
    try:
        return getter()
    except RuntimeError:
        return None


def first_op_error(group: BaseExceptionGroup) -> BaseException:
    """The OpError inside a (nested) exception group, else the first exception."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return first_op_error(exc)
        return exc
    return group
