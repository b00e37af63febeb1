"""``text("FILE or FOLDER", tokenizer=...)``: text tokenised once into a cached token file.

The documents (zdsl/sources/text.py says which files, in which order) go through a
Hugging Face ``tokenizers`` tokenizer, the end-of-text id after each, into a flat
token file under zdsl's cache folder; from there the data is read exactly as
``tokens(FILE)`` reads a file (zdsl/runtime/data/tokens.py: windows, sampling, the
vocab check). The file's name is a hash of the format version, the tokenizer
file's bytes, the end-of-text id and every document's path, size and mtime: a
second run finds it and starts at once; a changed document or tokenizer makes a new
one. An exclusive ``flock`` makes processes started together (ranks under torchrun)
tokenise once: the others wait and find the file. ``zdsl run``'s launcher tokenises
before any rank starts (runtime/run/preflight.py).

Batches of documents go to ``encode_batch``, which spreads them over the cores; a
single document is encoded by one thread.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zdsl.cache import cache_dir
from zdsl.runtime.data.source import TokenWindows
from zdsl.runtime.data.tokens import token_file_rows
from zdsl.runtime.io.atomic import renamed_into_place
from zdsl.sources.text import (
    STDLIB,
    TextSourceError,
    end_of_text,
    id_count,
    text_files,
    token_dtype,
    tokenizer_file,
    tokenizer_json,
    tokenizers_missing,
)

FORMAT_VERSION = 1
BATCH_BYTES = 16 << 20           # text per encode_batch call: enough documents to keep every core busy
TOKENISED = 0                    # corpora tokenised by this process (the tests count cache misses)


@dataclass(frozen=True)
class TextTokens:
    """The cached token file of one text source."""
    path: str
    dtype: str
    tokens: int
    vocab: int                   # ids the tokenizer can produce


def text_cache_dir() -> Path:
    return cache_dir() / "text"


def cache_key(files: list[Path], tokenizer: Path, eos: int) -> str:
    h = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, "eos": eos}).encode())
    h.update(hashlib.sha256(tokenizer.read_bytes()).digest())
    for path in files:
        st = path.stat()
        h.update(json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()[:32]


def text_tokens(source: str, tokenizer: str, progress: bool = False) -> TextTokens:
    """The token file for ``source``, tokenised now unless the cache holds it."""
    missing = tokenizers_missing()
    if missing:
        raise TextSourceError(missing)
    path = tokenizer_file(tokenizer)
    data = tokenizer_json(path)
    _, eos = end_of_text(path, data)
    if source != STDLIB and not Path(source).exists():
        raise TextSourceError(f"text not found: {source}")
    files = text_files(source)
    if not files:
        raise TextSourceError(f"no text files in {source} (hidden and binary files are skipped)")
    vocab = id_count(data)
    dtype = token_dtype(vocab)
    key = cache_key(files, path, eos)
    folder = text_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    out, meta = folder / f"{key}.tokens", folder / f"{key}.json"
    with open(folder / f"{key}.lock", "wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)          # one process tokenises; the others then find the file
        if not (out.exists() and meta.exists()):
            count = tokenise(files, path, eos, dtype, out, progress)
            _write_atomic(meta, json.dumps({"source": str(source), "tokenizer": str(path), "dtype": dtype,
                                            "tokens": count, "vocab": vocab, "documents": len(files)}))
        saved = json.loads(meta.read_text())
    return TextTokens(str(out), saved["dtype"], saved["tokens"], saved["vocab"])


def _write_atomic(path: Path, text: str) -> None:
    with renamed_into_place(path) as partial:
        partial.write_text(text)


def read_document(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def document_batches(files: list[Path], limit: int = BATCH_BYTES):
    """Consecutive runs of documents of about ``limit`` bytes, in order."""
    batch, size = [], 0
    for path in files:
        batch.append(path)
        size += path.stat().st_size
        if size >= limit:
            yield batch, size
            batch, size = [], 0
    if batch:
        yield batch, size


def tokenise(files: list[Path], tokenizer: Path, eos: int, dtype: str, out: Path, progress: bool) -> int:
    """Write every document's ids, each followed by ``eos``, to ``out``; the token count."""
    global TOKENISED
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_file(str(tokenizer))
    kind = np.dtype(f"<u{2 if dtype == 'uint16' else 4}")
    count = 0
    with renamed_into_place(out) as partial, \
            _progress(progress, sum(p.stat().st_size for p in files), len(files)) as advance, \
            open(partial, "wb") as sink:                 # readers see the whole file or none
        for batch, size in document_batches(files):
            flat: list[int] = []
            for enc in encoder.encode_batch([read_document(p) for p in batch], add_special_tokens=False):
                flat += enc.ids
                flat.append(eos)
            sink.write(np.array(flat, dtype=kind).tobytes())
            count += len(flat)
            advance(size)
    TOKENISED += 1
    return count


@contextlib.contextmanager
def _progress(show: bool, total: int, documents: int):
    """A rich progress bar over the text's bytes, on a terminal only."""
    if not (show and sys.stderr.isatty()):
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
    columns = (TextColumn(f"tokenising {documents} documents"), BarColumn(), DownloadColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("tokenise", total=total)
        yield lambda n: bar.advance(task, n)


@functools.lru_cache(maxsize=8)
def _text_tokens_once(source: str, tokenizer: str) -> TextTokens:
    return text_tokens(source, tokenizer)


def text_token_file(spec) -> tuple[str, str]:
    """``(path, dtype)`` of ``spec``'s token file, looked up once per process."""
    cached = _text_tokens_once(spec.source, spec.tokenizer)
    return cached.path, cached.dtype


def text_problem(spec, progress: bool = False) -> str | None:
    """``data text(...)``'s start-up: tokenise (or find the cache) and check the ids; the reason it
    cannot train, or None."""
    from zdsl.runtime.data.tokens import TokenFileError, check_token_file
    try:
        made = text_tokens(spec.source, spec.tokenizer, progress)
        context = spec.args.get("context")
        if context is not None and made.tokens < context + 1:
            return (f"text {spec.source} holds {made.tokens} tokens through its tokenizer; context={context} "
                    f"needs at least {context + 1} (a window of context+1 tokens)")
        check_token_file(made.path, made.dtype, spec.args["vocab"], spec.args.get("context"))
    except (TextSourceError, TokenFileError) as exc:
        return str(exc)
    except OSError as exc:
        return f"data text({spec.source}): {exc.strerror or exc}"
    return None


class TextSource(TokenWindows):
    kind = "text"

    def prepare(self, spec, schedule, progress: bool = False) -> tuple[str | None, str | None]:
        """Tokenised once (under a lock), before the ranks train."""
        return text_problem(spec, progress=progress), None

    def rows(self, spec, keys, context: int, next_keys):
        path, dtype = text_token_file(spec)        # read as tokens(FILE) reads its file
        return token_file_rows(path, dtype, self.vocab(spec), keys, context, next_keys)


SOURCE = TextSource()
