"""``jsonl("FILE", tokenizer=..., prompt=, response=, pack=, context=)``: supervised fine-tuning rows.

Tokenised once into a cache (as ``text(...)`` is: zdsl/runtime/data/text.py), keyed by the
file (path, size, mtime), the tokenizer file's bytes, its end-of-text id and the two field
names: ``KEY.tokens`` holds every record's ids back to back (prompt, response, end of text;
zdsl/sources/jsonl.py reads the records), ``KEY.index`` each record's start and prompt length.
An exclusive ``flock`` makes processes started together tokenise once; ``zdsl run``'s
launcher does it before any rank starts (runtime/run/preflight.py), and reports there how
many records are longer than the context.

A record of ``n`` tokens fills ``n - 1`` positions of a row: inputs are its tokens but the
last, labels the tokens after them (zdsl's labels are shifted), ``-100`` where the label is
a prompt token. A record longer than ``context + 1`` tokens keeps its first ``context + 1``
(its end is cut; a prompt that long leaves nothing counted).

- ``pack=false``: one record per row, padded at the end (``attention_mask`` 0, labels -100).
- ``pack=true``: records in file order fill a row until the next would not fit (then a new
  row starts); each record is its own segment (``Batch.segments``: attention never crosses
  records) with positions from 0, so a packed row computes exactly the losses and gradients
  of its records in rows of their own. The rest of the row is padding.

Row ``keys[i] % rows`` serves global sample ``i``: a row is a pure function of (seed, step,
micro-batch, global sample), as every source's is (runtime/data/keys.py).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zdsl.cache import cache_dir
from zdsl.runtime.data.keys import step_keys
from zdsl.runtime.data.source import RuntimeSource, positive_setting
from zdsl.runtime.io.atomic import renamed_into_place
from zdsl.runtime.models.batch import IGNORE_INDEX, Batch
from zdsl.sources.jsonl import JsonlSourceError, file_key, records
from zdsl.sources.text import (
    TextSourceError,
    end_of_text,
    id_count,
    token_dtype,
    tokenizer_file,
    tokenizer_json,
    tokenizers_missing,
)

FORMAT_VERSION = 1
RECORDS_PER_CALL = 8192          # records per encode_batch call: enough to keep every core busy
TOKENISED = 0                    # files tokenised by this process (the tests count cache misses)


@dataclass(frozen=True)
class SftTokens:
    """The cached tokens of one jsonl source."""
    path: str                    # every record's ids, back to back
    index: str                   # .npy int64 (records, 2): each record's first token and prompt length
    dtype: str
    records: int
    tokens: int
    eos: int


def jsonl_cache_dir() -> Path:
    return cache_dir() / "jsonl"


def cache_key(source: Path, tokenizer: Path, eos: int, prompt: str, response: str) -> str:
    h = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, "eos": eos, "prompt": prompt,
                                   "response": response, "file": file_key(source)}).encode())
    h.update(hashlib.sha256(tokenizer.read_bytes()).digest())
    return h.hexdigest()[:32]


def jsonl_tokens(source: str, tokenizer: str, prompt: str, response: str) -> SftTokens:
    """The cached tokens of ``source``, tokenised now unless the cache holds them."""
    missing = tokenizers_missing("jsonl")
    if missing:
        raise TextSourceError(missing)
    path = tokenizer_file(tokenizer)
    _, eos = end_of_text(path, tokenizer_json(path))
    file = Path(source)
    if not file.is_file():
        raise JsonlSourceError(f"jsonl not found: {source}")
    dtype = token_dtype(id_count(tokenizer_json(path)))
    key = cache_key(file, path, eos, prompt, response)
    folder = jsonl_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    out, index, meta = folder / f"{key}.tokens", folder / f"{key}.index", folder / f"{key}.json"
    with open(folder / f"{key}.lock", "wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)          # one process tokenises; the others then find the files
        if not (out.exists() and index.exists() and meta.exists()):
            count, tokens = tokenise(file, path, eos, dtype, prompt, response, out, index)
            with renamed_into_place(meta) as partial:
                partial.write_text(json.dumps({"source": str(source), "tokenizer": str(path), "dtype": dtype,
                                               "records": count, "tokens": tokens, "eos": eos}))
        saved = json.loads(meta.read_text())
    return SftTokens(str(out), str(index), saved["dtype"], saved["records"], saved["tokens"], saved["eos"])


def _chunks(items, size: int):
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def tokenise(source: Path, tokenizer: Path, eos: int, dtype: str, prompt: str, response: str,
             out: Path, index: Path) -> tuple[int, int]:
    """Write every record's ids to ``out`` and its (start, prompt length) to ``index``;
    ``(records, tokens)``."""
    global TOKENISED
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_file(str(tokenizer))
    kind = np.dtype(f"<u{2 if dtype == 'uint16' else 4}")
    starts, prompts, offset = [], [], 0
    with renamed_into_place(out) as partial_tokens, renamed_into_place(index) as partial_index:
        with open(partial_tokens, "wb") as sink:
            for chunk in _chunks(records(source, prompt, response), RECORDS_PER_CALL):
                asked = encoder.encode_batch([p for _, p, _ in chunk], add_special_tokens=False)
                answered = encoder.encode_batch([r for _, _, r in chunk], add_special_tokens=False)
                flat: list[int] = []
                for p, r in zip(asked, answered):
                    starts.append(offset + len(flat))
                    prompts.append(len(p.ids))
                    flat += p.ids
                    flat += r.ids
                    flat.append(eos)
                sink.write(np.array(flat, dtype=kind).tobytes())
                offset += len(flat)
        if not starts:
            raise JsonlSourceError(f"jsonl {source} holds no record (one JSON object per line, "
                                   f"{{\"{prompt}\": ..., \"{response}\": ...}})")
        with open(partial_index, "wb") as f:
            np.save(f, np.array([starts, prompts], dtype=np.int64).T.copy())
    TOKENISED += 1
    return len(starts), offset


class SftRows:
    """The rows of one jsonl source at one context: which records each row holds."""

    def __init__(self, made: SftTokens, context: int, pack: bool):
        self.context, self.eos = context, made.eos
        self.tokens = np.memmap(made.path, dtype=np.dtype(f"<u{2 if made.dtype == 'uint16' else 4}"), mode="r")
        index = np.load(made.index)
        self.starts, self.prompts = index[:, 0], index[:, 1]
        lengths = np.diff(np.append(self.starts, made.tokens))
        self.kept = np.minimum(lengths, context + 1)            # tokens of each record in its row
        self.truncated = int((lengths > context + 1).sum())
        self.emptied = int(((self.prompts >= self.kept) | (self.kept < 2)).sum())   # no label counted
        self.first = _pack(self.kept - 1, context) if pack else np.arange(len(lengths) + 1)
        self.pack = pack

    @property
    def rows(self) -> int:
        return len(self.first) - 1

    def batch(self, keys: np.ndarray) -> Batch:
        """The micro-batch whose sample ``i`` is row ``keys[i] % rows``."""
        B, T = len(keys), self.context
        ids = np.full((B, T), self.eos, dtype=np.int64)
        labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((B, T), dtype=np.int64)
        positions = np.tile(np.arange(T, dtype=np.int64), (B, 1))
        segments = np.zeros((B, T), dtype=np.int64)
        for b, row in enumerate((keys % np.uint64(self.rows)).astype(np.int64)):
            at = 0
            for segment, r in enumerate(range(self.first[row], self.first[row + 1])):
                n = int(self.kept[r])
                record = self.tokens[self.starts[r]:self.starts[r] + n].astype(np.int64)
                end = at + n - 1
                ids[b, at:end] = record[:-1]
                labels[b, at:end] = record[1:]
                labels[b, at:at + min(max(int(self.prompts[r]) - 1, 0), n - 1)] = IGNORE_INDEX  # prompt tokens
                mask[b, at:end] = 1
                positions[b, at:end] = np.arange(n - 1)
                segments[b, at:end] = segment
                at = end
            positions[b, at:] = np.arange(T - at)                   # padding: a segment of its own
            segments[b, at:] = self.first[row + 1] - self.first[row]
        batch = Batch(torch.from_numpy(ids), torch.from_numpy(labels), attention_mask=torch.from_numpy(mask))
        if self.pack:
            batch.positions, batch.segments = torch.from_numpy(positions), torch.from_numpy(segments)
        return batch


def _pack(spans: np.ndarray, context: int) -> np.ndarray:
    """First record of each row (and the record count last): records in order fill a row of
    ``context`` positions until the next would overflow it."""
    first, used = [0], 0
    for r, need in enumerate(spans.tolist()):
        if used + need > context:
            first.append(r)
            used = 0
        used += need
    first.append(len(spans))
    return np.array(first, dtype=np.int64)


@functools.lru_cache(maxsize=8)
def _rows(source: str, tokenizer: str, prompt: str, response: str, context: int, pack: bool) -> SftRows:
    return SftRows(jsonl_tokens(source, tokenizer, prompt, response), context, pack)


def sft_rows(spec) -> SftRows:
    """``spec``'s rows, tokenised or read from the cache once per process."""
    a = spec.args
    return _rows(spec.source, spec.tokenizer, a["prompt"], a["response"], a["context"], bool(a["pack"]))


def jsonl_problem(spec) -> tuple[str | None, str | None]:
    """``data jsonl(...)``'s start-up: tokenise (or find the cache). ``(the reason it cannot train or
    None, a note on the records the context truncates or None)``."""
    try:
        rows = sft_rows(spec)
    except TextSourceError as exc:
        return str(exc), None
    except OSError as exc:
        return f"data jsonl({spec.source}): {exc.strerror or exc}", None
    records = len(rows.starts)
    if rows.emptied == records:
        return (f"jsonl {spec.source}: no record keeps a response token within context={rows.context}: "
                f"nothing would be trained on (a longer context, or shorter prompts)"), None
    if not rows.truncated:
        return None, None
    lost = f"; {rows.emptied} of them keep no response token at all" if rows.emptied else ""
    return None, (f"jsonl {spec.source}: {rows.truncated} of {records} records are longer than "
                  f"context={rows.context} (a record of n tokens fills n - 1 positions) and are truncated to "
                  f"it: their tokens past it are not trained on{lost}")


class JsonlSource(RuntimeSource):
    kind = "jsonl"

    def prepare(self, spec, schedule, progress: bool = False) -> tuple[str | None, str | None]:
        """Tokenised once (under a lock); the records the context truncates are said once, here."""
        return jsonl_problem(spec)

    def batch(self, spec, seed: int, step: int, micro: int, rank: int, ranks: int, batch: int) -> Batch:
        """A :class:`Batch` with labels -100 on prompts and masks for padding and packing."""
        positive_setting(spec, "context")
        return sft_rows(spec).batch(step_keys(seed, step, micro, rank, ranks, batch))


SOURCE = JsonlSource()
