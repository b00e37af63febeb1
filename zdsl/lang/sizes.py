"""Byte units in .zs files: ``64MiB``, ``1.5GB``, ``16GiB``.

Decimal units are powers of 1000 (KB, MB, GB, TB), binary units powers of
1024 (KiB, MiB, GiB, TiB), as in the IEC standard. Parsing is exact
(``Decimal``) so that ``1.5KiB`` is 1536 bytes and never 1535.9999; a size
that is not a whole number of bytes is an error rather than a silent
rounding. :func:`format_size` gives back text that parses to the same
integer, which the printer relies on for its round trip; :func:`human_bytes`
is the approximate form every table and message shows a person.
"""
from __future__ import annotations

from decimal import Decimal, InvalidOperation

UNITS: dict[str, int] = {
    "B": 1,
    "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4,
    "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
}

# Sizes beyond this are certainly typos (a petabyte-class budget per rank).
MAX_BYTES = 1 << 60


class SizeError(ValueError):
    """A size that cannot be read; ``hint`` says how to fix it where we can tell."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def split_number(text: str) -> tuple[str, str]:
    """``"64MiB"`` -> ``("64", "MiB")``: the numeral and its unit suffix (maybe empty)."""
    i = len(text)
    while i > 0 and text[i - 1].isalpha():
        i -= 1
    # An exponent ("5e10") is part of the numeral, not a unit.
    numeral, unit = text[:i], text[i:]
    return numeral, unit


def parse_size(text: str) -> int:
    """Bytes in ``text`` (``"64MiB"``, ``"1.5GB"``, ``"4096"``; a bare number is bytes)."""
    numeral, unit = split_number(text.strip())
    if unit and unit not in UNITS:
        raise SizeError(f"unknown byte unit {unit!r}", hint=nearest_unit(unit))
    try:
        amount = Decimal(numeral.replace("_", "")) if numeral else None
    except InvalidOperation:
        amount = None
    if amount is None or not amount.is_finite():
        raise SizeError(f"{text!r} is not a size", hint="write a number and a unit, e.g. 64MiB")
    if amount > MAX_BYTES:
        raise SizeError(f"size {text} is too large", hint="sizes go up to 1024TiB")
    total = amount * UNITS[unit or "B"]
    if total != total.to_integral_value():
        raise SizeError(f"{text} is not a whole number of bytes")
    if total > MAX_BYTES:
        raise SizeError(f"size {text} is too large", hint="sizes go up to 1024TiB")
    return int(total)


def nearest_unit(unit: str) -> str:
    """A hint for a misspelt unit: same letters ignoring case, else the list."""
    for name in UNITS:
        if name.lower() == unit.lower():
            return f"did you mean {name!r}? units are case-sensitive"
    return "byte units are " + ", ".join(UNITS)


def format_size(n: int) -> str:
    """Exact text for ``n`` bytes, with the largest unit that divides it (``64MiB``, ``1500B``)."""
    if n < 0:
        raise ValueError("negative size")
    if n == 0:
        return "0B"
    for name in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "KB"):
        if n % UNITS[name] == 0:
            return f"{n // UNITS[name]}{name}"
    return f"{n}B"


def human_bytes(n: float) -> str:
    """Approximate text for a person (``1.50 GiB``, ``512 B``); not meant to be parsed back.

    The largest binary unit up to TiB that ``abs(n)`` reaches, with two
    decimals and a space; below 1 KiB whole bytes (a fraction is dropped).
    Negative ``n`` keeps its sign (``-2.00 MiB``), for differences.
    """
    for name in ("TiB", "GiB", "MiB", "KiB"):
        if abs(n) >= UNITS[name]:
            return f"{n / UNITS[name]:.2f} {name}"
    return f"{int(n)} B"
