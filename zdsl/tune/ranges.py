"""``--vary`` ranges: ``prefetch=0..4`` and ``bucket=256KiB..16MiB``, expanded into plain values.

Two kinds, told apart by their ends:

* **integers** (both ends plain whole numbers): every integer from the first to
  the last, stepping by 1 (``0..4`` -> 0, 1, 2, 3, 4);
* **sizes** (an end with a byte unit): the first end, then doubling while it
  stays below the last, then the last end itself (``256KiB..16MiB`` -> 256KiB,
  512KiB, 1MiB, ..., 16MiB; ``3MiB..16MiB`` -> 3MiB, 6MiB, 12MiB, 16MiB). A size
  range starts above zero, since zero does not double.

A range is one item of the comma list, so ranges and single values mix
(``bucket=0,256KiB..4MiB``). Bad ranges raise :class:`RangeError` with the fix.
"""
from __future__ import annotations

from zdsl.lang.sizes import SizeError, format_size, parse_size, split_number

MAX_VALUES = 64          # more than this from one range is a typo (0..1000), not a search space


class RangeError(ValueError):
    """A range that cannot be expanded; the message says how to write it."""


def is_range(item: str) -> bool:
    """``LO..HI``; a value with quotes, brackets or a slash (``hf("../pre")``) is a value, not a range."""
    return ".." in item and not any(ch in item for ch in '()[]"/\\ ')


def expand(key: str, item: str) -> list[str]:
    """The values ``item`` (``LO..HI``) stands for, as ``--set`` text."""
    lo_text, _, hi_text = item.partition("..")
    lo_text, hi_text = lo_text.strip(), hi_text.strip()
    example = f"e.g. {key}=0..4 (integers, step 1) or {key}=256KiB..16MiB (sizes, doubling)"
    if not lo_text or not hi_text or ".." in hi_text:
        raise RangeError(f"--vary {key}={item}: a range needs both ends, LO..HI ({example})")
    if _is_int(lo_text) and _is_int(hi_text):
        lo, hi = int(lo_text), int(hi_text)
        _check_order(key, item, lo, hi, lo_text, hi_text)
        values = [str(v) for v in range(lo, min(hi, lo + MAX_VALUES) + 1)]
    else:
        lo, hi = _size(key, item, lo_text, example), _size(key, item, hi_text, example)
        _check_order(key, item, lo, hi, lo_text, hi_text)
        if lo == 0:
            raise RangeError(f"--vary {key}={item}: a size range doubles from its first end, which "
                             f"cannot be 0; list 0 on its own: {key}=0,1KiB..{hi_text}")
        values, v = [], lo
        while v < hi and len(values) <= MAX_VALUES:
            values.append(format_size(v))
            v *= 2
        values.append(format_size(hi))
    if len(values) > MAX_VALUES:
        raise RangeError(f"--vary {key}={item}: more than {MAX_VALUES} values; narrow the range")
    return values


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


def _size(key: str, item: str, text: str, example: str) -> int:
    numeral, _ = split_number(text)
    try:
        return parse_size(text)
    except SizeError as exc:
        hint = f"; {exc.hint}" if exc.hint else ""
        raise RangeError(f"--vary {key}={item}: {text!r} is neither an integer nor a size"
                         f"{hint if numeral else ''} ({example})") from None


def _check_order(key: str, item: str, lo: int, hi: int, lo_text: str, hi_text: str) -> None:
    if lo < 0:
        raise RangeError(f"--vary {key}={item}: a range starts at 0 or above")
    if lo >= hi:
        raise RangeError(f"--vary {key}={item}: the first end must be below the last; "
                         f"write {key}={hi_text}..{lo_text}" if lo > hi else
                         f"--vary {key}={item}: both ends are equal; write the single value {key}={lo_text}")
