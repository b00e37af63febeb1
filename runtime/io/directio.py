"""File I/O at the disk's speed: O_DIRECT, aligned buffers, pipelined transfers.

The primitives every direct-I/O user shares (the NVMe swapper, the checkpoint
files): :func:`open_direct` (O_DIRECT, buffered where the filesystem refuses
it), :func:`pwrite_all` and :func:`pread_full` (positional, short transfers
continued, a transfer of 0 bytes an error); alignment is
``runtime/io/aligned.py``'s. Then :class:`Sink` and :class:`Source`, the
checkpoint files' sequential streams.

Why not plain buffered I/O: a buffered write copies every byte into the
page cache, and the kernel's writeback and reclaim then cost as much CPU
again (``benchmarks/checkpoint_io.py`` measures both). With O_DIRECT the disk reads
and writes our memory itself (DMA):

* the writer lays each large tensor out in the file at the same offset
  within a 4 KiB page as its memory has (padding tensors in between), so
  its page-aligned interior is written straight from where it lies, the
  next chunk's write running while this one is checksummed;
* whole-tensor reads land straight in the destination: a new tensor
  allocated congruent to the file offset, or a caller's buffer that is
  (buffers from the same allocator as the saved ones usually are);
* everything else (headers, ragged ends, slices when re-cutting, buffers
  that are not congruent) goes through two 16 MiB aligned bounce buffers,
  copied with torch ``copy_`` (which releases the GIL).

Filesystems without O_DIRECT (tmpfs, some network mounts) get buffered
I/O with early writeback instead.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from zdsl.runtime.io.aligned import ALIGN, round_up

BOUNCE = 16 << 20          # bytes per transfer; a multiple of ALIGN
ZERO_COPY_MIN = 1 << 20    # smaller writes and reads go through the bounce buffers anyway
WRITE_DEPTH = 2            # writes in flight per file: the disk's queue never runs dry between them


class FileIOError(OSError):
    """A read or write of a file failed; the message names the file and the byte."""


class TruncatedFile(EOFError):
    """The file ended before the bytes asked for; ``pos`` is the offset where it did."""

    def __init__(self, pos: int):
        super().__init__(f"end of file at offset {pos}")
        self.pos = pos


def open_direct(path, flags: int, mode: int = 0o644) -> tuple[int, bool]:
    """``(fd, direct)``: ``path`` opened with O_DIRECT, or buffered where the filesystem refuses it
    (EINVAL, e.g. tmpfs before Linux 6.6) or the platform has no O_DIRECT. Other errors raise."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def pwrite_all(fd: int, data, pos: int) -> None:
    """Write every byte of ``data`` at file offset ``pos`` (short writes are continued); OSError on
    failure, including a write that wrote nothing (which would otherwise loop for ever)."""
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwritev(fd, [view], pos)
        if n <= 0:
            raise OSError(errno.EIO, f"the write at offset {pos} wrote nothing")
        view, pos = view[n:], pos + n


def pread_full(fd: int, view: memoryview, pos: int, want: int | None = None, direct: bool = False) -> None:
    """Fill at least ``want`` (default all) bytes of ``view`` from file offset ``pos``.

    With ``direct`` the reads are of the whole (aligned) ``view`` and the end of the file may shorten
    the last one. OSError on failure; :class:`TruncatedFile` when the file ends before ``want``.
    """
    want = len(view) if want is None else want
    got = 0
    while got < want:
        n = os.preadv(fd, [view[got:]], pos + got)
        if n <= 0 or (direct and n % ALIGN and got + n < want):
            raise TruncatedFile(pos + got + max(n, 0))
        got += n


def as_bytes(view) -> torch.Tensor:
    """A uint8 tensor over a writable buffer, without copying (torch copies release the GIL)."""
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


def aligned_bytes(nbytes: int, congruent_to: int = 0) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose address is ``congruent_to`` modulo ALIGN."""
    base = torch.empty(nbytes + 2 * ALIGN, dtype=torch.uint8)
    shift = (congruent_to - base.data_ptr()) % ALIGN
    return base[shift:shift + nbytes]


class Sink:
    """Bytes written in order to a new file; ``close()`` fsyncs and returns the file's size."""

    def __init__(self, path: str, direct: bool = True):
        self.path = path
        self.pos = 0                      # bytes accepted
        self.pool = ThreadPoolExecutor(WRITE_DEPTH, thread_name_prefix="ckpt-write")
        self.pending: list = []           # writes in flight, oldest first (distinct file ranges)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.fd, self.direct = open_direct(path, flags) if direct else (os.open(path, flags, 0o644), False)
        if self.direct:
            self.bufs = [aligned_bytes(BOUNCE), aligned_bytes(BOUNCE)]
            self.in_flight = [None, None]     # the pending write of each buffer, if any
            self.cur = 0                  # which bounce buffer is being filled
            self.fill = 0                 # bytes in it
            self.flushed = 0              # file offset of the buffer being filled

    def write(self, data) -> None:
        """Append ``data`` (a buffer: bytes, memoryview of a tensor, ...).

        When ``data``'s address is congruent to the file position modulo a
        page (the writer lays tensors out so), its page-aligned interior is
        written from where it lies; only the ragged ends are copied.
        """
        if not self.direct:
            self._wait(WRITE_DEPTH - 1)
            self.pending.append(self.pool.submit(self._buffered, data, self.pos))
            self.pos += len(data)
            return
        src = as_bytes(bytearray(data) if isinstance(data, bytes) or getattr(data, "readonly", False) else data)
        head = (-self.pos) % ALIGN
        if len(src) < max(ZERO_COPY_MIN, head + ALIGN) or (src.data_ptr() - self.pos) % ALIGN:
            self._copy_in(src)
            return
        self._copy_in(src[:head])
        if self.fill:
            self._flush(self.fill)                  # ends on a page: the file position is aligned
        body = (len(src) - head) // ALIGN * ALIGN
        self._wait(WRITE_DEPTH - 1)
        self.pending.append(self.pool.submit(pwrite_all, self.fd, src[head:head + body].numpy(), self.flushed))
        self.flushed += body
        self.pos += body
        self._copy_in(src[head + body:])

    def _copy_in(self, src: torch.Tensor) -> None:
        done = 0
        while done < len(src):
            n = min(len(src) - done, BOUNCE - self.fill)
            if self.fill == 0:
                self._wait_buffer()
            self.bufs[self.cur][self.fill:self.fill + n].copy_(src[done:done + n])
            self.fill += n
            self.pos += n
            done += n
            if self.fill == BOUNCE:
                self._flush(BOUNCE)

    def _buffered(self, data, pos: int) -> None:
        pwrite_all(self.fd, data, pos)
        if hasattr(os, "posix_fadvise") and len(data):
            # Start writeback now rather than at fsync, so the disk works while we copy on.
            os.posix_fadvise(self.fd, pos, len(data), os.POSIX_FADV_DONTNEED)

    def _flush(self, nbytes: int) -> None:
        """Hand the filled bounce buffer (padded to ``nbytes``) to the worker; fill the other."""
        self._wait(WRITE_DEPTH - 1)
        buf = self.bufs[self.cur][:nbytes].numpy()
        self.pending.append(self.pool.submit(pwrite_all, self.fd, buf, self.flushed))
        self.in_flight[self.cur] = self.pending[-1]
        self.flushed += nbytes
        self.cur ^= 1
        self.fill = 0

    def _wait_buffer(self) -> None:
        """The buffer about to be filled may still be being written (a direct write came between)."""
        fut = self.in_flight[self.cur]
        if fut is not None:
            self.in_flight[self.cur] = None
            fut.result()

    def _wait(self, at_most: int = 0) -> None:
        """Until at most ``at_most`` writes are in flight (oldest first; raises a failed write's error)."""
        while len(self.pending) > at_most:
            self.pending.pop(0).result()

    def close(self) -> int:
        """Finish the writes, fsync, and return the size; the file is complete on return."""
        try:
            if self.direct and self.fill:
                padded = round_up(self.fill)
                self.bufs[self.cur][self.fill:padded].zero_()
                self._flush(padded)
            self._wait()
            if self.direct:
                os.ftruncate(self.fd, self.pos)     # drop the last block's padding
            os.fsync(self.fd)
            if not self.direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return self.pos
        finally:
            self.abort()

    def abort(self) -> None:
        self.pool.shutdown(wait=True)
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Source:
    """Reads of one file: ranges in order, the next transfer running while one is used."""

    def __init__(self, path: str, fd: int, direct: bool = True):
        self.path = path
        self.fd = fd                       # a buffered descriptor, owned by the caller
        self.dfd = None
        if direct:
            dfd, is_direct = open_direct(path, os.O_RDONLY)
            if is_direct:
                self.dfd = dfd
            else:
                os.close(dfd)

    def close(self) -> None:
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def read_tensor(self, start: int, nbytes: int, dtype: torch.dtype,
                    on_chunk: Callable[[memoryview], None] | None) -> torch.Tensor | None:
        """File bytes [start, start+nbytes) as a flat ``dtype`` tensor read by DMA into its own memory.

        ``on_chunk`` sees the tensor's bytes in order, one chunk at a time,
        while the next chunk is read. None when direct I/O cannot serve it
        (no O_DIRECT here, or ``start`` not a multiple of the element size).
        """
        elem = torch.empty((), dtype=dtype).element_size()
        if self.dfd is None or start % elem or nbytes % elem:
            return None
        head = start % ALIGN
        need = head + nbytes
        region = aligned_bytes(round_up(need))            # region[0] <-> file byte start - head
        view = region.numpy()
        chunks = range(0, need, BOUNCE)
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-read") as pool:
            def read(j):
                lo = chunks[j]
                self._read(self.dfd, view[lo:lo + round_up(min(BOUNCE, need - lo))].data,
                           start - head + lo, min(BOUNCE, need - lo))
            fut = pool.submit(read, 0)
            for j, lo in enumerate(chunks):
                fut.result()
                if j + 1 < len(chunks):
                    fut = pool.submit(read, j + 1)
                if on_chunk is not None:
                    b0, b1 = max(lo, head), min(lo + BOUNCE, need)
                    if b0 < b1:
                        on_chunk(view[b0:b1].data)
        return region[head:need].view(dtype)

    def read_into(self, start: int, dest: torch.Tensor, on_chunk: Callable[[memoryview], None] | None) -> bool:
        """File bytes [start, start+len(dest)) into the uint8 tensor ``dest`` by DMA, if its address
        is congruent to ``start`` modulo a page; False (nothing read) otherwise.

        ``on_chunk`` sees the bytes in order while the next chunk is read.
        """
        n = len(dest)
        head = (-start) % ALIGN
        if self.dfd is None or n < max(ZERO_COPY_MIN, head + ALIGN) or (dest.data_ptr() - start) % ALIGN:
            return False
        body = (n - head) // ALIGN * ALIGN
        tail_at = head + body
        self._copy_range(start, start + head, dest[:head], on_chunk)
        view = dest.numpy()
        chunks = range(head, tail_at, BOUNCE)
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-read") as pool:
            def read(j):
                lo = chunks[j]
                m = min(BOUNCE, tail_at - lo)
                self._read(self.dfd, view[lo:lo + m].data, start + lo, m)
            fut = pool.submit(read, 0)                    # body >= ALIGN above: at least one chunk
            for j, lo in enumerate(chunks):
                fut.result()
                if j + 1 < len(chunks):
                    fut = pool.submit(read, j + 1)
                if on_chunk is not None:
                    on_chunk(view[lo:min(lo + BOUNCE, tail_at)].data)
        self._copy_range(start + tail_at, start + n, dest[tail_at:], on_chunk)
        return True

    def _copy_range(self, start: int, end: int, dest: torch.Tensor, on_chunk) -> None:
        pos = 0
        for piece in self.pieces(start, end):
            dest[pos:pos + len(piece)].copy_(as_bytes(piece))
            if on_chunk is not None:
                on_chunk(piece)
            pos += len(piece)

    def pieces(self, start: int, end: int):
        """Yield memoryviews covering file bytes [start, end) in order; each is valid until the next."""
        if start >= end:
            return
        a0 = start - start % ALIGN if self.dfd is not None else start
        chunks = range(a0, end, BOUNCE)
        # Buffers per call, sized to the range: a reader with many files open holds none of them idle.
        n = min(BOUNCE, round_up(end - a0))
        bufs = [aligned_bytes(n).numpy() for _ in range(min(2, len(chunks)))]
        fd = self.dfd if self.dfd is not None else self.fd
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-read") as pool:
            def read(j):
                pos = chunks[j]
                want = min(n, end - pos)
                buf = memoryview(bufs[j % 2])
                self._read(fd, buf[:round_up(want)] if fd == self.dfd else buf[:want], pos, want)
                return buf[:want]
            fut = pool.submit(read, 0)
            for j, pos in enumerate(chunks):
                got = fut.result()
                if j + 1 < len(chunks):
                    fut = pool.submit(read, j + 1)
                yield got[max(start, pos) - pos:]

    def _read(self, fd: int, view: memoryview, pos: int, want: int) -> None:
        """Fill at least ``want`` bytes of ``view`` from file offset ``pos``.

        O_DIRECT reads the whole ``view``; the end of the file shortens it."""
        try:
            pread_full(fd, view, pos, want, direct=fd == self.dfd)
        except TruncatedFile:
            raise FileIOError(errno.EIO, f"{self.path}: truncated while reading") from None
        except OSError as e:
            raise FileIOError(e.errno, f"{self.path}: read failed at byte {pos}: {e.strerror}") from None
