"""Which sample a batch row is: counter-based keys, the same on every rank, thread and run.

A step's samples are its global samples ``0 .. ranks*accumulate*batch - 1``, each a pure
function of (seed, step, global sample index): row ``i`` of rank ``r``'s micro-batch ``m`` is
global sample ``(m * ranks + r) * batch + i`` (:func:`first_sample`), and its key is
:func:`sample_keys`'s hash of them. A source turns a key into its sample (a window of a
file, a record, a synthetic stream).
"""
from __future__ import annotations

import numpy as np

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


def first_sample(micro: int, rank: int, ranks: int, batch: int) -> int:
    """The step's global sample index of row 0 of ``rank``'s micro-batch ``micro``."""
    return (micro * ranks + rank) * batch


def step_keys(seed: int, step: int, micro: int, rank: int, ranks: int, batch: int) -> np.ndarray:
    """The sample keys of one rank's micro-batch: its global samples' (:func:`first_sample`)."""
    return sample_keys(seed, step, 0, first_sample(micro, rank, ranks, batch), batch)
