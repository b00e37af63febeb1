"""Built-in data sources: ``corpus("stdlib")``, ``corpus("PATH")``, ``tokens("FILE")``, ``text("PATH", tokenizer=...)``
and ``synthetic(...)``, and a user's function, ``python("file.py:batches")``.

:func:`make_batch` is the only entry point the runtime and the DDP reference
use. A step's samples are its global samples ``0 .. ranks*accumulate*batch - 1``,
each a pure function of (seed, step, global sample index): row ``i`` of rank
``r``'s micro-batch ``m`` is global sample ``(m * ranks + r) * batch + i``
(:func:`first_sample`). So any run with the same global batch sees the same
samples at every step however it splits them (zdsl at any stage, DDP, FSDP2;
2 ranks or 1 rank accumulating 2 micro-batches; a run resumed from a
checkpoint at another rank count), and nothing depends on the order in
which ranks or threads ask.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from zdsl.runtime.data.corpus import CorpusError

from zdsl.runtime.data.corpus import corpus_tokens
from zdsl.runtime.data.jsonl import jsonl_batch
from zdsl.runtime.data.python_source import python_batch
from zdsl.runtime.data.synthetic import synthetic_tokens
from zdsl.runtime.data.text import text_token_file
from zdsl.runtime.data.tokens import TokenFileError
from zdsl.runtime.data.tokens import check_token_file
from zdsl.runtime.data.tokens import open_token_file

_MASK_INT = 0xFFFFFFFFFFFFFFFF
_MASK = np.uint64(_MASK_INT)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A counter-based hash: the same inputs give the same stream everywhere."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def _splitmix64_int(x: int) -> int:
    """:func:`_splitmix64` of one value in Python integers (the same bits, without numpy's per-call cost)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK_INT
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_INT
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_INT
    return x ^ (x >> 31)


def sample_keys(seed: int, step: int, micro: int, first: int, count: int) -> np.ndarray:
    """One 64-bit key per global sample ``first .. first+count-1`` of a micro-batch."""
    key = seed & 0xFFFFFFFF
    for part in (step, micro):
        key = _splitmix64_int(key ^ (part & 0xFFFFFFFFFFFF))
    samples = np.arange(first, first + count, dtype=np.uint64)
    return _splitmix64(samples ^ np.uint64(key))


def _arg(spec, name: str) -> int:
    value = spec.args.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"data {spec.kind}(...) needs {name}=<positive integer>, got {value!r}")
    return value


def vocab_size(spec) -> int:
    """Token ids the data can produce (the model's vocab must be at least this)."""
    return 256 if spec.kind == "corpus" else _arg(spec, "vocab")


def first_sample(micro: int, rank: int, ranks: int, batch: int) -> int:
    """The step's global sample index of row 0 of ``rank``'s micro-batch ``micro``."""
    return (micro * ranks + rank) * batch


def step_keys(seed: int, step: int, micro: int, rank: int, ranks: int, batch: int) -> np.ndarray:
    """The sample keys of one rank's micro-batch: its global samples' (:func:`first_sample`)."""
    return sample_keys(seed, step, 0, first_sample(micro, rank, ranks, batch), batch)


def make_batch(spec, seed: int, step: int, micro: int, rank: int, ranks: int, batch: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)``, int64 tensors of shape ``(batch, context)`` on the CPU (``python(...)``:
    the user's function's pair, any tensors with ``batch`` rows, runtime/data/python_source.py).

    ``jsonl(...)`` gives a :class:`~zdsl.runtime.models.batch.Batch` instead (labels -100 on prompts,
    masks for padding and packing): callers take every source's result through ``as_batch``.
    ``targets`` is ``idx`` shifted by one token. Row ``i`` is the step's global sample
    ``first_sample(micro, rank, ranks, batch) + i``.
    """
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is outside 0..{ranks - 1}")
    if spec.kind == "python":                   # the user's function gives the whole pair, any tensors
        return python_batch(spec, seed, step, micro, rank, ranks, batch)
    context = _arg(spec, "context")
    keys = step_keys(seed, step, micro, rank, ranks, batch)
    if spec.kind == "jsonl":                   # fine-tuning records: a Batch with masks (runtime/data/jsonl.py)
        return jsonl_batch(spec, keys)
    if spec.kind == "corpus":
        tokens = corpus_tokens(spec.source or "stdlib")
        span = tokens.numel() - context - 1
        if span <= 0:
            raise CorpusError(f"corpus {spec.source!r} holds {tokens.numel()} bytes; "
                              f"context={context} needs at least {context + 2}")
        starts = torch.from_numpy((keys % np.uint64(span)).astype(np.int64))
        rows = tokens[starts[:, None] + torch.arange(context + 1)].long()
    elif spec.kind in ("tokens", "text"):       # text: its cached token file, read as tokens(FILE) is
        path, dtype = text_token_file(spec) if spec.kind == "text" else (spec.source, spec.dtype)
        _checked(path, dtype, vocab_size(spec), context)
        tokens = open_token_file(path, dtype)
        rows = torch.from_numpy(tokens.rows(keys, context))
        tokens.prefetch(step_keys(seed, step + 1, micro, rank, ranks, batch), context)   # read during the step
    elif spec.kind == "synthetic":
        rows = synthetic_tokens(keys, vocab_size(spec), context + 1)
    else:
        raise ValueError(f"unknown data source {spec.kind!r} (expected corpus, tokens, text, jsonl, synthetic or python)")
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@functools.lru_cache(maxsize=8)
def _checked(path: str, dtype: str, vocab: int, context: int) -> None:
    """Once per process: the launcher's check left its verdict beside the file, so this reads it."""
    check_token_file(path, dtype, vocab, context)


def make_batches(spec, seed: int, step: int, micro: int, rank: int, batch: int, ranks: int | None = None):
    """Alias of :func:`make_batch` with ``ranks`` last (the brief's spelling)."""
    return make_batch(spec, seed, step, micro, rank, ranks if ranks is not None else rank + 1, batch)


__all__ = ["make_batch", "make_batches", "vocab_size", "sample_keys", "step_keys", "first_sample", "CorpusError", "TokenFileError"]
