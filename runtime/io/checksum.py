"""CRC-32C: the one checksum of zdsl's files (checkpoint blocks, NVMe swap blocks).

The ``crc32c`` package (a declared dependency; SSE4.2 / ARMv8 CRC instructions) computes it.
Checkpoint entries record the algorithm they were written with, so a file written where the
package was missing (zlib's CRC-32, algorithm ``"crc32"``) still verifies.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Checksum:
    """A CRC: ``checksum(data, value=0)`` continues ``value`` over the bytes of ``data``."""

    algo: str                                  # the name recorded with each checksum
    fn: Callable[..., int]

    def __call__(self, data, value: int = 0) -> int:
        return self.fn(data, value)


CRC32 = Checksum("crc32", zlib.crc32)
try:
    from crc32c import crc32c as _crc32c
    CRC32C: Checksum | None = Checksum("crc32c", _crc32c)
except ImportError:  # pragma: no cover - the package is a dependency; zlib keeps files verifiable
    CRC32C = None
DEFAULT = CRC32C or CRC32                      # what this process writes


def by_name(algo: str) -> Checksum | None:
    """The checksum recorded as ``algo``; None when this process cannot compute it."""
    return {"crc32": CRC32, "crc32c": CRC32C}.get(algo)
