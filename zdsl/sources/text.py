"""``data text("FILE or FOLDER", tokenizer=..., context=N)``: which files are read, which tokenizer, its ids.

Torch-free and ``tokenizers``-free: the checker reads the same facts the runtime
tokenises with (zdsl/runtime/data/text.py), so they cannot disagree.

- Files: a FILE is one document; ``"stdlib"`` is the running Python's standard library
  sources (``corpus("stdlib")``'s files, whole files up to ``STDLIB_CAP`` bytes). A FOLDER's documents
  are its regular files, at any depth, in sorted path order, skipping names that start with ``.`` (``.git``,
  ``.DS_Store``) and binary files (a NUL byte in the first 8 KiB, git's rule).
- Tokenizer: a ``tokenizer.json`` path, or a folder holding one (a Hugging Face model's); its id
  count is the data's vocab, which the model's must hold (``jsonl(...)`` reads it the same way).
- End of text, put after every document: the ``eos_token`` of ``tokenizer_config.json``
  beside the tokenizer, else the first of :data:`END_OF_TEXT` the tokenizer knows.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from zdsl.check.values import Reader
from zdsl.lang import ast
from zdsl.lang.include import path_exists, resolve_relative
from zdsl.schedule import DataSpec, Span
from zdsl.sources.base import DataSource, ModelFit, SourceCall

STDLIB = "stdlib"
STDLIB_CAP = 16 << 20        # bytes read from the standard library (plenty for a laptop-sized model)
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]")
SNIFF_BYTES = 8192


class TextSourceError(ValueError):
    """Text or a tokenizer that cannot be trained on; the message names the path."""


def is_text_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return b"\0" not in f.read(SNIFF_BYTES)
    except OSError:
        return False


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (the folder of ``os.__file__``, no site-packages), sorted."""
    root = Path(os.__file__).resolve().parent
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def text_files(source: str | Path) -> list[Path]:
    """The documents of ``source`` in the order they are tokenised (see the module's rule)."""
    if str(source) == STDLIB:
        found, total = [], 0
        for path in stdlib_files():
            if total >= STDLIB_CAP:
                break
            if is_text_file(path):
                found.append(path)
                total += path.stat().st_size
        return found
    root = Path(source)
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(folder) / name
            if not name.startswith(".") and path.is_file() and is_text_file(path):
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def tokenizer_file(given: str | Path) -> Path:
    """``tokenizer.json`` itself: the path, or the one in the folder given."""
    path = Path(given)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TextSourceError(f"tokenizer not found: {path}")
    return path


def tokenizer_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TextSourceError(f"tokenizer {path} is not a tokenizer.json file: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise TextSourceError(f"tokenizer {path} has no \"model\" section: is it a Hugging Face "
                              f"tokenizers file (tokenizer.json)?")
    return data


def token_ids(data: dict) -> dict[str, int]:
    """Every token the tokenizer can produce -> its id: the model's vocab and the added tokens."""
    vocab = data["model"].get("vocab") or {}
    ids = dict(vocab) if isinstance(vocab, dict) else {entry[0]: i for i, entry in enumerate(vocab)}
    for added in data.get("added_tokens") or ():
        ids[added["content"]] = added["id"]
    return ids


def id_count(data: dict) -> int:
    """The ids the tokenizer can produce: its largest id + 1 (what the model's vocab must hold)."""
    return max(token_ids(data).values(), default=-1) + 1


def end_of_text(path: Path, data: dict) -> tuple[str, int]:
    """``(token, id)`` put between documents; an error naming the tokenizer where it has none."""
    ids = token_ids(data)
    names = []
    config = path.parent / "tokenizer_config.json"
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        names.append(eos.get("content") if isinstance(eos, dict) else eos)
    except (OSError, ValueError, AttributeError):
        pass
    for name in [*names, *END_OF_TEXT]:
        if isinstance(name, str) and name in ids:
            return name, ids[name]
    raise TextSourceError(f"tokenizer {path} has no end-of-text token to put between documents "
                          f"(looked for {', '.join(END_OF_TEXT)} and eos_token in {config.name})")


def tokenizers_missing(source: str = "text") -> str | None:
    """Why the runtime could not tokenise, or None: ``tokenizers`` is an optional extra."""
    if importlib.util.find_spec("tokenizers") is None:
        return f"data {source}(...) needs the tokenizers package: pip install 'zdsl[hf]'"
    return None


def token_dtype(ids: int) -> str:
    """The narrowest token file type that holds ``ids`` ids (0 .. ids-1)."""
    return "uint16" if ids <= 1 << 16 else "uint32"


class TextSource(DataSource):
    kind = "text"
    settings = ("tokenizer", "context")
    example = 'text("corpus/", tokenizer="tokenizer.json", context=64)'
    argument = "file"

    def resolve(self, given: str, span: Span, report: Reader) -> str | None:
        """A text file, or a folder holding at least one (the module's rule), or "stdlib"."""
        if given == STDLIB:
            return given
        path = Path(resolve_relative(given, span.file)).expanduser()
        if not path_exists(path):
            report.error(span, f"text not found: {path}",
                         hint="a text file or a folder of them, relative to the schedule's folder")
            return None
        if not text_files(path):
            report.error(span, f"no text files in {path}" if path.is_dir() else f"{path} is not a text file",
                         hint="text files are the regular files that hold no NUL byte; names starting "
                              "with . are skipped")
            return None
        return str(path.resolve())

    def read_setting(self, name: str, arg: ast.Arg, spec: DataSpec, at: SourceCall) -> None:
        if name != "tokenizer":
            super().read_setting(name, arg, spec, at)
            return
        at.span("tokenizer", arg.span)
        spec.tokenizer = read_tokenizer(arg.value, spec.args, at.report)

    def finish(self, spec: DataSpec, given: dict[str, ast.Arg], at: SourceCall) -> DataSpec:
        if "tokenizer" not in given:
            at.report.error(at.call.span, "text needs a tokenizer", hint=self.example)
        if missing := tokenizers_missing():
            at.report.error(at.call.callee.span, missing)
        return spec

    def check_vocab(self, spec: DataSpec, fit: ModelFit) -> None:
        check_tokenizer_vocab(spec, fit)

    def written(self, spec: DataSpec) -> tuple[str | None, list[tuple[str, object]]]:
        return super().written(spec)[0], tokenizer_first(spec)


def read_tokenizer(value, args: dict, report: Reader) -> str | None:
    """tokenizer="tokenizer.json" or an HF model folder: it must parse, and have an end-of-text
    token; its id count becomes the data's vocab (``args["vocab"]``)."""
    given = report.string(value, "the tokenizer")
    if given is None:
        return None
    path = Path(resolve_relative(given, value.span.file)).expanduser()
    try:
        file = tokenizer_file(path)
        data = tokenizer_json(file)
        end_of_text(file, data)
    except TextSourceError as exc:
        report.error(value.span, str(exc), hint="a tokenizer.json file, or a Hugging Face model folder holding one")
        return None
    args["vocab"] = id_count(data)
    return str(path.resolve())


def check_tokenizer_vocab(spec: DataSpec, fit: ModelFit) -> None:
    """The tokenizer's ids must all be below the model's vocab."""
    if spec.args.get("vocab", 0) > fit.vocab:
        fit.report.error(fit.at(".tokenizer", ".context", fit.key),
                         f"the tokenizer {spec.tokenizer} produces ids up to {spec.args['vocab'] - 1} "
                         f"({spec.args['vocab']} ids) but the model's vocab is {fit.vocab}",
                         hint=f"model {fit.opening}vocab={spec.args['vocab']}) or a tokenizer made for this model")


def tokenizer_first(spec: DataSpec) -> list[tuple[str, object]]:
    """The settings as written back: the tokenizer first; its vocab is found again when checked."""
    return [("tokenizer", spec.tokenizer or "")] + [(k, v) for k, v in spec.args.items() if k != "vocab"]


SOURCE = TextSource()
