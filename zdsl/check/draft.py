"""What the checks of one file share: the schedule being filled, the reporter, the model's units.

Each statement is read into :attr:`Draft.schedule` by a function of its concept's module
(``model``, ``data``, ``training``, ``machine``, ``placement``, ``pipelines``), which reports
every problem through :attr:`Draft.report` and keeps the statement's span under its keyword
(:meth:`Draft.span`), so later stages can point at it.
"""
from __future__ import annotations

from dataclasses import dataclass

from zdsl.check.values import Reader
from zdsl.model.units import UnitSpec
from zdsl.schedule import Schedule, Span


@dataclass
class Draft:
    """``schedule``: the schedule being filled; ``report``: where problems go; ``units``: the
    model's units once sized (None: unknown here, as for a model only the runtime can build)."""
    schedule: Schedule
    report: Reader
    units: list[UnitSpec] | None = None

    def span(self, key: str, span: Span) -> None:
        """Keep where ``key`` (``train.steps``, ``offload.parameters`` ...) was first set."""
        self.schedule.spans.setdefault(key, span)

    def errors(self) -> int:
        """How many errors have been reported so far."""
        return sum(d.is_error for d in self.report.diagnostics)


class StatementChecks:
    """Base of a class whose methods each read one statement into the draft; ``r`` is its
    reporter and ``s`` the schedule being filled (the names ``placement.py`` uses)."""

    def __init__(self, draft: Draft):
        self.draft = draft

    @property
    def r(self) -> Reader:
        return self.draft.report

    @property
    def s(self) -> Schedule:
        return self.draft.schedule

    @property
    def units(self) -> list[UnitSpec] | None:
        return self.draft.units

    def span(self, key: str, span: Span) -> None:
        self.draft.span(key, span)


def where(span: Span) -> str:
    """``file:line:column``, for a hint that points at another place."""
    return f"{span.file}:{span.line}:{span.column}"
