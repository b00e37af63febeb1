"""Local ranks: one fresh process per rank on this machine, and what each returned.

The one rank start-up of ``zdsl calibrate`` and the tests' DDP harness. Each rank is a new
Python (multiprocessing's ``spawn``: no torch state is inherited) that runs
``fn(rank, world, *args)`` with the variables torchrun would set (:func:`rank_env`), so it joins
its group from the environment. Its return value, or its error and traceback, comes back
through a file, so a rank that fails is named with its own words.

A rank never outlives its parent: it guards itself as every zdsl rank does
(:func:`zdsl.runtime.proc.guard.guard_rank`: SIGTERM, SIGHUP or its parent gone, even by
SIGKILL, stop it within seconds), and the ranks still running when the caller leaves
:class:`LocalRanks`, or after one failed, are stopped.

``zdsl run``'s launcher (``runtime/run/launch.py``) starts commands rather than functions and
watches them through progress boards; it shares :func:`free_port`, :func:`rank_env`,
:func:`describe_exit` and ``STOP_WAIT_S``.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.process import BaseProcess
from pathlib import Path

from zdsl import env
from zdsl.runtime.proc.guard import guard_rank

MASTER_ADDR = "127.0.0.1"
STOP_WAIT_S = 4.0        # after SIGTERM to a rank, before SIGKILL (the launcher's too)
JOIN_POLL_S = 0.05


def free_port() -> int:
    """A loopback TCP port that nothing listens on now: the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind((MASTER_ADDR, 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for ``rank`` of ``world`` ranks, all on this machine."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(port))


class RankFailed(RuntimeError):
    """A spawned rank raised (``error``: its exception in one line, and its traceback), or died
    without a result (``error`` None)."""

    def __init__(self, rank: int, error: str | None, details: str):
        super().__init__(f"rank {rank} failed:\n{details}" if error is not None else details)
        self.rank, self.error = rank, error


class LocalRanks:
    """Ranks ``first``..``world - 1`` of ``fn``, started on entering and stopped on leaving.

    ``first=1`` leaves rank 0 to the caller's own process, which then joins the group at
    ``tcp://MASTER_ADDR:port`` without rank variables of its own (``port``: the one it gives
    its ranks too; default a free one).
    """

    def __init__(self, fn, world: int, args: tuple = (), *, first: int = 0, port: int | None = None):
        self.fn, self.world, self.args, self.first = fn, world, args, first
        self.port = free_port() if port is None else port
        self.procs: dict[int, BaseProcess] = {}
        self._folder: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> LocalRanks:
        self._folder = tempfile.TemporaryDirectory(prefix="zdsl-ranks-")
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(self.first, self.world):
                proc = ctx.Process(target=_rank_main, name=f"rank{rank}",
                                   args=(self.fn, rank, self.world, self.port, self.args, str(self._result(rank)),
                                         os.getpid()))
                proc.start()
                self.procs[rank] = proc
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop(list(self.procs.values()))
        if self._folder is not None:
            self._folder.cleanup()

    def _result(self, rank: int) -> Path:
        assert self._folder is not None, "the ranks start on entering, which makes the folder"
        return Path(self._folder.name) / f"rank{rank}.pickle"

    def join(self, timeout_s: float | None = None) -> dict[int, object]:
        """Each rank's return value once all have exited (or ``timeout_s`` passed: the ones still
        running have none). The first rank seen to fail raises :class:`RankFailed`, after the
        others are stopped (they would wait for it in their collectives)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            running = [rank for rank, p in self.procs.items() if p.exitcode is None]
            failed = [rank for rank, p in self.procs.items() if p.exitcode not in (None, 0)]
            if failed:
                stop(list(self.procs.values()))
                raise self.failure(failed[0])
            if not running or (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(JOIN_POLL_S)
        return {rank: self._returned(rank) for rank, p in self.procs.items() if p.exitcode == 0}

    def _returned(self, rank: int) -> object:
        """What a rank that exited cleanly returned; :class:`RankFailed` when its result is
        missing or unreadable."""
        record = self._record(rank)
        if record is None or "ok" not in record:
            raise self.failure(rank)
        return record["ok"]

    def failures(self, wait_s: float = 0.5) -> list[RankFailed]:
        """The ranks that failed so far, waiting up to ``wait_s`` for more to end (a peer that
        failed first is often what broke the caller's collective)."""
        deadline = time.monotonic() + wait_s
        while any(p.exitcode is None for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(JOIN_POLL_S)
        return [self.failure(rank) for rank, p in self.procs.items() if p.exitcode not in (None, 0)]

    def failure(self, rank: int) -> RankFailed:
        record = self._record(rank)
        if record is None or "error" not in record:
            code = self.procs[rank].exitcode
            ended = f"rank {rank} is still running" if code is None else describe_exit(rank, code)
            return RankFailed(rank, None, f"{ended}, without a result")
        return RankFailed(rank, record["error"], record["traceback"])

    def _record(self, rank: int) -> dict | None:
        try:
            with open(self._result(rank), "rb") as f:
                return pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None


def run_ranks(fn, world: int, *args) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` local ranks; the results by rank.

    ``fn`` must be importable (a module-level function), and so must what it returns."""
    with LocalRanks(fn, world, args) as ranks:
        results = ranks.join()
    return [results[rank] for rank in range(world)]


def stop(procs: list[BaseProcess]) -> None:
    """SIGTERM to the ranks still running, SIGKILL to those not gone ``STOP_WAIT_S`` later."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + STOP_WAIT_S
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def describe_exit(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} was killed by signal {signal.Signals(-code).name}"
    return f"rank {rank} exited with status {code}"


def _rank_main(fn, rank: int, world: int, port: int, args: tuple, result: str, parent: int) -> None:
    """A spawned rank: guarded like every zdsl rank, its variables set, ``fn``'s outcome written."""
    guard_rank()                        # first, before any thread starts
    if os.getppid() != parent:          # the parent was gone before the guard began to watch it
        os._exit(1)
    env.export(**rank_env(rank, world, port))          # written for this rank, as a launcher would
    try:
        record = {"ok": fn(rank, world, *args)}
        data = pickle.dumps(record)
    except BaseException as exc:        # noqa: BLE001 - the parent reports it, with the traceback
        record = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        data = pickle.dumps(record)
    with open(result, "wb") as f:
        f.write(data)
    # As `zdsl run`'s ranks do: leave without interpreter teardown, where torch's C++ statics
    # (gloo's threads) can abort a rank that finished cleanly ("terminate called without an
    # active exception", seen once in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if "ok" in record else 1)
