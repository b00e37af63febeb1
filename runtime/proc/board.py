"""The progress board: a few int64 slots of a small file beside a rank's error file, written by
the rank (its executor, its training loop, the API engine's calls) and read by the launcher, which
so tells a rank that stopped from one that waits (``runtime/run/launch.py``).

Slots: LAUNCHER, the launcher's pid; STEP, the step begun; STEP_DONE, the step finished;
LAST_DONE, the last op finished; ISSUED, collectives issued since the rank began; LAST_ISSUED,
the last collective issued. A rank of a user's own loop (``zdsl.initialize``) also keeps
CALLS_MADE, the engine calls it began (initialize included); CALL, the one it is in (its code in
:data:`ENGINE_CALLS`; -1 while in its own code); LAST_CALL, CALL_STEP and CALL_MICRO, the last call
begun with its step and micro-batch; TIMEOUT_MS, its collective timeout (0 where not told). From
FIRST_LANE on, one slot per lane of ``zdsl.ir.LANES`` (in that order): the op it runs, or -1.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

from zdsl import env
from zdsl.ir import LANES

(LAUNCHER, STEP, STEP_DONE, LAST_DONE, ISSUED, LAST_ISSUED,
 CALLS_MADE, CALL, LAST_CALL, CALL_STEP, CALL_MICRO, TIMEOUT_MS) = range(12)
FIRST_LANE = 12
BOARD_SLOTS = FIRST_LANE + len(LANES)

# The engine's calls, by the code the board (and the ranks' agreement on each call) gives them.
ENGINE_CALLS = ("engine(x)", "engine(x) without gradients", "engine.backward(loss)", "engine.step()",
                "engine.gathered()", "engine.state_dict()", "engine.save_checkpoint()", "engine.load_checkpoint()",
                "zdsl.initialize()")


def map_board(path: Path) -> memoryview:
    with open(path, "r+b") as f:
        return memoryview(mmap.mmap(f.fileno(), BOARD_SLOTS * 8)).cast("q")


def new_board(path: Path) -> memoryview:
    """The launcher's side: a fresh board at ``path``, nothing begun."""
    path.write_bytes(b"\0" * (BOARD_SLOTS * 8))
    board = map_board(path)
    board[LAUNCHER] = os.getpid()
    for slot in (STEP, STEP_DONE, LAST_DONE, LAST_ISSUED, CALL, LAST_CALL, CALL_STEP, CALL_MICRO,
                 *range(FIRST_LANE, BOARD_SLOTS)):
        board[slot] = -1
    return board


def running_ops(board) -> list[int]:
    """The ops a board's lanes run (a snapshot's, or the live board's)."""
    return [op for op in board[FIRST_LANE:BOARD_SLOTS] if op >= 0]


_board: list[memoryview | None] = []


def rank_board() -> memoryview | None:
    """This rank's progress board (None without a zdsl launcher, under torchrun)."""
    if not _board:
        error_file = env.get("ZDSL_ERROR_FILE")
        try:
            _board.append(map_board(Path(error_file).with_suffix(".progress")) if error_file else None)
        except (OSError, ValueError):
            _board.append(None)
    return _board[0]
