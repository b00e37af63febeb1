"""A Hugging Face model's sizing, kept in zdsl's cache folder so the next command on the same folder
skips it.

Sizing a ``model hf(...)`` builds it on torch's meta device, which needs torch and transformers: on a
2-core machine their import is ~6 s of every ``zdsl check``, ``plan`` or ``run`` launcher, before any
rank starts, against ~0.1 s for the sizing itself. The units of a model are a pure function of what
the key holds, so a hit is the same list a fresh sizing gives:

- the folder, its ``config.json``'s bytes and every other file's name, size and mtime (weights whose
  headers the sizing checks on meta);
- the model's overrides, the sequence length and whether rows come padded or packed;
- the installed torch and transformers, the Python, and every source file of zdsl's compiler and
  runtime (name, size, mtime): an edit or an upgrade sizes afresh.

Only a sizing that warned about nothing is kept (an estimate is said every time), and nothing for
``data python(...)``, whose sample row comes from the user's function. A cache that cannot be read or
written is a miss, never an error. Torch-free.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from zdsl.cache import cache_dir
from zdsl.compile.units import UnitSpec

FORMAT = 1          # of the files written; an older or newer one is a miss
_code: str | None = None


def sizing_key(spec, context: int | None, data) -> str | None:
    """The key of ``spec``'s sizing (a ``ModelSpec`` of kind "hf"), or None where it is not kept."""
    if spec.kind != "hf" or (data is not None and data.kind == "python"):
        return None
    folder = Path(spec.path)
    try:
        config = (folder / "config.json").read_bytes()
        files = sorted((p.name, st.st_size, st.st_mtime_ns) for p in folder.iterdir()
                       if p.name != "config.json" and p.is_file() and (st := p.stat()))
        code = _code_digest()
    except OSError:          # a file gone while listed: no key, sized afresh
        return None
    facts = {"format": FORMAT, "folder": str(folder.resolve()), "config": hashlib.sha256(config).hexdigest(),
             "files": files, "args": sorted((k, repr(v)) for k, v in spec.args.items()), "context": context,
             "masked": data is not None and data.kind == "jsonl", "python": sys.version,
             "torch": _version("torch"), "transformers": _version("transformers"), "code": code}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def load(key: str) -> list[UnitSpec] | None:
    try:
        held = json.loads(_path(key).read_text())
        if held.get("format") != FORMAT:
            return None
        return [UnitSpec(**{**u, "params": [(n, tuple(shape)) for n, shape in u["params"]]})
                for u in held["units"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def store(key: str, units: list[UnitSpec]) -> None:
    path = _path(key)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": FORMAT, "units": [asdict(u) for u in units]}))
        os.replace(tmp, path)        # whole or absent: ranks of one launch may write the same key
    except OSError:
        tmp.unlink(missing_ok=True)


def _path(key: str) -> Path:
    return cache_dir() / "sizing" / f"{key}.json"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _code_digest() -> str:
    """Every source file of the compiler and the runtime, by name, size and mtime: once per process."""
    global _code
    if _code is None:
        roots = [Path(__file__).resolve().parents[1]]
        runtime = importlib.util.find_spec("zdsl.runtime")     # its folder only: nothing is imported
        if runtime is not None and runtime.submodule_search_locations:
            roots += [Path(p) for p in runtime.submodule_search_locations]
        stamp = hashlib.sha256()
        for root in roots:
            for path in sorted(root.rglob("*.py")):
                st = path.stat()
                stamp.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        _code = stamp.hexdigest()
    return _code
