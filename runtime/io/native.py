"""Small C kernels compiled on first use and loaded with ctypes.

Why not a torch C++ extension: compiling against torch's headers takes a
minute and a matching toolchain; these kernels are plain C over raw
pointers, build in about a second with whatever ``cc`` is present, and need
nothing from torch. Why compile at all: the host Adam step is memory-bound
only when done in one pass; Python-level composition of library ops makes
several passes (see runtime/offload/host_adam.py). Sources live in ``csrc/``
(package data), read with :func:`csrc`.

Builds are cached under ``$ZDSL_CACHE`` (default ``~/.cache/zdsl``), keyed
by source, flags and CPU features (``-march=native`` code must not run on
another CPU), and written atomically so ranks that build at once end with
one good file. Where no compiler works, :func:`build` returns None and
callers use their pure-Python/ATen path; that is logged, never fatal.

Environment: ``CC`` picks the compiler; ``ZDSL_NO_NATIVE=1`` switches all
kernels off (to test or compare the fallbacks); ``ZDSL_CACHE`` moves the cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import structlog

from zdsl import env
from zdsl.cache import cache_dir

log = structlog.get_logger("zdsl.runtime.io.native")

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def compiler() -> str | None:
    """The C compiler kernels are built with: ``$CC``, else the first of cc, gcc, clang found."""
    return env.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _compile(stem: str, source: str, extra: tuple[str, ...] = ()) -> Path | None:
    if env.flag("ZDSL_NO_NATIVE"):
        return None
    cc = compiler()
    if cc is None:
        log.warning("native.no_compiler", kernel=stem)
        return None
    key = hashlib.sha256((source + " ".join((*FLAGS, *extra)) + _cpu_key()).encode()).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / f"{stem}.c"
            src.write_text(source)
            out = Path(tmp) / f"{stem}.so"
            done = subprocess.run([cc, *FLAGS, *extra, str(src), "-o", str(out), "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                log.warning("native.compile_failed", kernel=stem, compiler=cc, stderr=done.stderr[-2000:])
                return None
            os.replace(out, target)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native.compile_failed", kernel=stem, compiler=cc, error=str(e))
        return None
    return target


def csrc(name: str) -> str:
    """The text of C source ``name`` shipped in this package's ``csrc/`` folder."""
    return (Path(__file__).parent / "csrc" / name).read_text()


def build(stem: str, source: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The loaded library for ``source`` (built once per process and cache), or None.
    ``extra``: compiler flags beyond ``FLAGS`` (e.g. ``-fopenmp``)."""
    with _lock:
        if stem not in _loaded:
            path = _compile(stem, source, extra)
            lib = None
            if path is not None:
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError as e:
                    log.warning("native.load_failed", kernel=stem, path=str(path), error=str(e))
            _loaded[stem] = lib
        return _loaded[stem]
