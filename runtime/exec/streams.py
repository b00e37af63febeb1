"""CUDA lanes: one stream per lane, cross-lane order through CUDA events.

On a CUDA device an op "completes" for the executor when its kernels are
enqueued on its lane's stream; what orders it after its dependencies is the
stream waiting on their events, not the host. The host waits (an event's
``synchronize``) only where a host-side op needs a device result: the host
step, NVMe writes, and anything else on a host lane. A free waits on its
readers' events on its own lane's stream, and records that stream on the
tensors it releases (``Tensor.record_stream``, ``runtime/state/buffers.py``):
the caching allocator gives a block back to the pool of the stream that
allocated it, which may be another lane's, and reuses it only after the
freeing stream has passed the free.

What the step's caller queued on the current (default) stream before the step
(zeroing persistent gradients, the micro-batches' copies, a resume's loads) is
waited for by every lane stream at ``begin_step``; ``end_step`` waits for the
device, so the losses and metrics read after the step are complete. Lane and
watcher threads make the rank's device current before touching a stream.

Op times on the device: every op on a lane's stream is bracketed by two
timing events (its start is recorded after its stream waits for its
dependencies, its end after its kernels, or for a collective after the
stream waited for it), read after the step as seconds from an origin event
recorded when the step began (:meth:`LaneStreams.device_times`). The
executor puts these in the step's timings (``--trace``, the overlap
report) in place of the host's enqueue times, which on CUDA say when work
was queued, not when it ran. Ops on host lanes keep host times.

On the CPU none of this exists: :func:`lane_streams` returns None and the
executor runs ops directly.

Unmeasured here: this path has no test on this project's CI machines (no
GPU); see the closing notes of the runtime issue.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zdsl.ir import Op

from zdsl.ir import TaskGraph

HOST_LANES = ("host", "nvme")


class LaneStreams:
    def __init__(self, graph: TaskGraph, device: torch.device):
        lanes = sorted({op.lane for op in graph.ops})
        # an index, so that worker threads can make this device current (``cuda`` alone: the current one)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.streams = {lane: torch.cuda.Stream(device=device) for lane in lanes if lane not in HOST_LANES}
        self.lane_of = [op.lane for op in graph.ops]
        self.events: list[torch.cuda.Event | None] = [None] * len(graph.ops)   # each op's end
        self.begins: list[torch.cuda.Event | None] = [None] * len(graph.ops)
        self.origin: torch.cuda.Event | None = None

    def begin_step(self) -> None:
        self.events = [None] * len(self.events)
        self.begins = [None] * len(self.begins)
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record(torch.cuda.current_stream(self.device))
        for stream in self.streams.values():   # the caller's work queued before the step
            stream.wait_event(self.origin)

    def end_step(self) -> None:
        """Wait for the device: every lane's work of the step is done (untraced steps too)."""
        torch.cuda.synchronize(self.device)

    def device_times(self) -> dict[int, tuple[float, float]]:
        """{op: (start, end)} on the device, seconds from the step's origin, for every op that
        ran on a lane's stream. Waits for the device (the step's end already does)."""
        torch.cuda.synchronize(self.device)
        out = {}
        for i, (begin, end) in enumerate(zip(self.begins, self.events)):
            if begin is not None and end is not None:
                out[i] = (self.origin.elapsed_time(begin) / 1e3, self.origin.elapsed_time(end) / 1e3)
        return out

    @contextmanager
    def ordered(self, op: Op):
        """Run ``op``'s body after its dependencies (stream waits, or host waits on host lanes)."""
        stream = self.streams.get(op.lane)
        torch.cuda.set_device(self.device)   # lane threads start on device 0
        for d in op.deps:
            event = self.events[d]
            if event is None:
                continue
            if stream is None:
                event.synchronize()          # a host-side op needs the device result now
            elif self.lane_of[d] != op.lane or op.kind == "mem.free":
                stream.wait_event(event)
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            self.begins[op.id] = begin
            yield
            self.record(op)

    def record(self, op: Op) -> None:
        stream = self.streams.get(op.lane)
        if stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            self.events[op.id] = event

    @contextmanager
    def on_lane(self, op: Op):
        """The op's stream as the current stream (a collective's wait in a watcher thread)."""
        stream = self.streams.get(op.lane)
        torch.cuda.set_device(self.device)   # watcher threads start on device 0
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield


def lane_streams(graph: TaskGraph, device: torch.device) -> LaneStreams | None:
    return LaneStreams(graph, device) if device.type == "cuda" else None
