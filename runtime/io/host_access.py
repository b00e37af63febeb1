"""Where the host touches a tensor's memory without an aten op (NVMe reads and writes, the native
host AdamW kernel): those places call :func:`host_access`, so the CPU stream checker
(``runtime/exec/hb_check.py``) sees them as it sees every aten op. Nothing is observed, and
nothing costs more than a global's test, when no checker is installed."""
from __future__ import annotations

from collections.abc import Callable, Iterable

# the installed checker's callable(reads, writes), or None
observer: Callable[[Iterable, Iterable], None] | None = None


def host_access(reads=(), writes=()) -> None:
    """The calling thread reads ``reads`` and writes ``writes`` (tensors) now."""
    if observer is not None:
        observer(reads, writes)
