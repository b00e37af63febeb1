"""Diagnostics: what went wrong, where, and how to fix it.

Every error or warning about a schedule is a :class:`Diagnostic` with the
:class:`~zdsl.schedule.Span` of the offending token. :func:`render` prints
it the way compilers do::

    quickstart.zs:7:10: error: unknown state 'gradient'
        offload  gradient -> cpu
                 ^~~~~~~~
    hint: did you mean 'gradients'?

Invalid input is reported by raising :class:`ZsError` with all the errors
found; a user never sees a Python traceback for a bad schedule.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

from zdsl.schedule import Span

ERROR = "error"
WARNING = "warning"
NOTE = "note"              # where a duplicate was first set; accompanies an error


@dataclass
class Diagnostic:
    severity: str                      # "error", "warning" or "note"
    span: Span | None                  # None: not about a place in a file (a usage error)
    message: str
    hint: str | None = None
    source_line: str | None = field(default=None, compare=False)  # the line, kept for render

    @property
    def is_error(self) -> bool:
        return self.severity == ERROR


class ZsError(Exception):
    """A schedule that cannot be accepted; ``diagnostics`` says why (errors first)."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = list(diagnostics)
        first = next((d for d in self.diagnostics if d.is_error), None) or \
            (self.diagnostics[0] if self.diagnostics else None)
        super().__init__(first.message if first else "invalid schedule")

    def render(self, source_text: str | None = None) -> str:
        return "\n".join(render(d, source_text) for d in self.diagnostics)


class UsageError(ZsError):
    """A bad command line (an unknown ``--set`` key): exit status 2, not 1."""


def error(span: Span | None, message: str, hint: str | None = None) -> Diagnostic:
    return Diagnostic(ERROR, span, message, hint)


def warning(span: Span | None, message: str, hint: str | None = None) -> Diagnostic:
    return Diagnostic(WARNING, span, message, hint)


def note(span: Span | None, message: str) -> Diagnostic:
    return Diagnostic(NOTE, span, message)


SHOWN_PER_SEVERITY = 50    # a file with thousands of errors prints the first ones and a count


def capped(diagnostics: list[Diagnostic], limit: int = SHOWN_PER_SEVERITY
           ) -> tuple[list[Diagnostic], dict[str, int]]:
    """The first ``limit`` errors and the first ``limit`` warnings (each with the notes that
    follow it), and how many of each severity were left out."""
    shown: list[Diagnostic] = []
    kept: dict[str, int] = {}
    left_out: dict[str, int] = {}
    keep_notes = True
    for d in diagnostics:
        if d.severity == NOTE:
            if keep_notes:
                shown.append(d)
            continue
        keep_notes = kept.get(d.severity, 0) < limit
        if keep_notes:
            kept[d.severity] = kept.get(d.severity, 0) + 1
            shown.append(d)
        else:
            left_out[d.severity] = left_out.get(d.severity, 0) + 1
    return shown, left_out


def more_line(severity: str, count: int, file: str) -> str:
    """``... and 15950 more errors in x.zs``: what :func:`capped` left out."""
    return f"... and {count} more {severity}{'s' if count != 1 else ''} in {file}"


def did_you_mean(word: str, choices, what: str | None = None) -> str | None:
    """``did you mean 'gradients'?`` for the nearest choice, else the list of choices."""
    choices = [c for c in choices if c]
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        close = [c for c in choices if c.lower() == str(word).lower()]
    if close:
        return f"did you mean {close[0]!r}?"
    if what and choices:
        return f"{what} " + ", ".join(repr(c) for c in choices)
    return None


def attach_sources(diagnostics: list[Diagnostic], sources: dict[str, str]) -> None:
    """Remember the source line of each diagnostic so render needs no file access."""
    split: dict[str, list[str]] = {}        # each file split once: a line per diagnostic is linear
    for d in diagnostics:
        if d.source_line is None and d.span is not None and d.span.file in sources:
            file = d.span.file
            if file not in split:
                split[file] = sources[file].splitlines()
            d.source_line = _line_in(split[file], d.span.line)


def line_of(text: str, line: int) -> str | None:
    return _line_in(text.splitlines(), line)


def _line_in(lines: list[str], line: int) -> str | None:
    lines = lines or [""]
    if 1 <= line <= len(lines):
        return lines[line - 1]
    if line == len(lines) + 1:
        return ""
    return None


def _printable(line: str) -> str:
    """The line with control characters shown as '?' (one column each, tabs kept)."""
    return "".join(c if c == "\t" or c.isprintable() else "?" for c in line)


def render(diag: Diagnostic, source_text: str | None = None) -> str:
    """``FILE:LINE:COL: SEVERITY: MESSAGE``, the line, a caret under the token, ``hint:``.

    The line comes from the diagnostic itself when the checker recorded it
    (needed for errors inside included files), else from ``source_text``,
    else from the file on disk.
    """
    span = diag.span
    if span is None:
        out = [f"zdsl: {diag.severity}: {diag.message}"]
    else:
        out = [f"{span.file}:{span.line}:{span.column}: {diag.severity}: {diag.message}"]
        line = diag.source_line
        if line is None and source_text is not None:
            line = line_of(source_text, span.line)
        if line is None:
            line = _read_line(span.file, span.line)
        if line is not None:
            line = _printable(line)
            col = max(1, span.column)
            end = span.end_column if span.end_column and span.end_column > col else col + 1
            end = min(end, max(len(line) + 1, col + 1))
            if len(line) > _MAX_SHOWN:
                line, col, end = _window(line, col, end)
            pad = "".join("\t" if c == "\t" else " " for c in line[:col - 1])
            pad += " " * max(0, col - 1 - len(line))
            out.append("    " + line)
            out.append("    " + pad + "^" + "~" * (end - col - 1))
    if diag.hint:
        out.append(f"hint: {diag.hint}")
    return "\n".join(out)


_MAX_SHOWN = 160


def _window(line: str, col: int, end: int) -> tuple[str, int, int]:
    """A long line cut down to the part around the caret, with '...' where cut."""
    lo = max(0, col - 1 - 60)
    hi = min(len(line), lo + _MAX_SHOWN - 20)
    prefix = "..." if lo > 0 else ""
    suffix = "..." if hi < len(line) else ""
    shift = len(prefix) - lo
    return prefix + line[lo:hi] + suffix, col + shift, min(end, hi + 1) + shift


def _read_line(file: str, line: int) -> str | None:
    try:
        text = Path(file).read_bytes().decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return None
    return line_of(text, line)
