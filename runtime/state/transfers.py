"""Copies between tiers (``copy.h2d|d2h``) and NVMe reads and writes (``nvme.read|write``).

A copy between the device and a pinned host buffer is asynchronous: it is queued on the lane's
stream and done when the op's event is (``runtime/exec/streams.py`` makes the host wait for that
event wherever host code uses the buffer next). A pageable host buffer is copied synchronously
(from pageable memory CUDA stages the copy anyway, and an asynchronous copy into it is unsafe).

The NVMe swapper (``runtime/offload/swap.py``) is opened on first use from the schedule's
placement, one folder per rank; :meth:`Transfers.close_swap` removes its files.
"""
from __future__ import annotations

import os

import torch

from zdsl.ir import Op
from zdsl.runtime.state.buffers import BufferTable
from zdsl.runtime.state.buffers import Slot
from zdsl.runtime.state.errors import StateError


class Transfers:
    """Moves buffer contents between the device, the host and NVMe for one rank."""

    def __init__(self, table: BufferTable, config: dict):
        self.table = table
        self.config = config
        self._swapper = None

    @property
    def swapper(self):
        """The NVMe swapper, opened on first use."""
        if self._swapper is None:
            rank = self.table.rank
            places = [p for p in (self.config.get("placement") or {}).values() if p.get("tier") == "nvme"]
            if not places or not places[0].get("path"):
                raise StateError(f"rank {rank}: the graph uses nvme but no nvme folder is configured")
            try:
                from zdsl.runtime.offload.swap import Swapper
            except ImportError as exc:
                raise StateError(f"rank {rank}: the nvme tier is unavailable: {exc}") from None
            p = places[0]
            folder = os.path.join(p["path"], f"rank{rank}")
            # its staging pool is pinned where CUDA is present, unless the placement says pinned=false
            self._swapper = Swapper(folder, p.get("block_bytes", 1 << 20), p.get("queue_depth", 8),
                                    pin=None if p.get("pinned", True) else False)
        return self._swapper

    @property
    def opened_swapper(self):
        """The NVMe swapper if this rank has opened one, else None (never opens one)."""
        return self._swapper

    def close_swap(self) -> None:
        """Remove this rank's NVMe swap files, if it opened any."""
        if self._swapper is not None:
            self._swapper.close()

    # -- whole buffers, wherever they live -----------------------------------------
    def load(self, slot: Slot) -> torch.Tensor:
        """A live buffer's contents: its tensor, or a host copy read from NVMe."""
        if slot.buf.tier != "nvme":
            return slot.tensor
        t = torch.empty(self.table.numel(slot.buf), dtype=self.table.dtype_of(slot.buf))
        self.swapper.read_sync(slot.buf.name, t)
        return t

    def store(self, slot: Slot, value: torch.Tensor) -> None:
        """Overwrite a live buffer's contents with ``value``."""
        if slot.buf.tier == "nvme":
            self.swapper.write_sync(slot.buf.name, value.cpu())
        else:
            slot.tensor.copy_(value)

    # -- ops -------------------------------------------------------------------------
    def run_copy(self, op: Op) -> None:
        table = self.table
        src_name = next(n for n in op.reads if n != "token")
        dst_name = next(n for n in op.writes if n != "token")
        src_slot = table.read(src_name, op)
        if src_slot.buf.kind in ("act", "act_inner"):
            self._move_activation(op, src_slot, table.slot(dst_name, op))
            return
        dst = table.write(dst_name, op)
        src = src_slot.tensor
        asynchronous = copies_asynchronously(op, src, dst)
        with torch.no_grad():
            if op.accumulate:
                dst.add_(src.to(dst.device, non_blocking=asynchronous))
            else:
                dst.copy_(src, non_blocking=asynchronous)

    def _move_activation(self, op: Op, src: Slot, dst: Slot) -> None:
        """Activation offload. On a CPU device the device and the host are the same memory,
        so the move is bookkeeping; on an accelerator it is not supported yet."""
        if self.table.device.type != "cpu":
            raise self.table.error(op, "activation offload is not supported on accelerators by this runtime")
        dst.record, dst.live = src.record, True
        self.table.meter.hold(dst.buf.name, dst.buf.tier, dst.buf.kind, "working", src.record.nbytes)

    def run_nvme(self, op: Op) -> None:
        table = self.table
        src_name = next(n for n in op.reads if n != "token")
        dst_name = next(n for n in op.writes if n != "token")
        if op.kind == "nvme.read":
            on_disk = table.read(src_name, op)
            dst = table.write(dst_name, op)
            self.swapper.read_sync(on_disk.buf.name, dst)
        elif op.kind == "nvme.write":
            src = table.read(src_name, op).tensor
            self.swapper.write_sync(dst_name, src)
            slot = table.slot(dst_name, op)
            slot.live = True
            table.meter.hold(dst_name, "nvme", slot.buf.kind, table.category(slot.buf),
                             src.numel() * src.element_size())
        else:
            raise table.error(op, "not an nvme op")


def copies_asynchronously(op: Op, src: torch.Tensor, dst: torch.Tensor) -> bool:
    """A ``copy.h2d`` from a pinned host buffer to a CUDA one, or a ``copy.d2h`` from a CUDA buffer
    into a pinned host one that it overwrites (one that accumulates adds on the CPU at once)."""
    if op.kind == "copy.h2d":
        host, device = src, dst
    elif op.kind == "copy.d2h" and not op.accumulate:
        host, device = dst, src
    else:
        return False
    return device.is_cuda and host.device.type == "cpu" and host.is_pinned()
