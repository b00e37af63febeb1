"""``tokens("FILE", dtype=uint16|uint32)``: a flat file of little-endian token ids.

nanoGPT's ``train.bin`` (uint16) and Megatron's raw format. The file is
memory-mapped, never read whole: a batch reads only its windows' pages. The
sample with key ``k`` is the window of ``context + 1`` tokens starting at
``k mod (n - context)`` for a file of ``n`` tokens (every start nanoGPT's
``randint(len(data) - block_size)`` can draw). The next step's windows are known
at once, so each batch asks the kernel to start reading them (:meth:`TokenFile.prefetch`):
a file not in the page cache is read while the step computes.

Every id must be below the vocab. :func:`check_token_file` proves it once: numpy's
max per chunk, the first offending offset searched only when a chunk's max fails.
The file's max id is cached beside it (``FILE.zdsl-check.json``, keyed by size,
mtime_ns and dtype; under zdsl's cache folder where the file's folder is
read-only), so the next run, or another vocab, starts at once. An exclusive
``flock`` on the file while checking makes ranks started together scan it once;
``zdsl run``'s launcher checks before any rank starts (runtime/run/preflight.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from zdsl.cache import cache_dir
from zdsl.runtime.data.source import TokenWindows
from zdsl.runtime.io.atomic import renamed_into_place
from zdsl.sources.tokens import TOKEN_DTYPES

CHUNK_TOKENS = 1 << 24          # tokens per max() during the check: 32 MiB of uint16
CHECK_SUFFIX = ".zdsl-check.json"


class TokenFileError(ValueError):
    """A token file that cannot be trained on; the message names the file (and offset and value)."""


def numpy_dtype(dtype: str) -> np.dtype:
    if dtype not in TOKEN_DTYPES:
        raise TokenFileError(f"unknown token dtype {dtype!r} (expected {' or '.join(TOKEN_DTYPES)})")
    return np.dtype(f"<u{TOKEN_DTYPES[dtype]}")


class TokenFile:
    """One open token file: its read-only memmap (pages load on touch) and a descriptor for read-ahead."""

    def __init__(self, path: str, dtype: str, size: int):
        kind = numpy_dtype(dtype)
        if size == 0:
            raise TokenFileError(f"token file {path} is empty (0 bytes)")
        if size % kind.itemsize:
            raise TokenFileError(f"token file {path} holds {size} bytes, not a whole number of {dtype} "
                                 f"tokens ({kind.itemsize} bytes each)")
        self.data = np.memmap(path, dtype=kind, mode="r")
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self):
        with contextlib.suppress(AttributeError, OSError):
            os.close(self.fd)

    def rows(self, keys: np.ndarray, context: int) -> np.ndarray:
        """``(len(keys), context + 1)`` int64 windows, a pure function of the keys."""
        starts = window_starts(keys, len(self.data), context)
        rows = np.empty((len(keys), context + 1), dtype=np.int64)
        for row, start in zip(rows, starts.tolist()):     # one contiguous slice per sample: its pages only
            row[:] = self.data[start:start + context + 1]
        return rows

    def prefetch(self, keys: np.ndarray, context: int) -> None:
        """Ask the kernel to start reading these windows (``POSIX_FADV_WILLNEED``) and return at once."""
        width = self.data.dtype.itemsize
        for start in window_starts(keys, len(self.data), context).tolist():
            os.posix_fadvise(self.fd, start * width, (context + 1) * width, os.POSIX_FADV_WILLNEED)


def open_token_file(path: str, dtype: str) -> TokenFile:
    """The file, opened once per process and version (size, mtime)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TokenFileError(f"token file {path}: {exc.strerror or exc}") from None
    return _open(path, dtype, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _open(path: str, dtype: str, size: int, mtime_ns: int) -> TokenFile:
    return TokenFile(path, dtype, size)


def window_starts(keys: np.ndarray, tokens: int, context: int) -> np.ndarray:
    """Each sample's first token: ``key mod (tokens - context)``, int64."""
    span = tokens - context
    if span <= 0:
        raise TokenFileError(f"a file of {tokens} tokens has no window of context+1 = {context + 1}")
    return (keys % np.uint64(span)).astype(np.int64)


# -- the one-time check: every id below the vocab --------------------------------------

def _stamp(path: str, dtype: str) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype}


def check_record_paths(path: str) -> list[Path]:
    """Where the check's verdict is kept: beside the file, else under zdsl's cache folder."""
    digest = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:24]
    return [Path(path + CHECK_SUFFIX), cache_dir() / "tokens" / f"{digest}{CHECK_SUFFIX}"]


def _cached_max(path: str, stamp: dict) -> int | None:
    for record in check_record_paths(path):
        try:
            saved = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(saved, dict) and all(saved.get(k) == v for k, v in stamp.items()) \
                and isinstance(saved.get("max"), int):
            return saved["max"]
    return None


def _save_max(path: str, stamp: dict, largest: int) -> None:
    text = json.dumps({**stamp, "max": largest})
    for record in check_record_paths(path):
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            with renamed_into_place(record) as partial:    # readers see a whole record or none
                partial.write_text(text)
            return
        except OSError:                        # a read-only folder: try the next place
            continue


def scan_max(data: np.ndarray, chunk: int = CHUNK_TOKENS) -> int:
    return max(int(data[i:i + chunk].max()) for i in range(0, len(data), chunk))


def first_at_or_above(data: np.ndarray, vocab: int, chunk: int = CHUNK_TOKENS) -> tuple[int, int] | None:
    """``(token index, value)`` of the first id ``>= vocab``, or None."""
    for i in range(0, len(data), chunk):
        part = data[i:i + chunk]
        if int(part.max()) >= vocab:
            at = int(np.argmax(part >= vocab))
            return i + at, int(part[at])
    return None


def check_token_file(path: str, dtype: str, vocab: int, context: int | None = None) -> int:
    """Raise :class:`TokenFileError` unless every id is below ``vocab`` (and the file holds a
    window of ``context + 1`` tokens); return the largest id. Cached beside the file."""
    data = open_token_file(path, dtype).data
    if context is not None and len(data) < context + 1:
        raise TokenFileError(f"token file {path} holds {len(data)} tokens; context={context} needs "
                             f"at least {context + 1}")
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)       # ranks started together: one scans, the rest read its verdict
        stamp = _stamp(path, dtype)
        largest = _cached_max(path, stamp)
        if largest is None:
            largest = scan_max(data)
            _save_max(path, stamp, largest)
    first = first_at_or_above(data, vocab) if largest >= vocab else None
    if first is not None:
        index, value = first
        width = data.dtype.itemsize
        raise TokenFileError(f"token file {path} holds id {value} at token {index} (byte offset "
                             f"{index * width}), not below the model's vocab {vocab}: is dtype={dtype} "
                             f"right, and was it tokenized for this model?")
    return largest


def token_file_problem(spec) -> str | None:
    """``data tokens(...)``'s check for start-up: the reason it cannot train, or None."""
    try:
        check_token_file(spec.source, spec.dtype, spec.args["vocab"], spec.args.get("context"))
    except TokenFileError as exc:
        return str(exc)
    except OSError as exc:
        return f"token file {spec.source}: {exc.strerror or exc}"
    return None


@functools.lru_cache(maxsize=8)
def _checked(path: str, dtype: str, vocab: int, context: int) -> None:
    """Once per process: the launcher's check left its verdict beside the file, so this reads it."""
    check_token_file(path, dtype, vocab, context)


def token_file_rows(path: str, dtype: str, vocab: int, keys: np.ndarray, context: int, next_keys):
    """The windows of ``keys`` (:meth:`TokenFile.rows`) as a tensor, the file checked once per process;
    the kernel starts reading the next step's windows (``next_keys()``) during this step."""
    import torch
    _checked(path, dtype, vocab, context)
    tokens = open_token_file(path, dtype)
    rows = torch.from_numpy(tokens.rows(keys, context))
    tokens.prefetch(next_keys(), context)
    return rows


class TokensSource(TokenWindows):
    kind = "tokens"

    def prepare(self, spec, schedule, progress: bool = False) -> tuple[str | None, str | None]:
        """Ids below the vocab: one scan, its verdict cached."""
        return token_file_problem(spec), None

    def rows(self, spec, keys, context: int, next_keys):
        return token_file_rows(spec.source, spec.dtype, self.vocab(spec), keys, context, next_keys)


SOURCE = TokensSource()
