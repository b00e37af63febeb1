"""A swapper's run folder in one swap folder: made private, owned under a lock, cleaned when stale.

Each run owns a subfolder ``run-<pid>-<token>`` (mode 0700) of every swap folder it uses, holding a
lock file with its pid, locked with ``flock`` for the run's lifetime. A run killed without cleanup
leaves its folder behind; the next swapper on the same folder sees the lock is no longer held (its
pid is dead), removes the folder and logs it. :meth:`RunFolder.remove` deletes the run folder, and
the swap folder too when this run created it and nothing else is in it (never a folder that was
there before, never a file it did not write).
"""
from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import structlog

from zdsl.swap_folders import folder_problem

log = structlog.get_logger("zdsl.runtime.offload.swap")

LOCK_NAME = "owner.lock"
RUN_PREFIX = "run-"


class SwapError(RuntimeError):
    """An NVMe swap operation failed; the message names the file and the cause."""


def free_bytes(path: Path) -> int:
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
    removed: list[Path] = []
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
class RunFolder:
    """This process's run folder in one swap folder."""

    folder: Path             # the swap folder (absolute)
    run_dir: Path            # folder/run-<pid>-<token>
    lock_fd: int
    made_folder: bool        # the swap folder did not exist: it goes too, if left empty

    @classmethod
    def open(cls, folder: Path) -> "RunFolder":
        """Make (if missing), clean of dead runs, and claim a run folder in ``folder``."""
        made = False
        for attempt in range(3):
            try:
                made = _make_private_dirs(folder) or made
                remove_stale_runs(folder)
                run_dir, lock_fd = _create_run_folder(folder)
                return cls(folder, run_dir, lock_fd, made)
            except FileNotFoundError:
                problem = folder_problem(folder)
                if problem is not None:
                    raise SwapError(f"swap folder {folder}: cannot use it: {problem}") from None
                if attempt == 2:  # else: a run closing as we started removed the folder it had made
                    raise SwapError(f"swap folder {folder}: it keeps disappearing while being created") \
                        from None
            except OSError as e:
                problem = folder_problem(folder)
                raise SwapError(f"swap folder {folder}: cannot create it: {problem or e.strerror or e}") from e
        raise AssertionError("unreachable")

    def remove(self) -> None:
        """Delete the run folder (and the swap folder, if this run made it and it is left empty)."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
        try:
            os.close(self.lock_fd)
        except OSError:
            pass
        if self.made_folder:
            try:
                os.rmdir(self.folder)  # only if empty: another run's folder or a user's file keeps it
            except OSError:
                pass
