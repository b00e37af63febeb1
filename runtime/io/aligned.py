"""4 KiB-aligned host memory: the only memory the NVMe tier does I/O from.

Why: ``O_DIRECT`` reads and writes bypass the page cache, and the kernel then
demands that the user buffer, the file offset and the length are all
multiples of the device's logical block size (512 B or 4 KiB). Aligning to
4 KiB satisfies every device. Where CUDA is present the memory is also
*pinned* (page-locked), so host<->device copies of the same bytes run at
full PCIe speed and can be asynchronous; without CUDA, pinning is impossible
and unnecessary, so an anonymous ``mmap`` (page aligned by construction)
is used, backed by transparent huge pages where the kernel has them: the
kernel maps a direct transfer page by page, so 2 MiB pages take far fewer
mappings than 4 KiB ones, and the rate into 4 KiB pages moves with how
scattered they are (``benchmarks/nvme_io.py`` measures both); the CPU's
copies into huge pages run no slower.

Two things live here:

- :func:`aligned_empty`: one aligned uint8 tensor, e.g. a host buffer that
  the runtime later swaps; the swapper then writes straight from it
  (zero copy).
- :class:`AlignedPool`: a fixed set of equal aligned staging buffers,
  handed out and returned by worker threads. A fixed pool bounds the NVMe
  tier's host memory to ``count * block_bytes`` whatever the I/O volume.
"""

from __future__ import annotations

import mmap
import queue
from contextlib import contextmanager
from typing import Iterator

import torch

from zdsl.schedule import DIRECT_IO_ALIGN as ALIGN

HUGE_PAGE = 2 << 20                                      # x86-64's and arm64's transparent huge page
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)    # Linux only


def round_up(nbytes: int, align: int = ALIGN) -> int:
    """Smallest multiple of ``align`` that is >= ``nbytes``."""
    return (nbytes + align - 1) // align * align


def pin_default() -> bool:
    """Pin host memory exactly where a CUDA device can use it."""
    return torch.cuda.is_available()


def aligned_empty(nbytes: int, *, pin: bool | None = None, whole_huge_pages: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte is 4 KiB aligned.

    The storage behind it is rounded up to a whole number of 4 KiB pages, so
    the tensor may be viewed as any dtype and sliced at 4 KiB offsets while
    staying aligned. Contents are undefined when pinned, zero otherwise.
    Unpinned, a tensor of at least one huge page is advised onto huge pages;
    ``whole_huge_pages`` also starts it on a huge page and rounds its pages up
    to whole huge pages, so every byte of it is in one (for fixed buffers the
    I/O goes through; costs up to a huge page more of memory).
    """
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be >= 0, got {nbytes}")
    padded = max(round_up(nbytes), ALIGN)
    if pin_default() if pin is None else pin:
        # CUDA's host allocator returns page-aligned blocks; over-allocate only if one is not.
        raw = torch.empty(padded, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN:
            raw = torch.empty(padded + ALIGN, dtype=torch.uint8, pin_memory=True)
        start = (-raw.data_ptr()) % ALIGN
        return raw[start : start + nbytes]
    if whole_huge_pages:
        # over-map by one huge page so that a whole number of them starts on a boundary inside
        padded = round_up(padded, HUGE_PAGE) + HUGE_PAGE
    # An anonymous private mapping is page aligned; the tensor keeps the
    # mmap object alive, and the pages return to the OS when both go.
    region = mmap.mmap(-1, padded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if padded >= HUGE_PAGE and _MADV_HUGEPAGE is not None:
        # The 2 MiB-aligned stretches inside the mapping get huge pages (where THP is
        # "always" or "madvise"); the ends stay 4 KiB pages, so resident bytes stay exact
        # (with ``whole_huge_pages`` the tensor lies in aligned stretches only).
        try:
            region.madvise(_MADV_HUGEPAGE)
        except OSError:     # a kernel built without THP: 4 KiB pages, as before
            pass
    memory = torch.frombuffer(region, dtype=torch.uint8)
    start = (-memory.data_ptr()) % HUGE_PAGE if whole_huge_pages else 0
    return memory[start : start + nbytes]


def is_aligned(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is a CPU tensor whose data starts on a 4 KiB boundary."""
    return tensor.device.type == "cpu" and tensor.data_ptr() % ALIGN == 0


class AlignedPool:
    """``count`` staging buffers of ``block_bytes`` each, from one aligned allocation.

    Thread safe: ``acquire`` blocks until a buffer is free. The swapper
    never lets more than ``queue_depth`` requests run at once, so a pool of
    ``queue_depth`` buffers never makes a request wait for memory.
    """

    def __init__(self, block_bytes: int, count: int, *, pin: bool | None = None):
        if block_bytes <= 0 or block_bytes % ALIGN:
            raise ValueError(f"AlignedPool: block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
        if count <= 0:
            raise ValueError(f"AlignedPool: count must be positive, got {count}")
        self.block_bytes = block_bytes
        self.count = count
        self.pinned = pin_default() if pin is None else pin
        self._memory = aligned_empty(block_bytes * count, pin=self.pinned, whole_huge_pages=True)
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for i in range(count):
            self._free.put(self._memory[i * block_bytes : (i + 1) * block_bytes])

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds (for memory accounting)."""
        return self.block_bytes * self.count

    def acquire(self) -> torch.Tensor:
        return self._free.get()

    def release(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)

    @contextmanager
    def buffer(self) -> Iterator[torch.Tensor]:
        """``with pool.buffer() as buf:`` borrow one staging buffer."""
        buf = self._free.get()
        try:
            yield buf
        finally:
            self._free.put(buf)
