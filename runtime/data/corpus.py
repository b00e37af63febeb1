"""Byte-level text corpora: the Python standard library's own source, or any text.

``corpus("stdlib")`` is real text on every machine with no download: the
``.py`` files of the running interpreter's standard library (the folder of
``os.__file__``, without ``site-packages``), in sorted path order. Files are
read once per process and cached; a cap keeps start-up quick (the first
``STDLIB_CAP`` bytes in that order are plenty for the models zdsl trains on
a laptop). Tokens are bytes (vocab 256). The sample with key ``k`` is the window of
``context + 1`` bytes starting at ``k mod (n - context - 1)`` for a corpus of ``n`` bytes.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from zdsl.runtime.data.source import TokenWindows
from zdsl.sources.corpus import BYTES
from zdsl.sources.text import STDLIB, STDLIB_CAP, stdlib_files


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
def corpus_tokens(source: str):
    """The corpus as a uint8 tensor (cached per process)."""
    import torch  # here, not at the top: the launcher's pre-flight imports this module
    if source == STDLIB:
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


class CorpusSource(TokenWindows):
    kind = "corpus"

    def vocab(self, spec) -> int:
        return BYTES

    def rows(self, spec, keys, context: int, next_keys):
        import numpy as np
        import torch
        tokens = corpus_tokens(spec.source or STDLIB)
        span = tokens.numel() - context - 1
        if span <= 0:
            raise CorpusError(f"corpus {spec.source!r} holds {tokens.numel()} bytes; "
                              f"context={context} needs at least {context + 2}")
        starts = torch.from_numpy((keys % np.uint64(span)).astype(np.int64))
        return tokens[starts[:, None] + torch.arange(context + 1)].long()


SOURCE = CorpusSource()
