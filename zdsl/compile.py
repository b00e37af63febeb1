"""From a .zs file to a checked, lowered, verified task graph: the one path every command takes."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Diagnostic, UsageError, ZsError, error, render
from .ir import TaskGraph
from .schedule import Schedule, Span
from .units import UnitSpec


class CompileError(Exception):
    """A schedule rejected before any rank starts; ``rendered`` is what the user reads."""

    def __init__(self, rendered: str, exit_code: int = 1):
        super().__init__(rendered)
        self.rendered = rendered
        self.exit_code = exit_code


@dataclass
class Compiled:
    schedule: Schedule
    units: list[UnitSpec]
    graph: TaskGraph
    warnings: list[str] = field(default_factory=list)   # rendered


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["steps=5", "zero=3"]`` -> dict; a malformed item is a usage error (exit 2)."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise CompileError(f"zdsl: error: --set takes KEY=VALUE, got {item!r}", exit_code=2)
        out[key.strip()] = value.strip()
    return out


def compile_file(path: str, overrides: dict[str, str] | None = None, verify: bool = True) -> Compiled:
    """Check, lower and verify ``path``; raises CompileError with every message rendered."""
    from .check import load_schedule
    from .instantiate import LoweringError, compile_schedule
    from .models import ModelSizingError, units_for

    sized: dict[int, list[UnitSpec]] = {}

    def remember_units(spec):
        sized[0] = units_for(spec)
        return sized[0]

    try:
        schedule, diagnostics = load_schedule(path, overrides or {}, units_for=remember_units)
    except UsageError as exc:
        raise CompileError(exc.render(), exit_code=2) from None
    except ZsError as exc:
        raise CompileError(exc.render(), exit_code=1) from None
    except ModelSizingError as exc:
        span = None
        raise CompileError(render(error(span, f"{path}: {exc}")), exit_code=1) from None
    try:
        units = sized.get(0) or units_for(schedule.model)
    except ModelSizingError as exc:
        raise CompileError(render(error(schedule.spans.get("model"), str(exc))), exit_code=1) from None
    try:
        graph = compile_schedule(schedule, units)
    except LoweringError as exc:
        raise CompileError(render(error(exc.span or schedule.spans.get("schedule"), str(exc), exc.hint)),
                           exit_code=1) from None
    if verify:
        from .verify import verify as verify_graph
        diagnostics = list(diagnostics) + verify_graph(graph, schedule)
    errors = [d for d in diagnostics if d.is_error]
    if errors:
        raise CompileError("\n".join(render(d) for d in diagnostics), exit_code=1)
    return Compiled(schedule, units, graph, [render(d) for d in diagnostics])


__all__ = ["CompileError", "Compiled", "compile_file", "parse_overrides", "Diagnostic", "Span"]
