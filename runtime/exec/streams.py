"""CUDA lanes: one stream per lane, cross-lane order through CUDA events.

On a CUDA device an op "completes" for the executor when its kernels are
enqueued on its lane's stream; what orders it after its dependencies is the
stream waiting on their events, not the host. The host waits (an event's
``synchronize``) only where host code needs a device result or touches host
memory a copy may still be using: every op on a host lane (the host step, NVMe
reads and writes), and an op on a device lane whose body reads or writes a host
buffer on the CPU (:func:`host_side_ops`). Copies between a pinned host buffer
and the device are asynchronous (``runtime/state/transfers.py``), so a host
buffer is written or read by the copy engine in stream order: its host readers
and writers wait for the copy's event through their graph dependency on it (the
graph orders every read after the last write and every write after the reads
since, ``zdsl/compile/instantiate.py``), and a freed pinned block is not reused
before the copies using it are done (torch's pinned host allocator records an
event on the copy's stream). A free waits on its readers' events on its own
lane's stream, and records that stream on the tensors it releases
(``Tensor.record_stream``, ``runtime/state/buffers.py``): the caching allocator
gives a block back to the pool of the stream that allocated it, which may be
another lane's, and reuses it only after the freeing stream has passed the free.

What the step's caller queued on the current (default) stream before the step
(zeroing persistent gradients, the micro-batches' copies, a resume's loads) is
waited for by every lane stream at ``begin_step``; ``end_step`` waits for the
device, so the losses and metrics read after the step are complete. Lane and
watcher threads make the rank's device current before touching a stream.

Op times on the device (``timing=True``, when the executor records the step):
every op on a lane's stream is bracketed by two timing events (its start is
recorded after its stream waits for its dependencies, its end after its kernels,
or for a collective after the stream waited for it), read after the step as
seconds from an origin event recorded when the step began
(:meth:`LaneStreams.device_times`). The executor puts these in the step's
timings (``--trace``, the overlap report) in place of the host's enqueue times,
which on CUDA say when work was queued, not when it ran. Ops on host lanes keep
host times. Untimed (``timing=False``, e.g. evaluation) the events only order,
and are made without timing, which CUDA records more cheaply.

Under ``TORCH_CUDA_SANITIZER=1`` torch's race detector is a dispatch mode, and dispatch modes are
per thread: enabled at import in the main thread, it would see none of the lanes' kernels. Each op's
body (and each collective's wait) runs with the sanitizer's mode pushed on its thread
(:func:`sanitizer_joined`), so it checks every lane.

``ZDSL_ONE_STREAM=1`` (a diagnostic) puts every device lane on one stream: the
same ops in the same order without overlap, to hold an overlapped run against.

On the CPU none of this exists: :func:`lane_streams` returns None and the
executor runs ops directly.

Unmeasured here: this path has no test on this project's CI machines (no
GPU); see the closing notes of the runtime issue.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from zdsl import env
from zdsl.ir import Op, TaskGraph

HOST_LANES = ("host", "nvme")


def host_side_ops(graph: TaskGraph) -> list[bool]:
    """Per op: on a device lane, and its body reads or writes a host buffer on the CPU (so the host
    must wait for its dependencies' events, not only its stream). A copy's host buffer is the copy
    engine's, in stream order, except a device-to-host copy that accumulates (it adds on the CPU);
    a free touches no memory."""
    out = []
    for op in graph.ops:
        engine = op.kind == "copy.h2d" or (op.kind == "copy.d2h" and not op.accumulate)
        touches = any(graph.buffers[n].tier == "host" for n in (*op.reads, *op.writes) if n in graph.buffers)
        out.append(op.lane not in HOST_LANES and op.kind != "mem.free" and not engine and touches)
    return out


@contextmanager
def sanitizer_joined():
    """This thread's ops seen by torch's CUDA sanitizer when it is on (``TORCH_CUDA_SANITIZER``):
    its dispatch mode pushed for the body where the thread lacks it; nothing otherwise."""
    csan = sys.modules.get("torch.cuda._sanitizer")
    mode = csan.cuda_sanitizer.dispatch if csan is not None and csan.cuda_sanitizer.enabled else None
    if mode is None or any(m is mode for m in _get_current_dispatch_mode_stack()):
        yield
        return
    _push_mode(mode)
    try:
        yield
    finally:
        _pop_mode()


class LaneStreams:
    """The executor's seam to CUDA streams (``Executor(streams=...)``); a CPU checker implements the
    same methods. Contract, per method:

    * ``begin_step()``: before a step's first op; every lane is ordered after the work the caller
      queued on the current stream.
    * ``ordered(op)``: a context the op's body runs in, after its dependencies (on a device lane:
      its stream waits for their events, and for a host-side op the host does too; on a host lane
      the host waits), with the lane's stream current; leaving it records the op's end.
    * ``on_lane(op)``: the op's stream current (a collective's wait in a watcher thread), no waits.
    * ``record(op)``: mark the op's end on its lane's stream now (a collective after its wait).
    * ``device_times()``: ``{op: (start, end)}`` seconds on the device; only with ``timing``.
    * ``end_step()``: the device is done with the step (untimed steps).
    """

    def __init__(self, graph: TaskGraph, device: torch.device, timing: bool = True):
        lanes = sorted({op.lane for op in graph.ops})
        # an index, so that worker threads can make this device current (``cuda`` alone: the current one)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.timing = timing
        device_lanes = [lane for lane in lanes if lane not in HOST_LANES]
        if env.flag("ZDSL_ONE_STREAM"):
            shared = torch.cuda.Stream(device=self.device)
            self.streams = {lane: shared for lane in device_lanes}
        else:
            self.streams = {lane: torch.cuda.Stream(device=self.device) for lane in device_lanes}
        self.lane_of = [op.lane for op in graph.ops]
        self.host_side = host_side_ops(graph)
        self.events: list[torch.cuda.Event | None] = [None] * len(graph.ops)   # each op's end
        self.begins: list[torch.cuda.Event | None] = [None] * len(graph.ops)
        self.origin: torch.cuda.Event | None = None

    def _event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=self.timing)

    def begin_step(self) -> None:
        self.events = [None] * len(self.events)
        self.begins = [None] * len(self.begins)
        self.origin = self._event()
        self.origin.record(torch.cuda.current_stream(self.device))
        for stream in set(self.streams.values()):   # the caller's work queued before the step
            stream.wait_event(self.origin)

    def end_step(self) -> None:
        """Wait for the device: every lane's work of the step is done (untimed steps too)."""
        torch.cuda.synchronize(self.device)

    def device_times(self) -> dict[int, tuple[float, float]]:
        """{op: (start, end)} on the device, seconds from the step's origin, for every op that
        ran on a lane's stream. Waits for the device (the step's end already does). Only for
        streams made with ``timing=True``."""
        if not self.timing:
            raise RuntimeError("device_times: these lane streams were made without timing events")
        if self.origin is None:
            raise RuntimeError("device_times: no step began on these lane streams")
        torch.cuda.synchronize(self.device)
        out = {}
        for i, (begin, end) in enumerate(zip(self.begins, self.events)):
            if begin is not None and end is not None:
                out[i] = (self.origin.elapsed_time(begin) / 1e3, self.origin.elapsed_time(end) / 1e3)
        return out

    @contextmanager
    def ordered(self, op: Op):
        """Run ``op``'s body after its dependencies (stream waits, or host waits on host lanes and
        for host-side ops)."""
        stream = self.streams.get(op.lane)
        torch.cuda.set_device(self.device)   # lane threads start on device 0
        host_waits = stream is None or self.host_side[op.id]
        for d in op.deps:
            event = self.events[d]
            if event is None:
                continue
            if host_waits:
                event.synchronize()          # host code needs the device result (or the copy done) now
            elif stream is not None and (self.lane_of[d] != op.lane or op.kind == "mem.free"):
                stream.wait_event(event)
        if stream is None:
            with sanitizer_joined():
                yield
            return
        with torch.cuda.stream(stream), sanitizer_joined():
            if self.timing:
                begin = self._event()
                begin.record(stream)
                self.begins[op.id] = begin
            yield
            self.record(op)

    def record(self, op: Op) -> None:
        stream = self.streams.get(op.lane)
        if stream is not None:
            event = self._event()
            event.record(stream)
            self.events[op.id] = event

    @contextmanager
    def on_lane(self, op: Op):
        """The op's stream as the current stream (a collective's wait in a watcher thread)."""
        stream = self.streams.get(op.lane)
        torch.cuda.set_device(self.device)   # watcher threads start on device 0
        with sanitizer_joined():
            if stream is None:
                yield
            else:
                with torch.cuda.stream(stream):
                    yield


def lane_streams(graph: TaskGraph, device: torch.device, timing: bool = True) -> LaneStreams | None:
    """The rank's lane streams on CUDA (``timing``: device times will be read), else None."""
    return LaneStreams(graph, device, timing) if device.type == "cuda" else None
