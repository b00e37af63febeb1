"""The engine of a schedule whose model's row is the first batch's: compiled at the first ``engine(x)``.

A schedule without ``data`` (its batches fed by the loop, ``zdsl/sources/fed.py``) and with the
user's own model cannot be sized at ``initialize``: zdsl does not know what one row of the model's
input is until the loop feeds one. ``initialize`` then checks the schedule and returns a
:class:`DeferredEngine`; its first ``engine(x)`` records that batch's row (shapes past the rows,
dtypes) in the fed source, finishes compiling (the same path as a schedule with data:
``setup.finish_for``, handed in as ``begin``), checks that every rank fed the same row (:func:`agree_on_row`, before the
graphs' digests are compared), starts the engine and runs the call on it. Every later call goes
to that engine; a batch of another row is refused there (``batches.py``), saying what was compiled.
Before that first ``engine(x)`` only ``rank``, ``world``, ``train``/``eval`` and ``close`` answer.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch.distributed as dist

from zdsl.errors import ZdslApiError


class DeferredEngine:
    """An :class:`~zdsl.runtime.api.engine.Engine` compiled and started at the first ``engine(x)``."""

    def __init__(self, loaded, begin: Callable):
        """``loaded``: the checked schedule (``driver.load``'s); ``begin(compiled, agree)``: finish
        compiling it and start its engine, calling ``agree(rank, world)`` once the ranks joined."""
        from zdsl.runtime.dist.group import launched_rank
        self._loaded, self._begin = loaded, begin
        self._engine = None
        self._training = True
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
        if self._engine is not None:
            self._engine.close()

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
        return self._begin(loaded, lambda rank, world: agree_on_row(row, rank, world))


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
