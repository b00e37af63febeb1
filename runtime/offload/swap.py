"""The NVMe tier: named tensors swapped to files with direct, verified, parallel I/O.

- One file per buffer name, opened with ``O_DIRECT`` (runtime/io/directio.py): the page cache
  would double the host memory used and evict what training needs. Where a filesystem refuses
  ``O_DIRECT`` (tmpfs), buffered I/O is used and a warning is logged once.
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
- Each run owns a subfolder ``run-<pid>-<token>`` (mode 0700) holding a lock file with its pid,
  locked with ``flock`` for the run's lifetime. A run killed without cleanup leaves its folder
  behind; the next Swapper on the same folder sees the lock is no longer held (its pid is dead),
  removes the folder and logs it. ``close()`` (also via ``with``, and at interpreter exit)
  removes the run folder, and the swap folder too when this Swapper created it and nothing else
  is in it (never a folder that was there before, never a file it did not write).

Measurements behind these choices: benchmarks/README.md (NVMe swap).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import secrets
import shutil
import socket
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import structlog
import torch
import trio

from zdsl.runtime.exec.host_access import host_access
from zdsl.runtime.io import checksum
from zdsl.runtime.io.aligned import ALIGN, HUGE_PAGE, AlignedPool, is_aligned, round_up
from zdsl.runtime.io.directio import TruncatedFile, open_direct, pread_full, pwrite_all

log = structlog.get_logger("zdsl.runtime.offload.swap")

LOCK_NAME = "owner.lock"
RUN_PREFIX = "run-"
SMALL_PER_WORKER = 1 << 20   # bytes a transfer needs per worker thread (see Swapper._workers_for)


class SwapError(RuntimeError):
    """An NVMe swap operation failed; the message names the file and the cause."""


# ----------------------------------------------------------------------------
# run folder: creation, ownership lock, stale-run cleanup
# ----------------------------------------------------------------------------


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_owner(lock_path: Path) -> tuple[int, str] | None:
    try:
        pid_text, host = lock_path.read_text().split()[:2]
        return int(pid_text), host
    except (OSError, ValueError):
        return None


def _owner_is_dead(lock_path: Path, pid: int) -> bool:
    """A run is dead if nobody holds its lock (the kernel drops it when the
    process dies, whatever the pid is reused for). Where ``flock`` is not
    supported, fall back to asking whether the pid is alive."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return not _pid_alive(pid)
    finally:
        os.close(fd)  # also releases the lock we may have taken
    return True


def remove_stale_runs(folder: Path) -> list[Path]:
    """Delete run folders under ``folder`` left by dead runs on this host; return them."""
    removed = []
    host = socket.gethostname()
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for run in entries:
        if not run.name.startswith(RUN_PREFIX) or not run.is_dir():
            continue
        owner = _read_owner(run / LOCK_NAME)
        if owner is None:
            continue  # not ours to judge: no readable lock file
        pid, owner_host = owner
        if owner_host != host or not _owner_is_dead(run / LOCK_NAME, pid):
            continue
        size = sum(f.stat().st_size for f in run.iterdir() if f.is_file())
        shutil.rmtree(run, ignore_errors=True)
        log.warning("swap.stale_run_removed", path=str(run), dead_pid=pid, bytes=size)
        removed.append(run)
    return removed


def _make_private_dirs(folder: Path) -> bool:
    """Create ``folder`` and any missing parents with mode 0700; whether this call created ``folder``.

    Folders that already exist keep their mode (the user may have pointed us
    at a shared scratch root); every run folder inside is 0700 regardless.
    Another rank creating the same folder at the same moment is fine.
    """
    missing = []
    path = folder
    while not path.exists():
        missing.append(path)
        path = path.parent
    created = False
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
        created = path == folder
    return created


def _create_run_folder(folder: Path) -> tuple[Path, int]:
    """Make ``folder/run-<pid>-<token>`` (0700) holding a locked lock file.

    Built under a hidden name and renamed, so another process scanning for
    stale runs never sees a run folder without its held lock.
    """
    token = secrets.token_hex(4)
    staging = folder / f".creating-{os.getpid()}-{token}"
    staging.mkdir(mode=0o700)
    os.chmod(staging, 0o700)
    lock_fd = os.open(staging / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # no flock here: staleness falls back to the pid check
    os.write(lock_fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    run = folder / f"{RUN_PREFIX}{os.getpid()}-{token}"
    os.rename(staging, run)
    return run, lock_fd


@dataclass
class _SwapFile:
    """One buffer's file: how it is opened, how large it is, and its block checksums."""

    path: Path
    fd: int
    direct: bool
    nbytes: int = 0  # logical size of the tensor last written
    file_bytes: int = 0  # size reserved on disk (padded to 4 KiB)
    crcs: list[int | None] = field(default_factory=list)
    complete: bool = False  # False from the start of a write until all its blocks are on disk


class _RunState:
    """What cleanup needs, kept apart from the Swapper so a finalizer can hold it."""

    def __init__(self, run_dir: Path, lock_fd: int, made_folder: bool = False):
        self.run_dir = run_dir
        self.lock_fd = lock_fd
        self.made_folder = made_folder  # the swap folder did not exist: it goes too, if left empty
        self.owner_pid = os.getpid()
        self.files: dict[str, _SwapFile] = {}
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.owner_pid:
            return  # a forked child exiting: the run (and its folder) belongs to the parent
        for f in self.files.values():
            try:
                os.close(f.fd)
            except OSError:
                pass
        self.files.clear()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        try:
            os.close(self.lock_fd)
        except OSError:
            pass
        if self.made_folder:
            try:
                os.rmdir(self.run_dir.parent)  # only if empty: another run's folder or a user's file keeps it
            except OSError:
                pass


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
    """Swap named tensors to files under ``folder``.

    ``await write(name, tensor)`` / ``await read(name, out)`` run in trio;
    ``write_sync`` / ``read_sync`` do the same from plain threads. A name
    may be rewritten with a tensor of another size (its file is resized).
    ``verify=False`` skips the per-block checksum (CRC-32C, see runtime/io/checksum.py:
    it costs well under the disk's time, so it is on by default).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        block_bytes: int = 1 << 20,
        queue_depth: int = 8,
        *,
        verify: bool = True,
        pin: bool | None = None,
    ):
        if block_bytes <= 0 or block_bytes % ALIGN:
            raise SwapError(f"swap: block size must be a positive multiple of {ALIGN} bytes, got {block_bytes}")
        if queue_depth <= 0:
            raise SwapError(f"swap: queue depth must be positive, got {queue_depth}")
        self.folder = Path(folder).absolute()
        self.block_bytes = block_bytes
        self.queue_depth = queue_depth
        self.verify = verify
        self._checksum = checksum.DEFAULT
        made = False
        for attempt in range(3):
            try:
                made = _make_private_dirs(self.folder) or made
                remove_stale_runs(self.folder)
                run_dir, lock_fd = _create_run_folder(self.folder)
                break
            except FileNotFoundError:
                if attempt == 2:  # else: a run closing as we started removed the folder it had made
                    raise SwapError(f"swap folder {self.folder}: it keeps disappearing while being created") \
                        from None
            except OSError as e:
                raise SwapError(f"swap folder {self.folder}: cannot create it: {e.strerror or e}") from e
        self._state = _RunState(run_dir, lock_fd, made)
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
        log.debug("swap.open", run_dir=str(run_dir), block_bytes=block_bytes, queue_depth=queue_depth)

    # -- lifetime -------------------------------------------------------------

    @property
    def run_dir(self) -> Path:
        return self._state.run_dir

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Close every file and remove the run folder (and the folder, if this Swapper made it and it
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

    def path(self, name: str) -> Path:
        return self._file(name, "path").path

    def direct(self, name: str) -> bool:
        """Whether ``name``'s file does direct I/O (False where O_DIRECT was refused)."""
        return self._file(name, "direct").direct

    def _file(self, name: str, what: str) -> _SwapFile:
        if self._state.closed:
            raise SwapError(f"swap {what} {name!r}: the swapper is closed")
        try:
            return self._state.files[name]
        except KeyError:
            raise SwapError(f"swap {what} {name!r}: nothing was written under this name in {self.run_dir}") from None

    def _open(self, name: str) -> _SwapFile:
        if self._state.closed:
            raise SwapError(f"swap write {name!r}: the swapper is closed")
        f = self._state.files.get(name)
        if f is not None:
            return f
        safe = "".join(c if c.isalnum() or c in "._-@[]" else "_" for c in name)
        self._opened += 1  # a counter, not len(files): names stay unique after discard()
        path = self.run_dir / f"{safe}-{self._opened - 1}.swap"
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            fd, direct = open_direct(path, flags, 0o600)
        except OSError as e:
            raise SwapError(f"swap file {path}: cannot open: {e.strerror}") from e
        if not direct:
            if not self._warned_buffered:
                self._warned_buffered = True
                log.warning("swap.buffered_io", path=str(path), reason="O_DIRECT refused by this filesystem")
        f = _SwapFile(path, fd, direct)
        self._state.files[name] = f
        return f

    def _size(self, f: _SwapFile, nbytes: int) -> None:
        """Give ``f`` room for ``nbytes``: preflight free space, then reserve it on disk."""
        file_bytes = round_up(nbytes)
        if file_bytes > f.file_bytes:
            grow = file_bytes - f.file_bytes
            free = _free_bytes(self.run_dir)
            if grow > free:
                raise SwapError(
                    f"swap file {f.path}: disk full: needs {grow} more bytes "
                    f"({file_bytes} in all), {free} bytes free on {self.folder}"
                )
            try:
                os.posix_fallocate(f.fd, f.file_bytes, grow)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise SwapError(
                        f"swap file {f.path}: disk full: needs {grow} more bytes, "
                        f"{_free_bytes(self.run_dir)} bytes free on {self.folder}"
                    ) from e
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise SwapError(f"swap file {f.path}: cannot size to {file_bytes} bytes: {e.strerror}") from e
        elif file_bytes < f.file_bytes:
            os.ftruncate(f.fd, file_bytes)
        f.file_bytes = file_bytes
        f.nbytes = nbytes
        f.crcs = [None] * ((nbytes + self.block_bytes - 1) // self.block_bytes)
        f.complete = False

    def reserve(self, sizes: Mapping[str, int]) -> None:
        """Size the files for ``sizes`` (name -> bytes) now, so a disk too small
        for all of them fails before training starts, not in the middle."""
        files = self._state.files
        total = sum(round_up(n) - (files[k].file_bytes if k in files else 0) for k, n in sizes.items())
        free = _free_bytes(self.run_dir)
        if total > free:
            raise SwapError(f"swap folder {self.folder}: disk full: needs {total} bytes, {free} bytes free")
        for name, n in sizes.items():
            f = self._open(name)
            if f.nbytes != n or not f.crcs:
                self._size(f, n)

    def discard(self, name: str) -> None:
        """Forget ``name`` and delete its file."""
        f = self._state.files.pop(name, None)
        if f is not None:
            os.close(f.fd)
            f.path.unlink(missing_ok=True)

    # -- per-block work (runs in worker threads) ----------------------------------

    def _block(self, f: _SwapFile, index: int) -> tuple[int, int, int]:
        """Block ``index`` of ``f``: its offset, its bytes, and those rounded up to whole O_DIRECT blocks."""
        off = index * self.block_bytes
        n = min(self.block_bytes, f.nbytes - off)
        return off, n, round_up(n)

    def _write_block(self, t: "_Transfer", index: int) -> None:
        f = t.file
        off, n, padded = self._block(f, index)
        try:
            if n == padded and t.zero_copy:  # straight from the caller's memory
                view = t.view[off : off + n]
                if self.verify:
                    f.crcs[index] = self._checksum(view)
                self._pwrite_all(f, view, off, index)
                return
            with self.pool.buffer() as stage:
                _copy(stage[:n], t.data[off : off + n])
                if padded != n:
                    stage[n:padded].zero_()
                block = stage[:padded]
                if self.verify:
                    f.crcs[index] = self._checksum(memoryview(block.numpy()))
                self._pwrite_all(f, memoryview(block.numpy()), off, index)
        except SwapError:
            raise
        except Exception as e:  # noqa: BLE001 - reported with file and block
            raise SwapError(f"swap file {f.path}: writing block {index} failed: {e}") from e

    def _pwrite_all(self, f: _SwapFile, view: memoryview, off: int, index: int) -> None:
        with self._requests:
            self._pwrite_unlimited(f, view, off, index)

    def _pwrite_unlimited(self, f: _SwapFile, view: memoryview, off: int, index: int) -> None:
        try:
            pwrite_all(f.fd, view, off)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise SwapError(
                    f"swap file {f.path}: disk full writing block {index}: needs {len(view)} more bytes "
                    f"({f.file_bytes} for the file), {_free_bytes(self.run_dir)} bytes free on {self.folder}"
                ) from e
            raise SwapError(f"swap file {f.path}: writing block {index} at offset {off} failed: {e.strerror}"
                            f"{_direct_hint(f, e)}") from e

    def _read_block(self, t: "_Transfer", index: int) -> None:
        f = t.file
        off, n, padded = self._block(f, index)
        try:
            if n == padded and t.zero_copy:  # straight into the caller's memory
                view = t.view[off : off + n]
                self._pread_all(f, view, off, index)
                self._check(f, view, index)
                return
            with self.pool.buffer() as stage:
                view = memoryview(stage[:padded].numpy())
                self._pread_all(f, view, off, index)
                self._check(f, view, index)
                _copy(t.data[off : off + n], stage[:n])
        except SwapError:
            raise
        except Exception as e:  # noqa: BLE001
            raise SwapError(f"swap file {f.path}: reading block {index} failed: {e}") from e

    def _pread_all(self, f: _SwapFile, view: memoryview, off: int, index: int) -> None:
        with self._requests:
            self._pread_unlimited(f, view, off, index)

    def _pread_unlimited(self, f: _SwapFile, view: memoryview, off: int, index: int) -> None:
        try:
            pread_full(f.fd, view, off, direct=f.direct)
        except TruncatedFile as e:
            raise SwapError(f"swap file {f.path}: block {index} is truncated (end of file at offset {e.pos})") \
                from None
        except OSError as e:
            raise SwapError(f"swap file {f.path}: reading block {index} at offset {off} failed: {e.strerror}"
                            f"{_direct_hint(f, e)}") from e

    def _check(self, f: _SwapFile, view: memoryview, index: int) -> None:
        if not self.verify:
            return
        expected = f.crcs[index]
        if expected is None:
            raise SwapError(f"swap file {f.path}: block {index} has no checksum (its write did not complete)")
        got = self._checksum(view)
        if got != expected:
            raise SwapError(
                f"swap file {f.path}: checksum mismatch in block {index} "
                f"(bytes {index * self.block_bytes}..{index * self.block_bytes + len(view)}): "
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
                f"or the name was only reserved) ({f.path})"
            )
        host_access(writes=(out,))
        dst = _byte_view(out, f"read {name!r}")
        if dst.numel() != f.nbytes:
            raise SwapError(
                f"swap read {name!r}: the output has {dst.numel()} bytes but {f.nbytes} were written ({f.path})"
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

    __slots__ = ("file", "data", "blocks", "zero_copy", "view")

    def __init__(self, file: _SwapFile, data: torch.Tensor):
        self.file = file
        self.data = data
        self.blocks = len(file.crcs)
        # In place from a CPU tensor starting on a 4 KiB boundary, unless it is smaller than a huge
        # page: then in no huge page of its own, and direct I/O into the staging pool's huge pages
        # and a copy took half the time (runtime/io/aligned.py).
        self.zero_copy = is_aligned(data) and data.numel() >= HUGE_PAGE
        self.view = memoryview(data.numpy()) if self.zero_copy else None


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


def _direct_hint(f: _SwapFile, error: OSError) -> str:
    if f.direct and error.errno == errno.EINVAL:
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
