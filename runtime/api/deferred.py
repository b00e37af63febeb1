"""The engine of a schedule whose model's row is the first batch's: compiled at the first ``engine(x)``.

A schedule without ``data`` (its batches fed by the loop, ``zdsl/sources/fed.py``) and with the
user's own model cannot be sized at ``initialize``: zdsl does not know what one row of the model's
input is until the loop feeds one. ``initialize`` then checks the schedule and returns a
:class:`DeferredEngine`; its first ``engine(x)`` records that batch's row (shapes past the rows,
dtypes) in the fed source, finishes compiling (the same path as a schedule with data:
``setup.finish_for``, handed in as ``begin``), checks that every rank fed the same row (:func:`agree_on_row`, before the
graphs' digests are compared), starts the engine and runs the call on it. Every later call goes
to that engine; a batch of another row is refused there (``batches.py``), saying what was compiled.

Before that first ``engine(x)`` only ``rank``, ``world``, ``train``/``eval``, ``close``,
``global_step``, ``lr`` and ``load_checkpoint`` answer. ``load_checkpoint`` resumes as DeepSpeed users
do, before the loop: it finds the checkpoint and checks its index at once (the engine's errors; the
ranks agree, in the group ``initialize`` joined under a launcher, or the script's own), returns its
``client_state`` and makes ``global_step`` and ``lr`` the checkpoint's; its weights and optimizer
state need the engine, so they are loaded from that same step folder at the first ``engine(x)``,
right after the engine starts and before its step runs (:meth:`DeferredEngine._started`).
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from zdsl.errors import ZdslApiError


class DeferredEngine:
    """An :class:`~zdsl.runtime.api.engine.Engine` compiled and started at the first ``engine(x)``."""

    def __init__(self, loaded, begin: Callable, group: contextlib.ExitStack | None = None):
        """``loaded``: the checked schedule (``driver.load``'s); ``begin(compiled, agree)``: finish
        compiling it and start its engine, calling ``agree(rank, world)`` once the ranks joined;
        ``group``: leaves the group ``initialize`` joined for it (``setup.join_early``), at ``close``."""
        from zdsl.runtime.dist.group import launched_rank
        self._loaded, self._begin = loaded, begin
        self._group = group or contextlib.ExitStack()
        self._engine = None
        self._training = True
        self._pending: Path | None = None       # the step folder load_checkpoint found, loaded at the start
        self._step = 0                          # its next step, global_step until the engine starts
        found = launched_rank()
        self._rank: int = found[0] if found is not None else 0
        self._world: int = found[1] if found is not None else 1

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world(self) -> int:
        return self._world

    @property
    def training(self) -> bool:
        return self._training if self._engine is None else self._engine.training

    @property
    def global_step(self) -> int:
        """Optimizer steps taken: 0, or the pending checkpoint's, until the first ``engine(x)``."""
        return self._step if self._engine is None else self._engine.global_step

    @property
    def lr(self) -> float:
        """The learning rate of the next step (the engine's ``lr``)."""
        if self._engine is not None:
            return self._engine.lr
        from zdsl.lr import LrSchedule
        config = self._loaded.schedule.to_config()
        return LrSchedule.of(config["optimizer"], config["train"]["steps"]).at(self._step)

    def load_checkpoint(self, folder) -> tuple[str, dict]:
        """The engine's ``load_checkpoint``; before the first ``engine(x)``, deferred as the module
        docstring says: the checkpoint is found and checked now, its weights loaded at the start."""
        from zdsl.runtime.api.saving import engine_say
        if self._engine is not None:
            return self._engine.load_checkpoint(folder)
        step_dir, next_step = agreed_checkpoint(folder, self._world, engine_say(self))
        self._pending, self._step = step_dir, next_step
        return str(step_dir), client_state_of(step_dir)

    def train(self, mode: bool = True) -> "DeferredEngine":
        self._training = bool(mode)
        if self._engine is not None:
            self._engine.train(mode)
        return self

    def eval(self) -> "DeferredEngine":
        return self.train(False)

    def __call__(self, x):
        if self._engine is None:
            self._engine = self._started(x)
            self._engine.train(self._training)
        return self._engine(x)

    def __getattr__(self, name: str):
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise ZdslApiError(f"rank {self.__dict__.get('_rank', 0)}: engine.{name}: the schedule is compiled at "
                               f"the first engine(x), from its batch's row (no data statement, and the model is "
                               f"yours): call engine(x) first, or add a data statement that gives a row "
                               f"(data python(...)) to compile at initialize")
        return getattr(engine, name)

    def close(self) -> None:
        try:
            if self._engine is not None:
                self._engine.close()
        finally:
            self._group.close()          # the engine leaves no group it found joined: this one is ours

    def __enter__(self) -> "DeferredEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _started(self, x):
        """The engine compiled for ``x``'s row, started (the module docstring's steps)."""
        from zdsl.runtime.api.batches import as_batch
        from zdsl.runtime.data.fed import row_of, with_row
        batch = as_batch(x, "engine(x)", self._rank)
        row = row_of(batch.input_ids, batch.labels)
        loaded = copy.deepcopy(self._loaded)          # a failed compile leaves the next call a clean one
        loaded.schedule.data = with_row(loaded.schedule.data, row)
        engine = self._begin(loaded, lambda rank, world: agree_on_row(row, rank, world))
        if self._pending is not None:
            try:        # the step folder whose client_state was returned, not a newer one saved since
                engine.load_checkpoint(self._pending)
            except BaseException:
                engine.close()          # the next engine(x) starts again, the load still pending
                raise
            self._pending = None
        return engine


def agreed_checkpoint(folder, world: int, say: Callable[[str], None]) -> tuple[Path, int]:
    """The step folder the engine's ``load_checkpoint(folder)`` would load and its next step, found
    as ``resume`` finds it; :class:`CheckpointError` with its message, on every rank where the
    ranks' group is joined (every rank's problem is gathered, as ``resume`` gathers them)."""
    from zdsl.runtime.checkpoint import CheckpointError, read_index
    from zdsl.runtime.checkpoint.checkpointer import find_checkpoint
    found: tuple[Path, int] | None = None
    problem = ""
    try:
        step_dir = find_checkpoint(str(folder), say)
        index = read_index(step_dir)
        found = step_dir, int(index.data_position.get("next_step", index.step))
    except CheckpointError as exc:
        problem = str(exc)
    if world > 1 and dist.is_initialized():
        problems: list[str] = [""] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), "")
    if found is None or problem:
        raise CheckpointError(problem)
    return found


def client_state_of(step_dir: Path) -> dict:
    """The ``client_state`` saved in ``step_dir`` (``saving.py``), ``{}`` where there is none."""
    from zdsl.runtime.api.saving import CLIENT_STATE
    saved = step_dir / CLIENT_STATE
    return torch.load(saved, weights_only=False) if saved.exists() else {}


def agree_on_row(row: dict, rank: int, world: int) -> None:
    """Every rank fed the first batch with the same row, or :class:`ZdslApiError` naming each rank's."""
    if world == 1:
        return
    rows: list[dict | None] = [None] * world
    dist.all_gather_object(rows, row)
    if any(r != rows[0] for r in rows):
        said = "; ".join(f"rank {r}: {shown(each)}" for r, each in enumerate(rows))
        raise ZdslApiError(f"rank {rank}: engine(x): the ranks' first batches differ ({said}); the first engine(x) "
                           f"compiles the schedule for its batch's row, the same on every rank: feed every rank "
                           f"batches of one shape")


def shown(row: dict | None) -> str:
    """A recorded row as a message shows it: ``inputs float32 (12,), labels int64 ()``."""
    if row is None:
        return "nothing"
    parts = [f"inputs {row['inputs_dtype']} {tuple(row['inputs'])}"]
    if row["labels"] is not None:
        parts.append(f"labels {row['labels_dtype']} {tuple(row['labels'])}")
    return ", ".join(parts)
