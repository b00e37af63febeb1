"""Byte-level text corpora: the Python standard library's own source, or any text.

``corpus("stdlib")`` is real text on every machine with no download: the
``.py`` files of the running interpreter's standard library (the folder of
``os.__file__``, without ``site-packages``), in sorted path order. Files are
read once per process and cached; a cap keeps start-up quick (the first
``STDLIB_CAP`` bytes in that order are plenty for the models zdsl trains on
a laptop). Tokens are bytes (vocab 256).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from zdsl.sources.text import STDLIB_CAP
from zdsl.sources.text import stdlib_files


class CorpusError(ValueError):
    """A corpus that cannot be read or is too small; the message names the path."""


def _is_text(head: bytes) -> bool:
    return b"\0" not in head


def _read_files(files: list[Path], cap: int | None) -> bytes:
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue        # unreadable files (permissions, races) are not text we can use
        if not _is_text(data[:4096]):
            continue
        chunks.append(data)
        total += len(data)
        if cap is not None and total >= cap:
            break
    blob = b"".join(chunks)
    return blob[:cap] if cap is not None else blob


@functools.lru_cache(maxsize=4)
def corpus_tokens(source: str) -> torch.Tensor:
    """The corpus as a uint8 tensor (cached per process)."""
    if source == "stdlib":
        blob = _read_files(stdlib_files(), STDLIB_CAP)
        where = f"the standard library at {Path(os.__file__).parent}"
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise CorpusError(f"corpus {source!r}: no such file or folder")
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            blob = _read_files(files, None)
        else:
            try:
                blob = path.read_bytes()
            except OSError as exc:
                raise CorpusError(f"corpus {source!r}: cannot read it: {exc.strerror or exc}") from None
            if not _is_text(blob[:4096]):
                raise CorpusError(f"corpus {source!r} is not a text file (it holds NUL bytes)")
        where = f"{source!r}"
    if not blob:
        raise CorpusError(f"corpus {where} holds no readable text")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)
