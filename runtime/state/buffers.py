"""The buffer table: one slot per buffer the graph names, and its memory on this rank.

A slot is live while it holds data; an op reads only live slots and writing allocates a slot that
is not. Sizes and dtypes come from the unit's flat layout (``flats``) and optimizer (``optims``),
which the rank state fills in unit by unit at start-up. Every allocation and release is booked
on the memory meter. Memory in the CPU's address space that is not pinned (host buffers, and a
CPU rank's device buffers, the flat parameters and gradients included) comes from the host pool
(``host_pool.py``), which keeps a released block for the next buffer of its size instead of
unmapping it, so a step does not page-fault its buffers in again. The table never touches NVMe:
a buffer on that tier is live when the swapper holds it (``runtime/state/transfers.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zdsl.ir import Buffer, Op, TaskGraph
from zdsl.runtime.state.errors import StateError
from zdsl.runtime.state.flat import FlatParam, alloc_storage, can_lend, free_storage, lend_storage, reclaim_storage
from zdsl.runtime.state.host_pool import HostPool, typed
from zdsl.runtime.state.memory import MemoryMeter
from zdsl.runtime.state.optim import UnitOptimizer

ACT_KINDS = ("act", "act_inner", "act_grad")


@dataclass
class ActRecord:
    """What a unit keeps between its forward and its backward."""
    input: torch.Tensor                 # the unit's input (detached; requires grad when floating)
    output: torch.Tensor                # its output (the scaled loss for the last unit)
    micro: int
    nbytes: int = 0
    rng: tuple | None = None            # a recomputed unit's RNG state before its forward


@dataclass
class Slot:
    """One buffer of the graph on this rank."""
    buf: Buffer
    tensor: torch.Tensor | None = None  # flat buffers, act_grad, norm, loss
    record: ActRecord | None = None     # act, act_inner
    live: bool = False
    clean: bool = True                  # grad_full: still all zeros since allocation
    block: torch.Tensor | None = None   # the host pool's block under ``tensor`` (host_pool.py)


class BufferTable:
    """Every buffer of the graph on one rank: look-up, allocation, release, and errors that name
    the rank and the op."""

    def __init__(self, graph: TaskGraph, rank: int, device: torch.device, dtype: torch.dtype,
                 meter: MemoryMeter):
        self.graph, self.rank, self.device, self.dtype, self.meter = graph, rank, device, dtype, meter
        self.host = torch.device("cpu")
        self.slots: dict[str, Slot] = {name: Slot(b) for name, b in graph.buffers.items() if b.kind != "token"}
        self.flats: list[FlatParam] = []          # per unit, filled by the rank state at start-up
        self.optims: list[UnitOptimizer] = []     # per unit, likewise
        self.pool = HostPool()                    # pageable CPU memory, reused step to step

    def error(self, op: Op | None, cause: str) -> StateError:
        where = f"op {op.id} {op.kind}" + (f" unit {op.unit}" if op.unit is not None else "") \
            + (f" micro {op.micro}" if op.micro else "") if op is not None else "setup"
        return StateError(f"rank {self.rank}: {where}: {cause}")

    # -- sizes -------------------------------------------------------------------
    def unit_of(self, buf: Buffer) -> int:
        """The unit a flat buffer (parameters, gradients, optimizer state) belongs to."""
        if buf.unit is None:
            raise StateError(f"rank {self.rank}: {buf.name} belongs to no unit, so it has no flat layout")
        return buf.unit

    def unit_of_op(self, op: Op) -> int:
        """The unit a unit's op (compute, collective, step) names."""
        if op.unit is None:
            raise self.error(op, "names no unit, which a unit's op must")
        return op.unit

    def numel(self, buf: Buffer) -> int:
        unit = self.unit_of(buf)
        lay = self.flats[unit].layout
        if buf.kind == "param_full":
            return lay.padded_numel
        if buf.kind == "param_shard":
            return lay.shard_numel
        if buf.kind == "param_sec":      # hpZ's node-local shard
            return self.flats[unit].secondary_layout().shard_numel
        if buf.kind == "grad_full":      # gradients cover the trainable parts (zdsl/model/layout.py)
            return lay.trainable_numel
        if buf.kind == "grad_shard":
            return lay.trainable_shard_numel
        return self.optims[unit].flat_numel   # optim

    def dtype_of(self, buf: Buffer) -> torch.dtype:
        if buf.kind == "optim" or buf.kind in ("norm", "loss"):
            return torch.float32
        if buf.kind in ("grad_full", "grad_shard"):
            return self.flats[self.unit_of(buf)].grad.dtype
        return self.dtype

    @staticmethod
    def category(buf: Buffer) -> str:
        """The meter's category: the model state a persistent buffer holds, else working memory."""
        return buf.state if buf.persistent and buf.state else "working"

    # -- look-up -----------------------------------------------------------------
    def slot(self, name: str, op: Op | None = None) -> Slot:
        try:
            return self.slots[name]
        except KeyError:
            raise self.error(op, f"buffer {name} is not in the graph") from None

    def read(self, name: str, op: Op) -> Slot:
        slot = self.slot(name, op)
        if not slot.live:
            raise self.error(op, f"reads {name}, which holds no data now (never produced, or freed)")
        return slot

    def read_tensor(self, name: str, op: Op) -> torch.Tensor:
        """The tensor of a live flat or scalar buffer an op reads."""
        slot = self.read(name, op)
        if slot.tensor is None:
            raise self.error(op, f"reads {name} as a tensor, but it holds an activation record")
        return slot.tensor

    def read_record(self, name: str, op: Op) -> ActRecord:
        """The activation record of a live ``act``/``act_inner`` buffer an op reads."""
        slot = self.read(name, op)
        if slot.record is None:
            raise self.error(op, f"reads {name} as an activation record, but it holds a tensor")
        return slot.record

    def write(self, name: str, op: Op) -> torch.Tensor:
        """The tensor an op writes, allocated if the buffer is not live."""
        slot = self.slot(name, op)
        if not slot.live:
            return self.alloc(slot)
        if slot.tensor is None:
            raise self.error(op, f"writes {name}, which holds an activation record, not a tensor")
        return slot.tensor

    def tensor(self, name: str) -> torch.Tensor:
        """The live tensor of a flat or scalar buffer (tests, checkpoints)."""
        slot = self.slots[name]
        if not slot.live or slot.tensor is None:
            raise StateError(f"rank {self.rank}: {name} holds no data now")
        return slot.tensor

    def home(self, kind: str, u: int) -> Slot | None:
        """The persistent buffer of ``kind`` for unit ``u``, on whichever tier it lives."""
        for tier in (None, "host", "nvme"):
            slot = self.slots.get(f"{kind}[{u}]" + (f"@{tier}" if tier else ""))
            if slot is not None and slot.buf.persistent:
                return slot
        return None

    def live_working(self) -> list[str]:
        """Working buffers still held (after a step: none, unless the graph leaks)."""
        return sorted(n for n, s in self.slots.items() if s.live and not s.buf.persistent)

    # -- memory ------------------------------------------------------------------
    def alloc(self, slot: Slot) -> torch.Tensor:
        """Give a flat/scalar buffer memory (zeros for gradients and scalars)."""
        buf = slot.buf
        if buf.tier == "nvme":
            raise StateError(f"rank {self.rank}: {buf.name} lives on nvme; only nvme.read/write touch it")
        dev = self.device if buf.tier == "device" else self.host
        if buf.kind in ("norm", "loss"):
            t = torch.zeros((), dtype=torch.float32, device=dev)
        elif buf.kind in ("param_full", "grad_full") and buf.tier == "device":
            flat = self.flats[self.unit_of(buf)]
            t = flat.full if buf.kind == "param_full" else flat.grad
            if dev.type == "cpu" and can_lend():
                slot.block = self.pool.take(t.numel() * t.element_size())
                lend_storage(t, slot.block)
            else:
                alloc_storage(t)
            if buf.kind == "grad_full":
                t.zero_()
        elif dev.type == "cpu" and not pins_host_memory(buf, self.device):
            numel, dtype = self.numel(buf), self.dtype_of(buf)
            slot.block = self.pool.take(numel * dtype.itemsize)
            t = typed(slot.block, numel, dtype)
            if buf.kind in ("grad_full", "grad_shard"):
                t.zero_()
        else:
            t = torch.empty(self.numel(buf), dtype=self.dtype_of(buf), device=dev,
                            pin_memory=pins_host_memory(buf, self.device))
            if buf.kind in ("grad_full", "grad_shard"):
                t.zero_()
        slot.tensor, slot.live, slot.clean = t, True, True
        self.meter.hold(buf.name, buf.tier, buf.kind, self.category(buf), t.numel() * t.element_size())
        return t

    def release(self, slot: Slot) -> None:
        """Give a buffer's memory back. On CUDA the block returns to the pool of the stream that
        allocated it at once, which is not always the stream of the freeing lane (a ZeRO-1
        gradient shard is allocated by the reduce-scatter on the comm stream and freed on the
        compute stream after the step that reads it): the current stream is recorded on the
        tensors first (``record_stream``), so the allocator reuses the block only after the work
        this stream has queued, which the free waited for, is done."""
        buf = slot.buf
        for t in (slot.tensor, *((slot.record.input, slot.record.output) if slot.record is not None else ())):
            record_current_stream(t)
        if buf.kind in ("param_full", "grad_full") and buf.tier == "device" and slot.tensor is not None:
            # keep the tensor object: autograd's views see the next gather
            if slot.block is not None:
                reclaim_storage(slot.tensor, slot.block)
            else:
                free_storage(slot.tensor)
        else:
            slot.tensor = None
        slot.record = None
        slot.live = False
        self.meter.release(buf.name)
        if slot.block is not None:
            block, slot.block = slot.block, None
            t = None   # the loop's last tensor: the pool counts who still holds the block
            self.pool.give(block)

    def free(self, op: Op) -> None:
        """``mem.free``: release every working buffer the op names."""
        for name in dict.fromkeys(op.writes + op.reads):
            if name == "token":
                continue
            slot = self.slot(name, op)
            if slot.buf.persistent:
                raise self.error(op, f"frees {name}, which is model state (persistent)")
            if slot.live:
                self.release(slot)


def pins_host_memory(buf: Buffer, device: torch.device) -> bool:
    """Page-lock a buffer's memory: a host buffer whose placement did not say ``pinned=false``
    (the graph's ``Buffer.pinned``), on a rank whose device is CUDA (elsewhere pinning buys
    nothing, and needs a CUDA driver)."""
    return buf.tier == "host" and buf.pinned and device.type == "cuda"


def record_current_stream(t: torch.Tensor | None) -> None:
    """Mark a CUDA tensor as used by the current stream (a no-op for the allocating stream itself,
    for host tensors and for storage already released)."""
    if isinstance(t, torch.Tensor) and t.is_cuda and t.untyped_storage().nbytes():
        t.record_stream(torch.cuda.current_stream(t.device))
