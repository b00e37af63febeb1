"""A rank's half of the launcher's contract: it stops cleanly when told to, and never outlives
its launcher.

:func:`guard_rank` stops the rank cleanly on SIGTERM or SIGHUP (the zdsl launcher's stop;
torchrun's agent forwards them) and when its launcher is gone, even by SIGKILL: whatever the
rank's main thread is doing, it is gone ``RANK_DEADLINE_S`` later. Inside a trio run entered through
:func:`run_stoppable` (a rank's training, calibrate's reference steps, the race checker's steps) a
stop cancels the run, which then raises :class:`Stopped`: raised at an
arbitrary point of trio's own loop, it would break the run, and its worker threads' results
could no longer be delivered (trio prints each as an error). Every rank guards itself so:
``zdsl run``'s (``runtime/run/launch.py``), torchrun's, and the local ranks of calibrate and the
tests (``runtime/dist/spawn.py``).
"""
from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time

import trio

from zdsl import env
from zdsl.runtime.proc.board import LAUNCHER, rank_board

RANK_DEADLINE_S = 3.0    # a rank told to stop is gone by then, whatever its main thread is doing
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """This rank was told to stop (a signal, or its launcher is gone): no error of its own."""

    def __init__(self, signum: int, why: str):
        super().__init__(why)
        self.signum, self.why = signum, why


_stop: list[Stopped] = []        # set once, by the lifeline thread
_parent: list[int] = []          # the launcher's pid, as the rank began
_said = threading.Lock()
def guard_rank() -> None:
    """Stop this rank cleanly on SIGTERM or SIGHUP, or when its launcher is gone.

    Call first thing in the rank's main thread, before any other thread starts:
    the two signals are blocked in every thread and taken by a lifeline thread
    (so a main thread blocked in a collective cannot delay them), which raises
    :class:`Stopped` in the main thread and, if the rank is still there after
    ``RANK_DEADLINE_S``, ends the process itself. The launcher is the parent
    process (the zdsl launcher's pid from the board: a launcher gone before this
    ran is noticed too); under torchrun, its agent.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    for s in STOP_SIGNALS:
        signal.signal(s, _raise_stopped)
    board = rank_board()
    _parent.append(board[LAUNCHER] if board is not None else os.getppid())
    threading.Thread(target=_lifeline, name="zdsl-lifeline", daemon=True).start()


def _lifeline() -> None:
    while True:
        try:
            info = signal.sigtimedwait(STOP_SIGNALS, 0.2)
        except OSError:
            info = None
        # CPython returns an uninitialised siginfo when the wait was interrupted (EINTR) as its
        # time ran out: only one of the signals asked for is one
        if info is not None and info.si_signo in STOP_SIGNALS:
            stopped = Stopped(info.si_signo, f"stopped by {signal.Signals(info.si_signo).name}")
            break
        gone = launcher_gone()
        if gone is not None:
            stopped = gone
            break
    _stop.append(stopped)
    _thread.interrupt_main(signal.Signals(stopped.signum))       # runs _raise_stopped in the main thread
    time.sleep(RANK_DEADLINE_S)
    try:                                         # the main thread did not get out in time
        report_stop(stopped)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(128 + stopped.signum)


_cancel: list = []               # while run_stoppable runs: how a stop reaches its trio run


def _raise_stopped(signum, frame):
    stopped = _stop[0] if _stop else Stopped(signum, f"stopped by {signal.Signals(signum).name}")
    if _cancel:
        if not _stop:
            _stop.append(stopped)
        with contextlib.suppress(trio.RunFinishedError):
            _cancel[0]()                     # the run stops at its next checkpoint and raises it
            return
    raise stopped


async def run_stoppable(fn, *args):
    """``await fn(*args)``, cancelled by a stop (which it then raises as :class:`Stopped`) rather
    than interrupted wherever the main thread happens to be. For ``trio.run``."""
    token = trio.lowlevel.current_trio_token()
    with trio.CancelScope() as scope:
        _cancel.append(lambda: token.run_sync_soon(scope.cancel))
        try:
            return await fn(*args)
        finally:
            _cancel.clear()
    raise _stop[0]                      # only a stop cancels the scope


def launcher_gone() -> Stopped | None:
    if _parent and os.getppid() != _parent[0]:
        return Stopped(signal.SIGTERM, f"stopped: its launcher (pid {_parent[0]}) is gone")
    return None


def stop_requested() -> Stopped | None:
    """Why this rank was told to stop, if it was (an error raised while stopping is no error; nor is
    one raised because the launcher is gone, which the lifeline may not have seen yet)."""
    return _stop[0] if _stop else launcher_gone()


def report_stop(stopped: Stopped | KeyboardInterrupt) -> int:
    """Say once why this rank stopped; returns its exit status. Under the zdsl launcher, which says
    it for all ranks, only the error file hears it, unless the launcher is gone."""
    rank = env.raw("RANK") or "?"
    if isinstance(stopped, KeyboardInterrupt):
        code, text = 128 + signal.SIGINT, f"rank {rank}: interrupted"
    else:
        code, text = 128 + stopped.signum, f"rank {rank}: {stopped.why}"
    if not _said.acquire(blocking=False):
        return code
    error_file = env.get("ZDSL_ERROR_FILE")
    launcher_gone = isinstance(stopped, Stopped) and "launcher" in stopped.why
    if error_file and not launcher_gone:
        try:
            with open(error_file, "w") as f:
                f.write(text)
            return code
        except OSError:
            pass
    try:
        print(f"zdsl: {text}", file=sys.stderr, flush=True)
    except OSError:                  # the terminal went with the launcher
        pass
    return code
