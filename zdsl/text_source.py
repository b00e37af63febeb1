"""``data text("FILE or FOLDER", tokenizer=...)``: which files are read, which tokenizer, its ids.

Torch-free and ``tokenizers``-free: the checker reads the same facts the runtime
tokenises with (zdsl/runtime/data/text.py), so they cannot disagree.

- Files: a FILE is one document; ``"stdlib"`` is the running Python's standard library
  sources (``corpus("stdlib")``'s files, whole files up to ``STDLIB_CAP`` bytes). A FOLDER's documents are its regular files, at any
  depth, in sorted path order, skipping names that start with ``.`` (``.git``,
  ``.DS_Store``) and binary files (a NUL byte in the first 8 KiB, git's rule).
- Tokenizer: a ``tokenizer.json`` path, or a folder holding one (a Hugging Face model's).
- End of text, put after every document: the ``eos_token`` of ``tokenizer_config.json``
  beside the tokenizer, else the first of :data:`END_OF_TEXT` the tokenizer knows.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

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
    files = []
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
