"""Same-host 2-rank collectives through shared memory, in place of gloo's TCP.

Two ranks of one host that talk through gloo move every byte user -> socket ->
user: two kernel copies, syscalls and gloo's loop threads, all on the one core
a rank has. Here each rank of a 2-rank group has an *outbox*: a shared-memory
segment of ``SLOTS`` slots of ``SLOT_BYTES``, mapped by both ranks. A
collective is cut into slot-size pieces; for each piece a rank copies what
its peer needs into its outbox once, and reads the peer's piece straight from
the peer's outbox into its result (reduce-scatter: ``out = mine + peer's`` in
one pass; all-gather: a copy into the peer's chunk; all-reduce: ``t += peer's``).

Doorbells are POSIX named semaphores (``_multiprocessing.SemLock``): per
outbox, ``ready`` (a piece is written) and ``free`` (a slot was read and may
be written again; starts at ``SLOTS``, so a rank writes ahead by one piece
while its peer reads). Waits sleep in ``sem_timedwait``, never spin; they wake
every ``POLL_S`` to see whether the peer process still exists, and give up
after the group's timeout, naming the collective. After the first failure the
pair is broken: every later collective on it fails with that error.

Collectives run in issue order on one worker thread per pair (both ranks issue
them in the same order); the caller gets a :class:`Pending` whose completion
callbacks run on that thread, as gloo's run on its own.

Nothing outlives the ranks: segments and semaphores are unlinked as soon as
both ranks have opened them (the mappings stay valid), during the pair's
set-up. Each rank adds ``SHARED_MEMORY_OUTBOX`` (8 MiB) of shared memory, counted in its planned
host memory (zdsl/planner/machine_fit.py).

At 2 ranks a + b == b + a, so the results are the bits gloo gives.
"""
from __future__ import annotations

import _multiprocessing
import mmap
import os
import queue
import secrets
import socket
import threading
import time
import weakref

import torch
import torch.distributed as dist

from zdsl.runtime.dist.affinity import LOOP_POLICIES, loop_policy_wanted
from zdsl.schedule import SHARED_MEMORY_OUTBOX

SLOTS = 2
SLOT_BYTES = SHARED_MEMORY_OUTBOX // SLOTS     # the planner counts the outbox in a rank's host memory
POLL_S = 1.0                 # a waiting rank looks this often whether its peer process still exists
SHM_DIR = "/dev/shm"
_SEMAPHORE = 1               # _multiprocessing's kind for a counting semaphore


class SharedMemoryError(RuntimeError):
    """A collective through shared memory failed: its peer died or did not come within the group's
    timeout, or the pair broke in an earlier collective (every later one fails with that error)."""


class _Outbox:
    """One rank's segment and its two doorbells, created by ``create`` or opened by ``open``."""

    def __init__(self, name: str, buf: mmap.mmap, ready, free):
        self.name, self.buf, self.ready, self.free = name, buf, ready, free
        self.bytes = torch.frombuffer(buf, dtype=torch.uint8)

    @classmethod
    def create(cls, name: str) -> "_Outbox":
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, SLOTS * SLOT_BYTES)
            buf = mmap.mmap(fd, SLOTS * SLOT_BYTES)
        finally:
            os.close(fd)
        try:
            ready = _multiprocessing.SemLock(_SEMAPHORE, 0, SLOTS, f"/{name}-ready", False)
            free = _multiprocessing.SemLock(_SEMAPHORE, SLOTS, SLOTS, f"/{name}-free", False)
        except BaseException:
            cls.unlink(name)
            raise
        return cls(name, buf, ready, free)

    @classmethod
    def open(cls, name: str) -> "_Outbox":
        fd = os.open(_path(name), os.O_RDWR)
        try:
            buf = mmap.mmap(fd, SLOTS * SLOT_BYTES)
        finally:
            os.close(fd)
        ready = _multiprocessing.SemLock._rebuild(0, _SEMAPHORE, SLOTS, f"/{name}-ready")
        free = _multiprocessing.SemLock._rebuild(0, _SEMAPHORE, SLOTS, f"/{name}-free")
        return cls(name, buf, ready, free)

    @staticmethod
    def unlink(name: str) -> None:
        """Remove the names (idempotent); mappings and open semaphores stay valid."""
        for remove, what in ((os.unlink, _path(name)), (_multiprocessing.sem_unlink, f"/{name}-ready"),
                             (_multiprocessing.sem_unlink, f"/{name}-free")):
            try:
                remove(what)
            except OSError:
                pass

    def slot(self, i: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        start = (i % SLOTS) * SLOT_BYTES
        return self.bytes[start:start + SLOT_BYTES].view(dtype)[:n]


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class Pair:
    """The shared-memory link of this rank and its one peer in a 2-rank group."""

    def __init__(self, me: int, peer_rank: int, peer_pid: int, mine: _Outbox, peer: _Outbox, timeout_s: float):
        # me: this rank's index in the group (its chunk); peer_rank: the peer's global rank, for errors
        self.me, self.peer_rank, self.peer_pid = me, peer_rank, peer_pid
        self.mine, self.peer, self.timeout_s = mine, peer, timeout_s
        self.pieces = 0                  # pieces exchanged so far: the slot of the next one
        self.broken: BaseException | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="zdsl_shm", daemon=True)
        self._thread.start()

    # -- the collectives (called by runtime/dist/collectives.py) ------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> torch.futures.Future:
        chunks, me = out.view(2, -1), self.me

        def run():
            chunks[me].copy_(inp)
            into = chunks[1 - me]
            self._swap("all_gather", inp, lambda piece, lo, hi: into[lo:hi].copy_(piece))
        return self._submit(run)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> torch.futures.Future:
        chunks, me = inp.view(2, -1), self.me
        mine = chunks[me]
        return self._submit(lambda: self._swap(
            "reduce_scatter", chunks[1 - me], lambda piece, lo, hi: torch.add(mine[lo:hi], piece, out=out[lo:hi])))

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        flat = tensor.view(-1)
        return self._submit(lambda: self._swap("all_reduce", flat, lambda piece, lo, hi: flat[lo:hi].add_(piece)))

    # -- the machinery -----------------------------------------------------------------------
    def _swap(self, what: str, send: torch.Tensor, take) -> None:
        """Give the peer ``send`` piece by piece; ``take(peer_piece, lo, hi)`` each piece of the peer's
        (the same length: both ranks run the same collective)."""
        step = SLOT_BYTES // send.element_size()
        for lo in range(0, send.numel(), step):
            hi = min(lo + step, send.numel())
            n, i = hi - lo, self.pieces
            self._wait(self.mine.free, what, "did not read this rank's last piece")
            self.mine.slot(i, send.dtype, n).copy_(send[lo:hi])
            self.mine.ready.release()
            self._wait(self.peer.ready, what, "did not send its piece")
            take(self.peer.slot(i, send.dtype, n), lo, hi)
            self.peer.free.release()
            self.pieces += 1

    def _wait(self, sem, what: str, why: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not sem.acquire(True, POLL_S):
            if not _alive(self.peer_pid):
                raise SharedMemoryError(f"{what} through shared memory: peer rank {self.peer_rank} "
                                        f"(pid {self.peer_pid}) is gone")
            if time.monotonic() > deadline:
                raise SharedMemoryError(f"{what} through shared memory: peer rank {self.peer_rank} {why} within the "
                                        f"group's timeout of {self.timeout_s:g} s")

    def _submit(self, run) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self._jobs.put([run, future])
        return future

    def _serve(self) -> None:
        _calm_this_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(job)

    def _run(self, job: list) -> None:
        """Run one collective. Its closure (and the tensors it holds) is dropped before the future
        completes: the caller may free those buffers at once, and the buffer table gives a block
        back to the host pool only when nothing else refers to its memory."""
        run, future = job
        job.clear()
        try:
            if self.broken is not None:
                raise SharedMemoryError(str(self.broken))
            run()
        except BaseException as exc:  # noqa: BLE001 - the caller's wait() raises it
            run = None
            if not isinstance(exc, SharedMemoryError):
                exc = SharedMemoryError(f"{type(exc).__name__}: {exc}")
            if self.broken is None:
                self.broken = exc
            future.set_exception(exc)
            return
        run = None
        future.set_result(None)

    def close(self) -> None:
        """Stop the worker after the collectives already issued."""
        self._jobs.put(None)


def _calm_this_thread() -> None:
    """Give the worker gloo's loop policy (runtime/dist/affinity.py: SCHED_BATCH unless set), so its
    wake-ups do not preempt the compute it shares the rank's core with."""
    policy = LOOP_POLICIES.get(loop_policy_wanted())
    if policy is not None and hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(threading.get_native_id(), policy, os.sched_param(0))
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


# group -> its Pair, or None where shared memory cannot serve it (every rank agreed)
_pairs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_pairs_lock = threading.Lock()


def pair_of(group) -> Pair | None:
    """The shared-memory pair of a 2-rank gloo ``group`` (None: the default group), set up on first use
    (a collective call of both ranks: call it at the same point of both ranks' issue order); None
    where the ranks are on different hosts, cannot share a segment, or the group is not 2 ranks."""
    pg = dist.group.WORLD if group is None else group
    with _pairs_lock:
        if pg in _pairs:
            return _pairs[pg]
    pair = _set_up(pg)
    with _pairs_lock:
        _pairs[pg] = pair
    if pair is not None:
        weakref.finalize(pg, pair.close)
    return pair


def release_all() -> None:
    """Close every pair (their workers end after the collectives issued) and forget them: called as a
    process leaves its groups, so a process that joins one group after another (``zdsl run
    --variants``) holds one pair's segments and worker at a time, not one per group until collected."""
    with _pairs_lock:
        pairs = [p for p in _pairs.values() if p is not None]
        _pairs.clear()
    for pair in pairs:
        pair.close()


def _set_up(pg) -> Pair | None:
    if dist.get_world_size(pg) != 2:
        return None
    rank = dist.get_rank(pg)
    name = f"zdsl-shm-{os.getpid()}-{secrets.token_hex(6)}"
    mine = peer = peer_name = None
    try:
        mine = _Outbox.create(name)
    except (OSError, ValueError):
        pass
    try:
        said = _all_gather_object(pg, (socket.gethostname(), os.getpid(), mine.name if mine else None))
        peer_host, peer_pid, peer_name = said[1 - rank]
        if mine is not None and peer_name is not None and peer_host == socket.gethostname() and _alive(peer_pid):
            try:
                peer = _Outbox.open(peer_name)
            except (OSError, ValueError):
                peer = None
        both = _all_gather_object(pg, peer is not None)     # both opened: the names may go
    finally:
        # both ranks remove both names, so a peer that died during the set-up leaves none either
        for made in (name if mine is not None else None, peer_name):
            if made is not None and made.startswith("zdsl-shm-") and "/" not in made:
                _Outbox.unlink(made)
    if not all(both) or mine is None or peer is None:     # all(both): this rank opened both
        return None
    peer_rank = 1 - rank if pg is dist.group.WORLD else dist.get_global_rank(pg, 1 - rank)
    return Pair(rank, peer_rank, peer_pid, mine, peer, group_timeout(pg))


def _all_gather_object(pg, obj) -> list:
    every = [None, None]
    dist.all_gather_object(every, obj, group=pg)
    return every


def group_timeout(pg) -> float:
    """Seconds a collective of ``pg`` waits for a peer (the group's own timeout)."""
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):   # a torch without the private field: gloo's default
        return dist.distributed_c10d._get_default_timeout(dist.Backend(dist.Backend.GLOO)).total_seconds()
