"""The progress board: a few int64 slots of a small file beside a rank's error file, written by
the rank (its executor and training loop) and read by the launcher, which so tells a rank that
stopped from one that waits (``runtime/run/launch.py``).

Slots: LAUNCHER, the launcher's pid; STEP, the step begun; STEP_DONE, the step finished;
LAST_DONE, the last op finished; ISSUED, collectives issued since the rank began; LAST_ISSUED,
the last collective issued; from FIRST_LANE on, one slot per lane of ``zdsl.ir.LANES`` (in that
order): the op it runs, or -1.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

from zdsl import env
from zdsl.ir import LANES

LAUNCHER, STEP, STEP_DONE, LAST_DONE, ISSUED, LAST_ISSUED = range(6)
FIRST_LANE = 8
BOARD_SLOTS = FIRST_LANE + len(LANES)


def map_board(path: Path) -> memoryview:
    with open(path, "r+b") as f:
        return memoryview(mmap.mmap(f.fileno(), BOARD_SLOTS * 8)).cast("q")


def new_board(path: Path) -> memoryview:
    """The launcher's side: a fresh board at ``path``, nothing begun."""
    path.write_bytes(b"\0" * (BOARD_SLOTS * 8))
    board = map_board(path)
    board[LAUNCHER] = os.getpid()
    for slot in (STEP, STEP_DONE, LAST_DONE, LAST_ISSUED, *range(FIRST_LANE, BOARD_SLOTS)):
        board[slot] = -1
    return board


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
