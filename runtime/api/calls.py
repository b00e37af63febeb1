"""The ranks agree on each call of the engine before it takes effect.

Every call of the engine that touches the step graph or collectives (``engine(x)``, ``backward``,
``step`` at the boundary, an evaluation, ``gathered``, ``state_dict``, checkpoints) first
all-gathers a row ``(call, step, micro-batch, problem?)`` over a gloo group of its own (so it
never interleaves with the step's collectives on the default group, which run meanwhile on the
engine's trio thread). Then, on every rank alike:

* a rank that found a problem with its own call (a misuse, a failed step) makes every rank
  raise its message, named with its rank: no rank goes on to wait for one that will not come;
* ranks making different calls (one calls ``backward`` while another calls ``engine(x)``)
  raise a message that names each rank and its call;
* a rank that makes no call within the collective timeout (stopped, or stuck in its own code)
  makes the others raise after that timeout, saying so.

In each case the call has had no effect on any rank. A world of one rank checks nothing.

Under a zdsl launcher each rank also writes on its progress board (``runtime/proc/board.py``)
which call it is in, from the call's start until it returns (:func:`engine_call`), and its last
call, so that the launcher names a rank that hangs with its call, or as in its own code after one.
"""
from __future__ import annotations

import datetime
import functools
import threading
from typing import Callable, TypeVar, cast

import torch
import torch.distributed as dist

from zdsl.errors import ZdslApiError
from zdsl.runtime.dist.collectives import all_gather
from zdsl.runtime.proc.board import CALL, CALL_MICRO, CALL_STEP, CALLS_MADE, LAST_CALL, TIMEOUT_MS, rank_board
from zdsl.runtime.proc.board import ENGINE_CALLS as CALLS  # the calls, by code (the row's first number)

F = TypeVar("F", bound=Callable)
_depth = threading.local()          # engine calls this thread is in (one may make another)


def call_begun(call: str, step: int, micro: int) -> None:
    """Say on the rank's board (if it has one) that it is in ``call`` at ``step``/``micro``."""
    board = rank_board()
    if board is None:
        return
    code = CALLS.index(call)
    board[CALL_STEP], board[CALL_MICRO], board[LAST_CALL] = step, micro, code
    board[CALL] = code
    board[CALLS_MADE] = max(board[CALLS_MADE], 0) + 1


def engine_call(method_or_call):
    """Decorate a call of the engine: while it runs the board says the rank is in it (which one the
    call says through :func:`call_begun`, or ``@engine_call("name")`` at its start); when the
    outermost returns, that the rank is in its own code."""
    if isinstance(method_or_call, str):
        return functools.partial(_recorded, call=method_or_call)
    return _recorded(method_or_call)


def _recorded(method: F, call: str | None = None) -> F:
    @functools.wraps(method)
    def recorded(*args, **kwargs):
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            if call is not None:
                call_begun(call, -1, -1)
            return method(*args, **kwargs)
        finally:
            _depth.n -= 1
            board = rank_board()
            if board is not None and _depth.n == 0:
                board[CALL] = -1
    return cast(F, recorded)          # wraps() keeps the signature


class CallCheck:
    """One rank's side of the agreement (module docstring)."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        board = rank_board()
        if board is not None:             # how long a peer waits for this rank before it fails
            board[TIMEOUT_MS] = int(timeout_s * 1000)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) \
            if world > 1 else None

    def close(self) -> None:
        """Destroy the group (when the default group is still there: leaving it destroys every group)."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None

    def agree(self, call: str, step: int, micro: int, problem: str | None = None) -> None:
        """Return when every rank makes ``call`` at ``step``/``micro`` without a problem; else raise
        (:class:`ZdslApiError`) on every rank, as the module docstring says."""
        call_begun(call, step, micro)
        if self.group is None:
            if problem:
                raise ZdslApiError(problem)
            return
        mine = torch.tensor([CALLS.index(call), step, micro, int(bool(problem))], dtype=torch.int64)
        gathered = torch.empty(self.world * mine.numel(), dtype=torch.int64)
        rows = list(gathered.view(self.world, -1))
        try:    # zdsl's all-gather: shared memory at 2 ranks of a host, a fraction of gloo's wake-up latency
            all_gather(gathered, mine, group=self.group)
        except RuntimeError as exc:
            raise ZdslApiError(f"rank {self.rank}: {call} (step {step}, micro-batch {micro}): another rank made "
                               f"no call of the engine within {self.timeout_s:g} s (it stopped, or is stuck in its "
                               f"own code or another call): {str(exc).splitlines()[0]}") from None
        said_rows: list[list[int]] = [r.tolist() for r in rows]
        if any(r[3] for r in said_rows):
            raise ZdslApiError(self._problems(problem, said_rows))
        if any(r[:3] != said_rows[0][:3] for r in said_rows):
            said = "; ".join(f"rank {r} called {CALLS[row[0]]} (step {row[1]}, micro-batch {row[2]})"
                             for r, row in enumerate(said_rows))
            raise ZdslApiError(f"the ranks made different calls of the engine: {said}; every rank makes the "
                               f"same calls in the same order (the same loop over the same number of batches)")

    def _problems(self, problem: str | None, rows: list[list[int]]) -> str:
        """Every rank's problem (one more all-gather, on the ranks that all know one is coming)."""
        said: list[str | None] = [None] * self.world
        dist.all_gather_object(said, problem, group=self.group)
        if problem:
            return problem
        return "; ".join(f"rank {r}: {text}" for r, text in enumerate(said) if text)
