"""Host buffers reused across steps, never holding more than the run already held at once.

Why: a step allocates and frees the same host buffers every time (an NVMe unit's optimizer
state read for its step, gradient shards, staging copies). Large allocations come from
``mmap`` and go back with ``munmap``, so every use of a 750 MB buffer page-faults its pages
in again and the kernel zeroes them: on programs/capacity.zs a third of the rank's CPU time
went to page faults and unmapping. A CPU rank's device buffers come here too (the buffer table
lends a block to a flat parameter or gradient, ``flat.lend_storage``): at stage 2 every step
freed and faulted in again its 73 MiB of full gradients. torch's CPU allocator does not
cache; its CUDA host allocator caches pinned blocks, so a pinned buffer never comes here.

Contract:

- :meth:`HostPool.take` returns a uint8 tensor of at least ``nbytes`` (exactly, when newly
  allocated) whose first byte is 4 KiB aligned (so the swapper reads and writes it with
  ``O_DIRECT`` in place, no staging copy); its contents are undefined; :func:`typed` views the
  request's part. :meth:`HostPool.give` hands the whole block back.
- A freed block is kept for the next request of its size; failing one, the smallest larger
  kept block serves a request of at least half its size. The bytes taken (whole blocks)
  plus the bytes kept never exceed the most the pool ever had taken at one time: before a new
  allocation, kept blocks are released (the smallest first) until the new one fits under that
  mark, so reuse never raises the rank's peak memory above what it held without the pool.
- A block is kept only when nothing else still refers to its memory (a view someone kept
  would otherwise see another buffer's bytes): the storage's use count is back to what it was
  when the block was handed out; else the block is left to be freed when the last view goes.
- Thread safe: lanes allocate and free concurrently.
"""
from __future__ import annotations

import threading

import torch

from zdsl.runtime.io.aligned import aligned_empty


class HostPool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[int, list[torch.Tensor]] = {}   # size -> blocks, oldest first
        # id(block) -> its storage's use count when it was made, for every block taken or kept
        self._alone_count: dict[int, int] = {}
        self.kept_bytes = 0
        self.taken_bytes = 0
        self.high_bytes = 0          # the most ever taken at one time
        self.reused = 0              # requests served from a kept block (for tests and the benchmark)
        self.fresh = 0
        self.shared = 0              # blocks not kept: a view of them was still alive

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            size = self._fitting(nbytes)
            if size is not None:
                blocks = self._kept[size]
                block = blocks.pop()
                if not blocks:
                    del self._kept[size]
                self.kept_bytes -= size
                self.taken_bytes += size
                self.reused += 1
            else:
                for size in self._to_drop(nbytes):
                    self._drop(size)
                block = None
                self.fresh += 1
                self.taken_bytes += nbytes
            self.high_bytes = max(self.high_bytes, self.taken_bytes)
        if block is None:
            block = aligned_empty(nbytes, pin=False)
            count = _use_count(block)
            with self._lock:
                self._alone_count[id(block)] = count
        return block

    def give(self, block: torch.Tensor) -> None:
        nbytes = block.numel()
        count = self._alone_count[id(block)]   # only its holder gives it back: no other thread writes it
        alone = count >= 0 and _use_count(block) == count
        with self._lock:
            self.taken_bytes -= nbytes
            if not alone:
                del self._alone_count[id(block)]
                self.shared += 1
                return
            self._kept.setdefault(nbytes, []).append(block)
            self.kept_bytes += nbytes

    def clear(self) -> None:
        """Release every kept block (the rank's end; a test's)."""
        with self._lock:
            for blocks in self._kept.values():
                for block in blocks:
                    del self._alone_count[id(block)]
            self._kept.clear()
            self.kept_bytes = 0

    def _fitting(self, nbytes: int) -> int | None:
        """The size of the kept block to hand out for ``nbytes``: the same size, else the smallest
        larger one if it is at most twice the request. A step's buffers come in a few sizes (a
        gradient shard is half its full gradient) whose most live at once, size by size, add up
        to more than the mark: matching sizes exactly, a request would unmap blocks the step
        needs later and fault new pages in (at stage 2, every full gradient's)."""
        if nbytes in self._kept:
            return nbytes
        larger = [size for size in self._kept if size > nbytes]
        if not larger:
            return None
        size = min(larger)
        return size if size <= 2 * nbytes else None

    def _to_drop(self, nbytes: int) -> list[int]:
        """The sizes of the kept blocks a new block of ``nbytes`` unmaps to fit under the mark:
        the smallest first, so the fewest bytes are faulted in again."""
        over = self.taken_bytes + self.kept_bytes + nbytes - self.high_bytes
        drop: list[int] = []
        for size in sorted(self._kept):
            for _ in self._kept[size]:
                if over <= 0:
                    return drop
                drop.append(size)
                over -= size
        return drop

    def _drop(self, size: int) -> None:
        blocks = self._kept[size]
        del self._alone_count[id(blocks.pop(0))]
        if not blocks:
            del self._kept[size]
        self.kept_bytes -= size


def _use_count(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (-1 where torch does not say: never reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count(t.untyped_storage()._cdata) if count is not None else -1


def typed(block: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` over a block from :meth:`HostPool.take`."""
    return block.view(dtype)[:numel]
