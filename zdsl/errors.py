"""The one exception of the Python API (``zdsl.initialize`` and the engine it returns), torch-free so
that ``zdsl.ZdslApiError`` is there to catch without importing the runtime."""
from __future__ import annotations


class ZdslApiError(RuntimeError):
    """A misuse of the engine, a schedule or model it cannot train, or a failure of a step.

    The message says what happened, on which rank and, for a failed op, which op and why; and,
    where the caller can act, what to change. Raised by the call that met it, on every rank
    where the ranks' calls are checked together (``runtime/api/calls.py``)."""
