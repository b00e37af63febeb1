"""Reading AST values as typed settings, with positioned errors.

A value's meaning depends on where it is used (``64MiB`` is a size, ``2`` a
count, ``1e-3`` a rate), so the parser keeps the text and these helpers read
it for each use. Each helper records an error on the :class:`Reader` and
returns None instead of raising, so one pass over a file reports every
problem in it.
"""
from __future__ import annotations

import math
from typing import Callable

from zdsl.lang import ast
from zdsl.lang.errors import Diagnostic, did_you_mean, error, warning
from zdsl.lang.sizes import SizeError, parse_size, split_number
from zdsl.schedule import Span

MAX_INT_DIGITS = 18


def describe(value) -> str:
    """How a value reads in a message: ``64MiB``, ``"x"``, ``fp32``, ``(0.9, 0.95)``."""
    if isinstance(value, ast.Num):
        return value.text
    if isinstance(value, ast.Str):
        return f'"{value.value}"'
    if isinstance(value, ast.Name):
        return value.value
    if isinstance(value, ast.Tuple):
        return "(" + ", ".join(describe(v) for v in value.items) + ")"
    return "?"


def number_of(text: str) -> tuple[int | float | None, str, str | None]:
    """``"-1e-3"`` -> (-0.001, "", None); returns (value, unit, problem)."""
    sign = -1 if text.startswith("-") else 1
    numeral, unit = split_number(text.lstrip("-"))
    digits = numeral.replace("_", "")
    if not digits or not digits[0].isdigit() or "__" in numeral or numeral.endswith("_"):
        return None, unit, f"{text!r} is not a number"
    is_float = any(c in digits for c in ".eE")
    if not is_float:
        if len(digits) > MAX_INT_DIGITS:
            return None, unit, f"number {text} is too large"
        return sign * int(digits), unit, None
    try:
        value = float(digits)
    except ValueError:
        return None, unit, f"{text!r} is not a number"
    if not math.isfinite(value) or value > 1e30:
        return None, unit, f"number {text} is out of range"
    return sign * value, unit, None


class Reader:
    """Collects diagnostics while values are read."""

    def __init__(self):
        self.diagnostics: list[Diagnostic] = []

    def error(self, span: Span | None, message: str, hint: str | None = None) -> None:
        self.diagnostics.append(error(span, message, hint))

    def warn(self, span: Span | None, message: str, hint: str | None = None) -> None:
        self.diagnostics.append(warning(span, message, hint))

    @property
    def failed(self) -> bool:
        return any(d.is_error for d in self.diagnostics)

    # -- scalars -------------------------------------------------------------------

    def _plain_number(self, value, what: str):
        if not isinstance(value, ast.Num):
            self.error(value.span, f"{what} must be a number, not {describe(value)}")
            return None
        number, unit, problem = number_of(value.text)
        if problem:
            self.error(value.span, f"{what}: {problem}")
            return None
        if unit:
            self.error(value.span, f"{what} takes a plain number, not {value.text}",
                       hint=f"write {value.text[:len(value.text) - len(unit)]}")
            return None
        return number

    def integer(self, value, what: str, lo: int | None = None, hi: int | None = None) -> int | None:
        number = self._plain_number(value, what)
        if number is None:
            return None
        if isinstance(number, float):
            if not number.is_integer():
                self.error(value.span, f"{what} must be a whole number, not {value.text}")
                return None
            number = int(number)
        return self._in_range(value, what, number, lo, hi)

    def real(self, value, what: str, lo: float | None = None, hi: float | None = None,
             lo_open: bool = False, hi_open: bool = False) -> float | None:
        number = self._plain_number(value, what)
        if number is None:
            return None
        number = float(number)
        low_bad = lo is not None and (number <= lo if lo_open else number < lo)
        high_bad = hi is not None and (number >= hi if hi_open else number > hi)
        if low_bad or high_bad:
            self.error(value.span, f"{what} must be {_interval(lo, hi, lo_open, hi_open)}, "
                                   f"not {value.text}")
            return None
        return number

    def _in_range(self, value, what, number: int, lo, hi):
        if lo is not None and number < lo or hi is not None and number > hi:
            if lo is not None and hi is not None and hi - lo < 16:
                bound = f"between {lo} and {hi}"
            elif lo is not None and number < lo:
                bound = f"at least {lo}"
            else:
                bound = f"at most {hi}"
            self.error(value.span, f"{what} must be {bound}, not {value.text}")
            return None
        return number

    def size(self, value, what: str, lo: int = 0) -> int | None:
        """Bytes: ``64MiB`` or a plain number of bytes."""
        if not isinstance(value, ast.Num):
            self.error(value.span, f"{what} must be a size like 64MiB, not {describe(value)}")
            return None
        if value.text.startswith("-"):
            self.error(value.span, f"{what} cannot be negative")
            return None
        try:
            n = parse_size(value.text)
        except SizeError as exc:
            self.error(value.span, f"{what}: {exc}", hint=exc.hint)
            return None
        if n < lo:
            self.error(value.span, f"{what} must be at least {lo} bytes, not {value.text}")
            return None
        return n

    def boolean(self, value, what: str) -> bool | None:
        if isinstance(value, ast.Name) and value.value in ("true", "false"):
            return value.value == "true"
        self.error(value.span, f"{what} must be true or false, not {describe(value)}",
                   hint=did_you_mean(describe(value), ["true", "false"]))
        return None

    def string(self, value, what: str) -> str | None:
        if isinstance(value, ast.Str):
            if not value.value:
                self.error(value.span, f"{what} must not be empty")
                return None
            if "\x00" in value.value:
                self.error(value.span, f"{what} must not contain a NUL character")
                return None
            return value.value
        self.error(value.span, f"{what} must be a string in double quotes, not {describe(value)}",
                   hint=f'write "{describe(value)}"' if isinstance(value, ast.Name) else None)
        return None

    def choice(self, value, what: str, choices) -> str | None:
        if isinstance(value, ast.Name) and value.value in choices:
            return value.value
        shown = describe(value)
        self.error(value.span, f"unknown {what} {shown!r}" if isinstance(value, ast.Name)
                   else f"{what} must be one of {', '.join(choices)}, not {shown}",
                   hint=did_you_mean(shown, choices, what=f"{what} is one of"))
        return None

    def python(self, value):
        """A user model's keyword argument as a Python value."""
        if isinstance(value, ast.Num):
            number, unit, problem = number_of(value.text)
            if problem:
                self.error(value.span, problem)
                return None
            if unit:
                return self.size(value, "size")
            return number
        if isinstance(value, ast.Str):
            return value.value
        if isinstance(value, ast.Name):
            return {"true": True, "false": False, "none": None}.get(value.value, value.value)
        if isinstance(value, ast.Tuple):
            return tuple(self.python(v) for v in value.items)
        return None

    # -- keyword arguments ---------------------------------------------------------

    def keywords(self, args: list[ast.Arg], allowed, what: str) -> dict[str, ast.Arg]:
        """``key=value`` args by key; unknown, duplicate or positional ones are errors."""
        out: dict[str, ast.Arg] = {}
        for arg in args:
            if arg.key is None:
                self.error(arg.span, f"{what} takes key=value settings, not a bare "
                                     f"{describe(arg.value)}",
                           hint=f"{what} settings: " + ", ".join(allowed) if allowed else None)
                continue
            key = arg.key.value
            if allowed is not None and key not in allowed:
                self.error(arg.key.span, f"{what} has no setting {key!r}",
                           hint=did_you_mean(key, allowed, what="settings are"))
                continue
            if key in out:
                self.error(arg.key.span, f"{key} is set twice",
                           hint=f"the first is at column {out[key].span.column}; keep one")
                continue
            out[key] = arg
        return out

    def free_settings(self, args: list[ast.Arg], record: Callable[[str, Span], None], reserved=(),
                      why: str = "", fix: str = "") -> dict:
        """A call's free-form ``name=value`` settings as Python values (passed on to a user's function
        or a model's config; bare values are left to the caller), each one's span given to ``record``;
        a name set twice or ``reserved`` is an error (``why``, ``fix``: its message and hint, ``{name}``
        filled in)."""
        out: dict = {}
        for arg in args:
            if arg.key is None:
                continue
            name = arg.key.value
            if name in out:
                self.error(arg.key.span, f"{name} is set twice")
            elif name in reserved:
                self.error(arg.key.span, why.format(name=name), hint=fix.format(name=name))
            else:
                out[name] = self.python(arg.value)
                record(name, arg.span)
        return out


def _interval(lo, hi, lo_open, hi_open) -> str:
    if hi is None:
        return f"greater than {lo:g}" if lo_open else f"at least {lo:g}"
    if lo is None:
        return f"less than {hi:g}" if hi_open else f"at most {hi:g}"
    return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
