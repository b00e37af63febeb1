"""``data jsonl("FILE", tokenizer=..., prompt="prompt", response="response", pack=false, context=N)``:
the records of a supervised fine-tuning set.

Torch-free and ``tokenizers``-free: the checker validates the file with the same reader the
runtime tokenises from (zdsl/runtime/data/jsonl.py), so they cannot disagree.

- A record is one line of the file: a JSON object whose prompt and response fields (named by
  ``prompt=`` and ``response=``) are strings; other fields are ignored. Blank lines are
  skipped; a file with no record is an error.
- Its tokens: the prompt's ids, then the response's (each text tokenised alone, without the
  tokenizer's special tokens), then the tokenizer's end-of-text id (zdsl/text_source.py
  says which). The loss counts the response's tokens and the end of text, never the prompt's.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

from zdsl.cache import cache_dir
from zdsl.text_source import TextSourceError

DEFAULTS = {"prompt": "prompt", "response": "response", "pack": False}
CHECK_VERSION = 1


class JsonlSourceError(TextSourceError):
    """A JSONL file that cannot be trained on; the message names the file and, where one is at
    fault, the line."""


def records(path: str | Path, prompt: str, response: str) -> Iterator[tuple[int, str, str]]:
    """``(line number, prompt text, response text)`` of every record, in file order; the first bad
    line raises :class:`JsonlSourceError` naming it."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise JsonlSourceError(f"jsonl {path}: {exc.strerror or exc}") from None
    with f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise JsonlSourceError(f"{where} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
            except ValueError as exc:
                raise JsonlSourceError(f"{where} is not JSON: {exc}") from None
            if not isinstance(record, dict):
                raise JsonlSourceError(f"{where} is a JSON {type(record).__name__}, not an object "
                                       f"{{\"{prompt}\": ..., \"{response}\": ...}}")
            texts = []
            for role, field in (("prompt", prompt), ("response", response)):
                if field not in record:
                    raise JsonlSourceError(f"{where} has no \"{field}\" field (the {role}); it has "
                                           f"{', '.join(map(repr, list(record)[:6])) or 'no field'}")
                if not isinstance(record[field], str):
                    raise JsonlSourceError(f"{where}: \"{field}\" is a JSON {type(record[field]).__name__}, "
                                           f"not a string")
                texts.append(record[field])
            yield number, texts[0], texts[1]


def file_key(path: Path, *parts) -> str:
    """A hash of the file's identity (path, size, modification time) and ``parts``."""
    st = path.stat()
    h = hashlib.sha256(json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, *parts]).encode())
    return h.hexdigest()[:32]


def check_jsonl(path: str | Path, prompt: str, response: str) -> int:
    """The number of records; :class:`JsonlSourceError` for the first bad line or an empty file.
    A passed check is remembered under zdsl's cache folder (each rank compiles the schedule, and
    must not re-read a large file to learn it is fine)."""
    path = Path(path)
    try:
        verdict = cache_dir() / "jsonl" / f"{file_key(path, prompt, response, CHECK_VERSION)}.checked"
    except OSError as exc:
        raise JsonlSourceError(f"jsonl {path}: {exc.strerror or exc}") from None
    try:
        return int(verdict.read_text())
    except (OSError, ValueError):
        pass
    count = sum(1 for _ in records(path, prompt, response))
    if not count:
        raise JsonlSourceError(f"jsonl {path} holds no record (one JSON object per line, "
                               f"{{\"{prompt}\": ..., \"{response}\": ...}})")
    try:
        verdict.parent.mkdir(parents=True, exist_ok=True)
        partial = verdict.with_name(f"{verdict.name}.{os.getpid()}.partial")     # readers see all or none
        partial.write_text(str(count))
        partial.replace(verdict)
    except OSError:
        pass                         # a cache that cannot be written only costs the next check a read
    return count
