"""Host buffers reused across steps, never holding more than the run already held at once.

Why: a step allocates and frees the same host buffers every time (an NVMe unit's optimizer
state read for its step, gradient shards, staging copies). Large allocations come from
``mmap`` and go back with ``munmap``, so every use of a 750 MB buffer page-faults its pages
in again and the kernel zeroes them: on programs/capacity.zs a third of the rank's CPU time
went to page faults and unmapping. torch's CPU allocator does not cache; its CUDA host
allocator caches pinned blocks, so a pinned buffer never comes here.

Contract:

- :meth:`HostPool.take` returns a uint8 tensor of exactly ``nbytes`` whose first byte is
  4 KiB aligned (so the swapper reads and writes it with ``O_DIRECT`` in place, no staging
  copy); its contents are undefined. :meth:`HostPool.give` hands it back.
- A freed block is kept for the next request of the same size. The bytes taken plus the
  bytes kept never exceed the most the pool ever had taken at one time: before a fresh
  allocation, kept blocks are released (oldest first) until the new one fits under that mark,
  so reuse never raises the rank's peak memory above what it held without the pool.
- A block is kept only when nothing else still refers to its memory (a view someone kept
  would otherwise see another buffer's bytes): the storage's use count is back to what it was
  when the block was handed out; else the block is left to be freed when the last view goes.
- Thread safe: lanes allocate and free concurrently.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from zdsl.runtime.io.aligned import aligned_empty


class HostPool:
    def __init__(self):
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, list[torch.Tensor]] = OrderedDict()   # size -> blocks, oldest size first
        self.kept_bytes = 0
        self.taken_bytes = 0
        self.high_bytes = 0          # the most ever taken at one time
        self.reused = 0              # requests served from a kept block (for tests and the benchmark)
        self.fresh = 0
        self.shared = 0              # blocks not kept: a view of them was still alive

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            blocks = self._kept.get(nbytes)
            if blocks:
                block = blocks.pop()
                if not blocks:
                    del self._kept[nbytes]
                self.kept_bytes -= nbytes
                self.reused += 1
            else:
                while self._kept and self.taken_bytes + self.kept_bytes + nbytes > self.high_bytes:
                    self._drop_oldest()
                block = None
                self.fresh += 1
            self.taken_bytes += nbytes
            self.high_bytes = max(self.high_bytes, self.taken_bytes)
        if block is None:
            block = aligned_empty(nbytes, pin=False)
            block._zdsl_alone = _use_count(block)
        return block

    def give(self, block: torch.Tensor) -> None:
        nbytes = block.numel()
        alone = block._zdsl_alone >= 0 and _use_count(block) == block._zdsl_alone
        with self._lock:
            self.taken_bytes -= nbytes
            if not alone:
                self.shared += 1
                return
            self._kept.setdefault(nbytes, []).append(block)
            self._kept.move_to_end(nbytes)
            self.kept_bytes += nbytes

    def clear(self) -> None:
        """Release every kept block (the rank's end; a test's)."""
        with self._lock:
            self._kept.clear()
            self.kept_bytes = 0

    def _drop_oldest(self) -> None:
        size, blocks = next(iter(self._kept.items()))
        blocks.pop(0)
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
