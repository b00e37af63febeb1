"""The NVMe tier: named tensors swapped to files with direct, verified, parallel I/O.

- One file per buffer name and swap folder, opened with ``O_DIRECT`` (runtime/io/directio.py): the
  page cache would double the host memory used and evict what training needs. Where a filesystem
  refuses ``O_DIRECT`` (tmpfs), buffered I/O is used and a warning is logged once.
- Over several folders (one per drive) a buffer's blocks are striped over its files, block ``i``
  in folder ``i mod n`` (``runtime/offload/stripes.py``): the drives work at once, as RAID-0.
- A transfer is cut into ``block_bytes`` requests (positional writes and reads at the block's
  offset) issued by at most ``queue_depth`` concurrent system calls: an NVMe device needs several
  requests in flight to reach its bandwidth. Each worker thread takes the next block until none
  is left (one thread hop per worker, not per block). With verification on, a quarter more
  workers than ``queue_depth`` run, and a semaphore keeps exactly ``queue_depth`` system calls in
  flight, so a worker checksumming a block does not hold a request slot.
- All I/O uses 4 KiB-aligned memory: the caller's tensor itself when it is an aligned CPU tensor
  of at least a huge page (zero copy; :func:`zdsl.runtime.io.aligned.aligned_empty`), else a
  staging buffer from a fixed :class:`~zdsl.runtime.io.aligned.AlignedPool` on huge pages, so
  host memory for I/O is bounded and every request moves huge-page memory.
- Nothing is lost silently: every byte is written (short writes are continued), a CRC-32C per
  block is kept in memory and checked on read, a full disk is reported with the path, the bytes
  needed and the bytes free (checked before a file is first sized, and on ``ENOSPC``); every
  failure is a :class:`SwapError` naming the file and block.
- Each run owns a private run folder in each swap folder, cleaned up by the next run when its
  owner died (``runtime/offload/run_folder.py``). ``close()`` (also via ``with``, and at
  interpreter exit) removes them, and a swap folder too when this Swapper created it and nothing
  else is in it (never a folder that was there before, never a file it did not write).

Measurements behind these choices: benchmarks/README.md (NVMe swap).
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import trio

from zdsl.runtime.io import checksum
from zdsl.runtime.io.aligned import ALIGN, HUGE_PAGE, AlignedPool, is_aligned, round_up
from zdsl.runtime.io.directio import TruncatedFile, open_direct, pread_full, pwrite_all
from zdsl.runtime.io.host_access import host_access
from zdsl.runtime.offload.run_folder import (
    LOCK_NAME,  # noqa: F401 - part of this module's interface
    RUN_PREFIX,  # noqa: F401
    RunFolder,
    SwapError,
    log,
    remove_stale_runs,  # noqa: F401
)
from zdsl.runtime.offload.run_folder import free_bytes as _free_bytes
from zdsl.runtime.offload.stripes import Stripe
from zdsl.runtime.offload.stripes import SwapFile as _SwapFile
from zdsl.schedule import NVME_BLOCK, NVME_DEPTH
from zdsl.swap_folders import stripe_bytes

SMALL_PER_WORKER = 1 << 20   # bytes a transfer needs per worker thread (see Swapper._workers_for)


class _RunState:
    """What cleanup needs, kept apart from the Swapper so a finalizer can hold it."""

    def __init__(self, runs: list[RunFolder]):
        self.runs = runs                  # one per swap folder, in the folders' order
        self.owner_pid = os.getpid()
        self.files: dict[str, _SwapFile] = {}
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.owner_pid:
            return  # a forked child exiting: the run (and its folders) belongs to the parent
        for f in self.files.values():
            for stripe in f.stripes:
                try:
                    os.close(stripe.fd)
                except OSError:
                    pass
        self.files.clear()
        for run in self.runs:
            run.remove()


def _open_runs(folders: Sequence[Path]) -> list[RunFolder]:
    """A run folder in each swap folder; none left behind if one of them cannot be had."""
    runs: list[RunFolder] = []
    try:
        for folder in folders:
            runs.append(RunFolder.open(folder))
    except BaseException:
        for run in runs:
            run.remove()
        raise
    return runs


# ----------------------------------------------------------------------------
# the swapper
# ----------------------------------------------------------------------------


def _byte_view(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise SwapError(
            f"swap {what}: tensor must be contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()})"
        )
    return tensor.detach().reshape(-1).view(torch.uint8)


class Swapper:
    """Swap named tensors to files under ``folders`` (one folder, or several to stripe over).

    ``await write(name, tensor)`` / ``await read(name, out)`` run in trio;
    ``write_sync`` / ``read_sync`` do the same from plain threads. A name
    may be rewritten with a tensor of another size (its files are resized).
    ``verify=False`` skips the per-block checksum (CRC-32C, see runtime/io/checksum.py:
    it costs well under the disk's time, so it is on by default).
    """

    def __init__(
        self,
        folders: str | os.PathLike | Sequence[str | os.PathLike],
        block_bytes: int = NVME_BLOCK,
        queue_depth: int = NVME_DEPTH,
        *,
        verify: bool = True,
        pin: bool | None = None,
    ):
        if block_bytes <= 0 or block_bytes % ALIGN:
            raise SwapError(f"swap: block size must be a positive multiple of {ALIGN} bytes, got {block_bytes}")
        if queue_depth <= 0:
            raise SwapError(f"swap: queue depth must be positive, got {queue_depth}")
        given = [folders] if isinstance(folders, (str, os.PathLike)) else folders
        self.folders = tuple(Path(f).absolute() for f in given)
        if not self.folders or len(set(self.folders)) != len(self.folders):
            raise SwapError(f"swap: needs one or more distinct folders, got {[str(f) for f in self.folders]}")
        self.block_bytes = block_bytes
        self.queue_depth = queue_depth
        self.verify = verify
        self._checksum = checksum.DEFAULT
        self._state = _RunState(_open_runs(self.folders))
        self._finalizer = weakref.finalize(self, _RunState.close, self._state)
        # workers beyond the queue depth checksum while queue_depth requests stay in flight
        self.workers = queue_depth + (-(-queue_depth // 4) if verify else 0)
        self._requests = threading.BoundedSemaphore(queue_depth)
        self.pool = AlignedPool(block_bytes, self.workers, pin=pin)
        self._limiter = trio.CapacityLimiter(self.workers)
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._warned_buffered = False
        self._opened = 0
        self.bytes_written = 0
        self.bytes_read = 0
        log.debug("swap.open", run_dirs=[str(d) for d in self.run_dirs], block_bytes=block_bytes,
                  queue_depth=queue_depth)

    # -- lifetime -------------------------------------------------------------

    @property
    def run_dirs(self) -> list[Path]:
        """This run's folder in each swap folder, in the folders' order."""
        return [run.run_dir for run in self._state.runs]

    @property
    def run_dir(self) -> Path:
        """The run folder of a swapper over one folder (:attr:`run_dirs` for several)."""
        if len(self.folders) != 1:
            raise SwapError(f"swap: {len(self.folders)} folders have a run folder each (run_dirs)")
        return self.run_dirs[0]

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Close every file and remove the run folders (and a folder, if this Swapper made it and it
        is empty). Idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._finalizer()

    def __enter__(self) -> "Swapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- files ----------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._state.files)

    def nbytes(self, name: str) -> int:
        """Logical bytes of the tensor last written under ``name``."""
        return self._file(name, "nbytes").nbytes

    def path(self, name: str, block: int = 0) -> Path:
        """The file holding block ``block`` of ``name``."""
        f = self._file(name, "path")
        return f.locate(block, self.block_bytes)[0].path

    def paths(self, name: str) -> list[Path]:
        """``name``'s files, one per folder in the folders' order."""
        return [s.path for s in self._file(name, "paths").stripes]

    def direct(self, name: str) -> bool:
        """Whether ``name``'s files do direct I/O (False where O_DIRECT was refused)."""
        return self._file(name, "direct").direct

    def _file(self, name: str, what: str) -> _SwapFile:
        if self._state.closed:
            raise SwapError(f"swap {what} {name!r}: the swapper is closed")
        try:
            return self._state.files[name]
        except KeyError:
            where = ", ".join(str(d) for d in self.run_dirs)
            raise SwapError(f"swap {what} {name!r}: nothing was written under this name in {where}") from None

    def _open(self, name: str) -> _SwapFile:
        if self._state.closed:
            raise SwapError(f"swap write {name!r}: the swapper is closed")
        f = self._state.files.get(name)
        if f is not None:
            return f
        safe = "".join(c if c.isalnum() or c in "._-@[]" else "_" for c in name)
        self._opened += 1  # a counter, not len(files): names stay unique after discard()
        stripes: list[Stripe] = []
        try:
            for run_dir in self.run_dirs:
                stripes.append(self._open_stripe(run_dir / f"{safe}-{self._opened - 1}.swap"))
        except SwapError:
            for stripe in stripes:
                os.close(stripe.fd)
                stripe.path.unlink(missing_ok=True)
            raise
        f = _SwapFile(stripes)
        self._state.files[name] = f
        return f

    def _open_stripe(self, path: Path) -> Stripe:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            fd, direct = open_direct(path, flags, 0o600)
        except OSError as e:
            raise SwapError(f"swap file {path}: cannot open: {e.strerror}") from e
        if not direct:
            if not self._warned_buffered:
                self._warned_buffered = True
                log.warning("swap.buffered_io", path=str(path), reason="O_DIRECT refused by this filesystem")
        return Stripe(path, fd, direct)

    def _size(self, f: _SwapFile, nbytes: int) -> None:
        """Give ``f`` room for ``nbytes``: preflight free space, then reserve it on disk."""
        for stripe, file_bytes in zip(f.stripes, stripe_bytes(nbytes, self.block_bytes, len(f.stripes))):
            self._size_stripe(stripe, file_bytes)
        f.nbytes = nbytes
        f.crcs = [None] * ((nbytes + self.block_bytes - 1) // self.block_bytes)
        f.complete = False

    def _size_stripe(self, stripe: Stripe, file_bytes: int) -> None:
        folder = stripe.path.parent.parent
        if file_bytes > stripe.file_bytes:
            grow = file_bytes - stripe.file_bytes
            free = _free_bytes(stripe.path.parent)
            if grow > free:
                raise SwapError(
                    f"swap file {stripe.path}: disk full: needs {grow} more bytes "
                    f"({file_bytes} in all), {free} bytes free on {folder}"
                )
            try:
                os.posix_fallocate(stripe.fd, stripe.file_bytes, grow)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise SwapError(
                        f"swap file {stripe.path}: disk full: needs {grow} more bytes, "
                        f"{_free_bytes(stripe.path.parent)} bytes free on {folder}"
                    ) from e
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise SwapError(f"swap file {stripe.path}: cannot size to {file_bytes} bytes: {e.strerror}") \
                        from e
        elif file_bytes < stripe.file_bytes:
            os.ftruncate(stripe.fd, file_bytes)
        stripe.file_bytes = file_bytes

    def reserve(self, sizes: Mapping[str, int]) -> None:
        """Size the files for ``sizes`` (name -> bytes) now, so a disk too small
        for all of them fails before training starts, not in the middle. Folders on one
        filesystem share its free space, so the check adds their needs up."""
        files, n = self._state.files, len(self.folders)
        needs = [0] * n
        for name, nbytes in sizes.items():
            have = [s.file_bytes for s in files[name].stripes] if name in files else [0] * n
            for k, size in enumerate(stripe_bytes(nbytes, self.block_bytes, n)):
                needs[k] += size - have[k]
        by_device: dict[int, list[int]] = {}
        for k, run_dir in enumerate(self.run_dirs):
            by_device.setdefault(os.stat(run_dir).st_dev, []).append(k)
        for group in by_device.values():
            total, free = sum(needs[k] for k in group), _free_bytes(self.run_dirs[group[0]])
            if total > free:
                where = " and ".join(str(self.folders[k]) for k in group)
                raise SwapError(f"swap folder {where}: disk full: needs {total} bytes, {free} bytes free")
        for name, nbytes in sizes.items():
            f = self._open(name)
            if f.nbytes != nbytes or not f.crcs:
                self._size(f, nbytes)

    def discard(self, name: str) -> None:
        """Forget ``name`` and delete its files."""
        f = self._state.files.pop(name, None)
        if f is not None:
            for stripe in f.stripes:
                os.close(stripe.fd)
                stripe.path.unlink(missing_ok=True)

    # -- per-block work (runs in worker threads) ----------------------------------

    def _block(self, f: _SwapFile, index: int) -> tuple[int, int, int]:
        """Block ``index`` of ``f``: its offset in the tensor, its bytes, and those rounded up to whole
        O_DIRECT blocks."""
        off = index * self.block_bytes
        n = min(self.block_bytes, f.nbytes - off)
        return off, n, round_up(n)

    def _write_block(self, t: "_Transfer", index: int) -> None:
        f = t.file
        off, n, padded = self._block(f, index)
        stripe, at = f.locate(index, self.block_bytes)
        try:
            if n == padded and t.view is not None:  # zero copy: straight from the caller's memory
                view = t.view[off : off + n]
                if self.verify:
                    f.crcs[index] = self._checksum(view)
                self._pwrite_all(stripe, view, at, index)
                return
            with self.pool.buffer() as stage:
                _copy(stage[:n], t.data[off : off + n])
                if padded != n:
                    stage[n:padded].zero_()
                block = stage[:padded]
                if self.verify:
                    f.crcs[index] = self._checksum(block.numpy().data)
                self._pwrite_all(stripe, block.numpy().data, at, index)
        except SwapError:
            raise
        except Exception as e:  # noqa: BLE001 - reported with file and block
            raise SwapError(f"swap file {stripe.path}: writing block {index} failed: {e}") from e

    def _pwrite_all(self, stripe: Stripe, view: memoryview, at: int, index: int) -> None:
        with self._requests:
            self._pwrite_unlimited(stripe, view, at, index)

    def _pwrite_unlimited(self, stripe: Stripe, view: memoryview, at: int, index: int) -> None:
        try:
            pwrite_all(stripe.fd, view, at)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise SwapError(
                    f"swap file {stripe.path}: disk full writing block {index}: needs {len(view)} more bytes "
                    f"({stripe.file_bytes} for the file), {_free_bytes(stripe.path.parent)} bytes free on "
                    f"{stripe.path.parent.parent}"
                ) from e
            raise SwapError(f"swap file {stripe.path}: writing block {index} at offset {at} failed: {e.strerror}"
                            f"{_direct_hint(stripe, e)}") from e

    def _read_block(self, t: "_Transfer", index: int) -> None:
        f = t.file
        off, n, padded = self._block(f, index)
        stripe, at = f.locate(index, self.block_bytes)
        try:
            if n == padded and t.view is not None:  # zero copy: straight into the caller's memory
                view = t.view[off : off + n]
                self._pread_all(stripe, view, at, index)
                self._check(f, stripe, view, index)
                return
            with self.pool.buffer() as stage:
                view = stage[:padded].numpy().data
                self._pread_all(stripe, view, at, index)
                self._check(f, stripe, view, index)
                _copy(t.data[off : off + n], stage[:n])
        except SwapError:
            raise
        except Exception as e:  # noqa: BLE001
            raise SwapError(f"swap file {stripe.path}: reading block {index} failed: {e}") from e

    def _pread_all(self, stripe: Stripe, view: memoryview, at: int, index: int) -> None:
        with self._requests:
            self._pread_unlimited(stripe, view, at, index)

    def _pread_unlimited(self, stripe: Stripe, view: memoryview, at: int, index: int) -> None:
        try:
            pread_full(stripe.fd, view, at, direct=stripe.direct)
        except TruncatedFile as e:
            raise SwapError(f"swap file {stripe.path}: block {index} is truncated (end of file at offset {e.pos})") \
                from None
        except OSError as e:
            raise SwapError(f"swap file {stripe.path}: reading block {index} at offset {at} failed: {e.strerror}"
                            f"{_direct_hint(stripe, e)}") from e

    def _check(self, f: _SwapFile, stripe: Stripe, view: memoryview, index: int) -> None:
        if not self.verify:
            return
        expected = f.crcs[index]
        if expected is None:
            raise SwapError(f"swap file {stripe.path}: block {index} has no checksum (its write did not complete)")
        got = self._checksum(view)
        if got != expected:
            at = f.locate(index, self.block_bytes)[1]
            raise SwapError(
                f"swap file {stripe.path}: checksum mismatch in block {index} "
                f"(bytes {index * self.block_bytes}..{index * self.block_bytes + len(view)}"
                f"{f', at offset {at} of this file' if len(f.stripes) > 1 else ''}): "
                f"stored {self._checksum.algo} {expected:x}, read {got:x}; the data on disk is corrupt"
            )

    # -- transfers --------------------------------------------------------------

    def _plan_write(self, name: str, tensor: torch.Tensor) -> "_Transfer":
        host_access(reads=(tensor,))          # the stream checker's view of this read (runtime/exec/hb_check.py)
        src = _byte_view(tensor, f"write {name!r}")
        f = self._open(name)
        self._size(f, src.numel())
        return _Transfer(f, src)

    def _plan_read(self, name: str, out: torch.Tensor) -> "_Transfer":
        f = self._file(name, "read")
        if not f.complete:
            raise SwapError(
                f"swap read {name!r}: no complete write of it (the last write did not complete, "
                f"or the name was only reserved) ({', '.join(str(s.path) for s in f.stripes)})"
            )
        host_access(writes=(out,))
        dst = _byte_view(out, f"read {name!r}")
        if dst.numel() != f.nbytes:
            raise SwapError(
                f"swap read {name!r}: the output has {dst.numel()} bytes but {f.nbytes} were written "
                f"({', '.join(str(s.path) for s in f.stripes)})"
            )
        return _Transfer(f, dst)

    async def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s bytes to ``name``'s file; returns when all are on disk."""
        t = self._plan_write(name, tensor)
        await self._run_blocks(self._write_block, t)
        t.file.complete = True
        self.bytes_written += t.file.nbytes

    async def read(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` with the bytes last written under ``name``, checking every block."""
        t = self._plan_read(name, out)
        await self._run_blocks(self._read_block, t)
        self.bytes_read += t.file.nbytes

    def write_sync(self, name: str, tensor: torch.Tensor) -> None:
        """:meth:`write` for callers outside trio (e.g. already in a worker thread)."""
        t = self._plan_write(name, tensor)
        self._run_blocks_sync(self._write_block, t)
        t.file.complete = True
        self.bytes_written += t.file.nbytes

    def read_sync(self, name: str, out: torch.Tensor) -> None:
        """:meth:`read` for callers outside trio."""
        t = self._plan_read(name, out)
        self._run_blocks_sync(self._read_block, t)
        self.bytes_read += t.file.nbytes

    def _workers_for(self, t: "_Transfer") -> int:
        """Threads for one transfer: one per SMALL_PER_WORKER bytes, up to ``workers``. Waking a
        thread costs more than a small O_DIRECT request takes (tens of us on a quiet machine,
        milliseconds when compute holds the cores), so small transfers run on few threads."""
        return max(1, min(self.workers, t.blocks, -(-t.file.nbytes // SMALL_PER_WORKER)))

    @staticmethod
    def _drain(work: Callable, t: "_Transfer", queue: "_BlockQueue") -> None:
        """One worker: take blocks until none are left (or the transfer failed or was cancelled)."""
        while (index := queue.take()) is not None:
            try:
                work(t, index)
            except BaseException as e:  # noqa: BLE001 - handed to the caller by the queue
                queue.fail(e)
                return

    async def _run_blocks(self, work: Callable, t: "_Transfer") -> None:
        """Run a transfer on up to ``workers`` threads (one trio thread hop per
        worker, not per block: on a busy machine each hop back to the trio loop costs a
        context switch that would otherwise leave the device idle)."""
        queue = _BlockQueue(t.blocks)

        async def stop_on_cancel() -> None:
            try:
                await trio.sleep_forever()
            finally:  # cancelled: workers finish their current block and stop
                queue.stop()

        async with trio.open_nursery() as outer:
            outer.start_soon(stop_on_cancel)
            async with trio.open_nursery() as workers:
                for _ in range(self._workers_for(t)):
                    workers.start_soon(
                        partial(trio.to_thread.run_sync, self._drain, work, t, queue, limiter=self._limiter)
                    )
            outer.cancel_scope.cancel()
        if queue.error is not None:
            raise queue.error

    def _run_blocks_sync(self, work: Callable, t: "_Transfer") -> None:
        queue = _BlockQueue(t.blocks)
        if t.blocks == 1:
            self._drain(work, t, queue)
        else:
            with self._executor_lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="zdsl-swap")
            futures = [self._executor.submit(self._drain, work, t, queue)
                       for _ in range(self._workers_for(t))]
            for fut in futures:  # wait for all: no block may still use a buffer after we return
                fut.result()
        if queue.error is not None:
            raise queue.error


class _Transfer:
    """One write or read: the file, the caller's bytes, and what the workers need per block
    precomputed once (a memoryview of the whole tensor), so a block costs a
    slice, a checksum call and the system call, and little time holding the GIL."""

    __slots__ = ("file", "data", "blocks", "view")

    def __init__(self, file: _SwapFile, data: torch.Tensor):
        self.file = file
        self.data = data
        self.blocks = len(file.crcs)
        # In place from a CPU tensor starting on a 4 KiB boundary, unless it is smaller than a huge
        # page: then in no huge page of its own, and direct I/O into the staging pool's huge pages
        # and a copy took half the time (runtime/io/aligned.py). None: through the staging pool.
        zero_copy = is_aligned(data) and data.numel() >= HUGE_PAGE
        self.view = data.numpy().data if zero_copy else None


class _BlockQueue:
    """The block indices of one transfer, handed to whichever worker asks next."""

    def __init__(self, blocks: int):
        self._next = itertools.count()
        self._blocks = blocks
        self._lock = threading.Lock()
        self._stopped = False
        self.error: BaseException | None = None

    def take(self) -> int | None:
        index = next(self._next)  # atomic under the GIL: no lock on the hot path
        return None if self._stopped or index >= self._blocks else index

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            self._stopped = True

    def stop(self) -> None:
        self._stopped = True


def _direct_hint(stripe: Stripe, error: OSError) -> str:
    if stripe.direct and error.errno == errno.EINVAL:
        return (" (the filesystem accepted O_DIRECT but refused 4 KiB-aligned I/O: its block size may be"
                " larger; put the swap folder on a local disk)")
    return ""


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Byte copy between a staging buffer and a tensor (CPU or device).

    CPU-to-CPU goes through numpy: a plain memcpy that releases the GIL and
    does not fan out to torch's intra-op thread pool from inside I/O threads.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        dst.numpy()[...] = src.numpy()
    else:
        dst.copy_(src)
