"""Data sources at run time: one object per kind (``corpus``, ``tokens``, ``text``, ``jsonl``,
``synthetic``, ``python``, ``fed``), each ``SOURCE`` in ``zdsl/runtime/data/<kind>.py``, found here by its kind.

:func:`make_batch` is the only entry point the runtime and the DDP reference use for a batch;
:func:`prepare` is what runs once before any rank starts (``zdsl run``'s pre-flight). A step's
samples are its global samples ``0 .. ranks*accumulate*batch - 1``, each a pure function of
(seed, step, global sample index): row ``i`` of rank ``r``'s micro-batch ``m`` is global sample
``(m * ranks + r) * batch + i`` (``zdsl.runtime.data.keys``). So any run with the same global batch
sees the same samples at every step however it splits them (zdsl at any stage, DDP, FSDP2; 2 ranks
or 1 rank accumulating 2 micro-batches; a run resumed from a checkpoint at another rank count), and
nothing depends on the order in which ranks or threads ask.

A kind's module is imported when the kind is first asked for, and this module imports neither
torch nor numpy: the launcher's pre-flight prepares a source without loading what only batches
need. The compiler side of each kind is ``zdsl/sources/<kind>.py``.
"""
from __future__ import annotations

import importlib

from zdsl.runtime.data.source import RuntimeSource

# kind -> the module whose SOURCE is its run-time side
MODULES = {"corpus": "zdsl.runtime.data.corpus", "tokens": "zdsl.runtime.data.tokens",
           "text": "zdsl.runtime.data.text", "jsonl": "zdsl.runtime.data.jsonl",
           "synthetic": "zdsl.runtime.data.synthetic", "python": "zdsl.runtime.data.python",
           "fed": "zdsl.runtime.data.fed"}


def runtime_source(kind: str) -> RuntimeSource:
    """The run-time side of ``kind``; ValueError for a kind with none."""
    module = MODULES.get(kind)
    if module is None:
        kinds = list(MODULES)
        raise ValueError(f"unknown data source {kind!r} (expected {', '.join(kinds[:-1])} or {kinds[-1]})")
    return importlib.import_module(module).SOURCE


def make_batch(spec, seed: int, step: int, micro: int, rank: int, ranks: int, batch: int):
    """``(idx, targets)``, int64 tensors of shape ``(batch, context)`` on the CPU (``python(...)``:
    the user's function's pair, any tensors with ``batch`` rows, runtime/data/python.py).

    ``jsonl(...)`` gives a :class:`~zdsl.runtime.models.batch.Batch` instead (labels -100 on prompts,
    masks for padding and packing): callers take every source's result through ``as_batch``.
    ``targets`` is ``idx`` shifted by one token. Row ``i`` is the step's global sample
    ``first_sample(micro, rank, ranks, batch) + i``.
    """
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is outside 0..{ranks - 1}")
    return runtime_source(spec.kind).batch(spec, seed, step, micro, rank, ranks, batch)


def make_batches(spec, seed: int, step: int, micro: int, rank: int, batch: int, ranks: int | None = None):
    """Alias of :func:`make_batch` with ``ranks`` last (the brief's spelling)."""
    return make_batch(spec, seed, step, micro, rank, ranks if ranks is not None else rank + 1, batch)


def vocab_size(spec) -> int:
    """Token ids the data can produce (the model's vocab must be at least this)."""
    return runtime_source(spec.kind).vocab(spec)


def prepare(spec, schedule, progress: bool = False) -> tuple[str | None, str | None]:
    """Prepare and check one source (the training's, or ``eval``'s) before the ranks start:
    ``(the reason it cannot train, or None; a note for the user, or None)``."""
    return runtime_source(spec.kind).prepare(spec, schedule, progress)


__all__ = ["make_batch", "make_batches", "vocab_size", "prepare", "runtime_source"]
