"""``data jsonl("FILE", tokenizer=..., prompt="prompt", response="response", pack=false, context=N)``:
the records of a supervised fine-tuning set.

Torch-free and ``tokenizers``-free: the checker validates the file with the same reader the
runtime tokenises from (zdsl/runtime/data/jsonl.py), so they cannot disagree. The records'
rows come padded or packed (:attr:`JsonlSource.masked`): the model holds an attention mask.

- A record is one line of the file: a JSON object whose prompt and response fields (named by
  ``prompt=`` and ``response=``) are strings; other fields are ignored. Blank lines are
  skipped; a file with no record is an error.
- Its tokens: the prompt's ids, then the response's (each text tokenised alone, without the
  tokenizer's special tokens), then the tokenizer's end-of-text id (zdsl/sources/text.py
  says which). The loss counts the response's tokens and the end of text, never the prompt's.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

from zdsl.cache import cache_dir
from zdsl.lang.include import path_exists, resolve_relative
from zdsl.schedule import DataSpec
from zdsl.sources.base import MAX_SETTING, DataSource, ModelFit, SourceCall
from zdsl.sources.text import (
    TextSourceError,
    check_tokenizer_vocab,
    read_tokenizer,
    tokenizer_first,
    tokenizers_missing,
)

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


class JsonlSource(DataSource):
    kind = "jsonl"
    settings = ("tokenizer", "prompt", "response", "pack", "context")
    example = 'jsonl("sft.jsonl", tokenizer="tokenizer.json", pack=true, context=256)'
    argument = "file"
    masked = True

    def check(self, at: SourceCall) -> DataSpec | None:
        """The file is read here as the runtime reads it (:func:`records`), so a bad line is an
        error before any rank starts."""
        call, report = at.call, at.report
        positional = at.positional()
        if not positional:
            report.error(call.span, "jsonl needs a file", hint=self.example)
            return None
        for extra in positional[1:]:
            report.error(extra.span, "jsonl takes key=value settings after the file", hint=self.example)
        given = report.keywords(at.keyword(), self.settings, "jsonl()")
        args, tokenizer = self._settings(given, at)
        if "tokenizer" not in given:
            report.error(call.span, "jsonl needs a tokenizer", hint=self.example)
        elif missing := tokenizers_missing("jsonl"):
            report.error(call.callee.span, missing)
        if args["prompt"] is not None and args["prompt"] == args["response"]:
            report.error(given["response"].span if "response" in given else call.span,
                         f'prompt and response both name the field "{args["prompt"]}"',
                         hint='jsonl("FILE", ..., prompt="question", response="answer")')
            return None
        where = positional[0].value
        source = report.string(where, "the jsonl file")
        if source is None or tokenizer is None or None in args.values():
            return None
        path = self._records_file(source, where, args, report)
        return None if path is None else DataSpec("jsonl", path, args, None, tokenizer)

    def _settings(self, given: dict, at: SourceCall) -> tuple[dict, str | None]:
        """The settings (defaults first, None where one is wrong) and the tokenizer."""
        args, tokenizer = dict(DEFAULTS), None
        for name, arg in given.items():
            at.span(name, arg.span)
            if name == "tokenizer":
                tokenizer = read_tokenizer(arg.value, args, at.report)
            elif name == "pack":
                args[name] = at.report.boolean(arg.value, "jsonl(pack=)")
            elif name in ("prompt", "response"):
                args[name] = at.report.string(arg.value, f"the {name}'s field name")
            else:
                args[name] = at.report.integer(arg.value, f"jsonl({name}=)", 1, MAX_SETTING)
        return args, tokenizer

    def _records_file(self, source: str, where, args: dict, report) -> str | None:
        """The file, absolute, with every line a record; None after an error."""
        path = Path(resolve_relative(source, where.span.file)).expanduser()
        if not path.is_file():
            report.error(where.span, f"jsonl not found: {path}" if not path_exists(path) else f"{path} is not a file",
                         hint="a file of one JSON object per line, relative to the schedule's folder")
            return None
        try:
            check_jsonl(path, args["prompt"], args["response"])
        except JsonlSourceError as exc:
            report.error(where.span, str(exc), hint=f'each line one JSON object with string fields '
                                                    f'"{args["prompt"]}" and "{args["response"]}"')
            return None
        return str(path.resolve())

    def check_vocab(self, spec: DataSpec, fit: ModelFit) -> None:
        check_tokenizer_vocab(spec, fit)

    def written(self, spec: DataSpec) -> tuple[str | None, list[tuple[str, object]]]:
        return super().written(spec)[0], tokenizer_first(spec)


SOURCE = JsonlSource()
