"""The one error instantiation raises for a statement that cannot mean anything for the model.

Contract: carries the message, the statement's span (file, line, column) and a hint, which the
driver turns into a positioned ``Diagnostic``; never a traceback for bad input.
"""
from __future__ import annotations

from zdsl.schedule import PipeStmt


class LoweringError(Exception):
    """A pipeline statement that cannot be instantiated; carries its span."""

    def __init__(self, message: str, stmt: PipeStmt | None = None, hint: str | None = None):
        super().__init__(message)
        self.span = stmt.span if stmt is not None else None
        self.hint = hint
