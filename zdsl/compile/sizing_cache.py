"""A Hugging Face or a user's model's sizing, kept in zdsl's cache folder so the next command on the
same model skips it.

Sizing a ``model hf(...)`` or ``model "file.py:build"(...)`` builds it on torch's meta device, which
needs torch (and transformers), whose import takes every ``zdsl check``, ``plan`` or ``run`` launcher
far longer than the sizing itself, before any rank starts. The units of a model are a pure function
of what the key holds, so a hit is the same list a fresh sizing gives:

- hf: the folder, its ``config.json``'s bytes and every other file's name, size and mtime (weights
  whose headers the sizing checks on meta);
- a user's factory: its file's bytes, and (checked on load, as they are known only once the factory
  ran) the size and mtime of every file beside it (a config it reads) and of every Python file of the
  user's loaded in the process that sized it, outside the standard library, site-packages and zdsl
  (the helpers it imports, wherever they are), and of every file it opened for reading while it was
  sized (:func:`files_read`: a config or a vocabulary it reads from another folder);
- the model's overrides or arguments, the sequence length and whether rows come padded or packed;
- the installed torch and transformers, the Python, and every source file of zdsl's compiler and
  runtime (name, size, mtime): an edit or an upgrade sizes afresh.

Only a sizing that warned about nothing is kept (an estimate is said every time), and nothing for
a source whose rows are its own tensors (``data python(...)``: the sample row comes from the user's
function, which the key cannot hold), or for a factory named as
``package.module:build`` (where its code lies is known only by importing it). A cache that cannot be
read or written is a miss, never an error. Torch-free.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import site
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

from zdsl.cache import cache_dir
from zdsl.model.units import UnitSpec
from zdsl.schedule import DataSpec, ModelSpec
from zdsl.sources import source_of

FORMAT = 2          # of the files written; an older or newer one is a miss (2: a user's sources)
_code: str | None = None
_recording: list[set[str]] = []    # the sets :func:`files_read` fills now (sizings may nest)
_hooked = False
_NOT_FILES = ("/proc/", "/sys/", "/dev/")


def sizing_key(spec: ModelSpec, context: int | None, data: DataSpec | None) -> str | None:
    """The key of ``spec``'s sizing (a ``ModelSpec`` of kind "hf", or "user" with a file factory), or
    None where it is not kept."""
    if data is not None and not source_of(data.kind).token_ids:     # sized from a row of its own tensors
        return None
    model: dict[str, object]
    try:
        if spec.kind == "hf" and spec.path is not None:
            folder = Path(spec.path)
            config = (folder / "config.json").read_bytes()
            files = sorted((p.name, st.st_size, st.st_mtime_ns) for p in folder.iterdir()
                           if p.name != "config.json" and p.is_file() and (st := p.stat()))
            model = {"folder": str(folder.resolve()), "config": hashlib.sha256(config).hexdigest(), "files": files}
        elif (source := _factory_file(spec)) is not None:
            model = {"factory": spec.factory, "source": hashlib.sha256(source.read_bytes()).hexdigest()}
        else:
            return None
        code = _code_digest()
    except OSError:          # a file gone while listed: no key, sized afresh
        return None
    facts = {"format": FORMAT, **model, "args": sorted((k, repr(v)) for k, v in spec.args.items()),
             "context": context, "masked": data is not None and source_of(data.kind).masked, "python": sys.version,
             "torch": _version("torch"), "transformers": _version("transformers"), "code": code}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def load(key: str) -> list[UnitSpec] | None:
    try:
        held = json.loads(_path(key).read_text())
        if held.get("format") != FORMAT or not all(_stamp(path) == stamp for path, *stamp in held["sources"]):
            return None
        return [UnitSpec(**{**u, "params": [(n, tuple(shape)) for n, shape in u["params"]]})
                for u in held["units"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def store(key: str, units: list[UnitSpec], sources: Sequence[str] = ()) -> None:
    """Keep ``units`` under ``key``; ``sources``: files whose change makes it a miss (checked on load)."""
    path = _path(key)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        stamps = [[src, *stamp] for src in sources if (stamp := _stamp(src)) is not None]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": FORMAT, "units": [asdict(u) for u in units], "sources": stamps}))
        os.replace(tmp, path)        # whole or absent: ranks of one launch may write the same key
    except OSError:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def files_read(spec: ModelSpec) -> Iterator[set[str]]:
    """A set of the files this process opens for reading while the block runs, filled as they are
    opened (Python's ``open`` audit event: ``open()``, ``os.open`` and what is built on them, such
    as ``json.load``, ``numpy.load`` and ``torch.load``; a file opened by native code alone, such as
    safetensors', is not seen), where ``spec`` is a user's factory named by its file (what
    :func:`sources` reads them for); an empty set otherwise. An audit hook cannot be removed: it is
    added once per process, for the first such sizing, and records nothing outside such a block."""
    global _hooked
    if _factory_file(spec) is None:         # an HF folder: its key holds its files
        yield set()
        return
    if not _hooked:
        sys.addaudithook(_on_audit)
        _hooked = True
    seen: set[str] = set()
    _recording.append(seen)
    try:
        yield seen
    finally:
        _recording.remove(seen)


def _on_audit(event: str, args: tuple) -> None:
    # runs on every audited event of the process: the common case returns at the first test
    if event != "open" or not _recording:
        return
    path, _mode, flags = args
    if isinstance(path, (str, bytes)) and isinstance(flags, int) and flags & os.O_ACCMODE == os.O_RDONLY:
        path = os.path.abspath(os.fsdecode(path))       # as named now: the working folder may change
        for seen in _recording:
            seen.add(path)


def sources(spec: ModelSpec, read: set[str] | frozenset = frozenset()) -> list[str]:
    """The files whose change makes ``spec``'s kept sizing a miss, beyond its key: for a user's
    factory, what it may have read: the files beside its file (a config it loads), the Python
    files of every module loaded in this process that is the user's, and the files in ``read``
    (:func:`files_read` around the sizing), each outside the standard library, site-packages and
    zdsl's own folders (the key holds those), zdsl's cache folder and /proc, /sys and /dev. Nothing
    for an HF folder (its key holds its files)."""
    factory = _factory_file(spec)
    if factory is None:
        return []
    folder = factory.parent
    try:
        beside = {os.path.realpath(p) for p in folder.iterdir() if p.is_file()}
    except OSError:
        beside = set()
    libraries = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    libraries |= {*site.getsitepackages(), site.getusersitepackages(), *map(str, _code_roots()), str(cache_dir())}
    roots = tuple(os.path.join(os.path.realpath(p), "") for p in libraries if p) + _NOT_FILES
    files = {os.path.realpath(f) for m in list(sys.modules.values())
             if isinstance(f := getattr(m, "__file__", None), str) and f.endswith(".py")}
    files |= {os.path.realpath(f) for f in read if not f.endswith(".pyc") and os.path.isfile(f)}
    return sorted(beside | {f for f in files if not f.startswith(roots)})


def _factory_file(spec: ModelSpec) -> Path | None:
    """The file of a user's factory named by its file (absolute: the checker resolved it), or None."""
    if spec.kind != "user" or not spec.factory:
        return None
    file = spec.factory.rpartition(":")[0]
    return Path(file) if file.endswith(".py") else None


def _stamp(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _path(key: str) -> Path:
    return cache_dir() / "sizing" / f"{key}.json"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _code_roots() -> list[Path]:
    """The folders of zdsl's compiler and runtime."""
    roots = [Path(__file__).resolve().parents[1]]
    runtime = importlib.util.find_spec("zdsl.runtime")     # its folder only: nothing is imported
    if runtime is not None and runtime.submodule_search_locations:
        roots += [Path(p) for p in runtime.submodule_search_locations]
    return roots


def _code_digest() -> str:
    """Every source file of the compiler and the runtime, by name, size and mtime: once per process."""
    global _code
    if _code is None:
        stamp = hashlib.sha256()
        for root in _code_roots():
            for path in sorted(root.rglob("*.py")):
                st = path.stat()
                stamp.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        _code = stamp.hexdigest()
    return _code
