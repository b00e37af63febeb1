"""CUDA lanes: one stream per lane, cross-lane order through CUDA events.

On a CUDA device an op "completes" for the executor when its kernels are
enqueued on its lane's stream; what orders it after its dependencies is the
stream waiting on their events, not the host. The host waits (an event's
``synchronize``) only where a host-side op needs a device result: the host
step, NVMe writes, and anything else on a host lane. Frees wait on their
readers' events on the producing lane's stream, so the caching allocator
reuses a block only after every stream that read it is done with it (the
block belongs to the stream that allocated it).

On the CPU none of this exists: :func:`lane_streams` returns None and the
executor runs ops directly.

Unmeasured here: this path has no test on this project's CI machines (no
GPU); see the closing notes of the runtime issue.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zdsl.ir import Op, TaskGraph

HOST_LANES = ("host", "nvme")


class LaneStreams:
    def __init__(self, graph: TaskGraph, device: torch.device):
        lanes = sorted({op.lane for op in graph.ops})
        self.device = device
        self.streams = {lane: torch.cuda.Stream(device=device) for lane in lanes if lane not in HOST_LANES}
        self.lane_of = [op.lane for op in graph.ops]
        self.events: list[torch.cuda.Event | None] = [None] * len(graph.ops)

    def begin_step(self) -> None:
        self.events = [None] * len(self.events)

    @contextmanager
    def ordered(self, op: Op):
        """Run ``op``'s body after its dependencies (stream waits, or host waits on host lanes)."""
        stream = self.streams.get(op.lane)
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
            yield
            self.record(op)

    def record(self, op: Op) -> None:
        stream = self.streams.get(op.lane)
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self.events[op.id] = event

    @contextmanager
    def on_lane(self, op: Op):
        """The op's stream as the current stream (a collective's wait in a watcher thread)."""
        stream = self.streams.get(op.lane)
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield


def lane_streams(graph: TaskGraph, device: torch.device) -> LaneStreams | None:
    return LaneStreams(graph, device) if device.type == "cuda" else None
