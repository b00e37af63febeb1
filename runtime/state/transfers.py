"""Copies between tiers (``copy.h2d|d2h``) and NVMe reads and writes (``nvme.read|write``).

A copy between the device and a pinned host buffer is asynchronous: it is queued on the lane's
stream and done when the op's event is (``runtime/exec/streams.py`` makes the host wait for that
event wherever host code uses the buffer next). A pageable host buffer is copied synchronously
(from pageable memory CUDA stages the copy anyway, and an asynchronous copy into it is unsafe).

NVMe buffers go through a swapper (``runtime/offload/swap.py``) per placement: each state's buffers
to the swapper of that state's ``nvme(...)`` folders, block and depth (states placed alike share
one), opened on first use, a ``rank<N>`` folder in each of its folders;
:meth:`Transfers.close_swap` removes their files.
"""
from __future__ import annotations

import os

import torch

from zdsl.ir import BUFFER_KINDS, Op, parse_buffer_name
from zdsl.runtime.offload import swap
from zdsl.runtime.state.buffers import BufferTable, Slot
from zdsl.runtime.state.errors import StateError
from zdsl.schedule import nvme_placements


class Transfers:
    """Moves buffer contents between the device, the host and NVMe for one rank."""

    def __init__(self, table: BufferTable, config: dict):
        self.table = table
        self.config = config
        self._places = nvme_placements(config)
        self._swappers: dict[tuple, swap.Swapper] = {}      # Placement.swap_key -> its Swapper

    def swapper_of(self, name: str) -> swap.Swapper:
        """The NVMe swapper of buffer ``name``: its state's placement's, opened on first use."""
        rank = self.table.rank
        state = BUFFER_KINDS.get(parse_buffer_name(name)[0])
        place = self._places.get(state) if state is not None else None
        if place is None or not place.paths:
            raise StateError(f"rank {rank}: {name} is on nvme but no nvme folder is configured for "
                             f"{state or 'its state'}")
        swapper = self._swappers.get(place.swap_key)
        if swapper is None:
            folders = [os.path.join(path, f"rank{rank}") for path in place.paths]
            # its staging pool is pinned where CUDA is present, unless the placement says pinned=false
            swapper = swap.Swapper(folders, place.block_bytes, place.queue_depth,
                              pin=None if place.pinned else False)
            self._swappers[place.swap_key] = swapper
        return swapper

    @property
    def opened_swappers(self) -> list[swap.Swapper]:
        """The NVMe swappers this rank has opened (never opens one)."""
        return list(self._swappers.values())

    def close_swap(self) -> None:
        """Remove this rank's NVMe swap files, if it opened any (every swapper, even after one failed).
        The last opened closes first: where two share a folder, the first made it and removes it
        only once the other's run folder has gone."""
        swappers, self._swappers = list(self._swappers.values())[::-1], {}
        errors = []
        for swapper in swappers:
            try:
                swapper.close()
            except Exception as exc:  # noqa: BLE001 - the others still close; the first is raised
                errors.append(exc)
        if errors:
            raise errors[0]

    # -- whole buffers, wherever they live -----------------------------------------
    def load(self, slot: Slot) -> torch.Tensor:
        """A live buffer's contents: its tensor, or a host copy read from NVMe."""
        if slot.buf.tier != "nvme":
            assert slot.tensor is not None     # a live buffer off NVMe holds its tensor
            return slot.tensor
        t = torch.empty(self.table.numel(slot.buf), dtype=self.table.dtype_of(slot.buf))
        self.swapper_of(slot.buf.name).read_sync(slot.buf.name, t)
        return t

    def store(self, slot: Slot, value: torch.Tensor) -> None:
        """Overwrite a live buffer's contents with ``value``."""
        if slot.buf.tier == "nvme":
            self.swapper_of(slot.buf.name).write_sync(slot.buf.name, value.cpu())
        else:
            assert slot.tensor is not None     # a live buffer off NVMe holds its tensor
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
        src = table.read_tensor(src_name, op)
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
        record = self.table.read_record(src.buf.name, op)
        dst.record, dst.live = record, True
        self.table.meter.hold(dst.buf.name, dst.buf.tier, dst.buf.kind, "working", record.nbytes)

    def run_nvme(self, op: Op) -> None:
        table = self.table
        src_name = next(n for n in op.reads if n != "token")
        dst_name = next(n for n in op.writes if n != "token")
        if op.kind == "nvme.read":
            on_disk = table.read(src_name, op)
            dst = table.write(dst_name, op)
            self.swapper_of(on_disk.buf.name).read_sync(on_disk.buf.name, dst)
        elif op.kind == "nvme.write":
            src = table.read_tensor(src_name, op)
            self.swapper_of(dst_name).write_sync(dst_name, src)
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
