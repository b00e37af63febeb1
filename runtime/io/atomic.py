"""A file reaches its name whole or not at all: write under a temporary name beside it, rename."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def renamed_into_place(path: Path) -> Iterator[Path]:
    """A temporary name beside ``path`` to write; renamed onto ``path`` (atomic on POSIX) when the
    block succeeds, removed when it fails. Readers, other ranks among them, see the old file or the
    whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
