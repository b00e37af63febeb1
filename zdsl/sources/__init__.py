"""Data sources on the compiler side: one object per kind, found by the kind's name.

``data KIND(...)`` (and ``eval ... on KIND(...)``) names a kind registered here. Each is a
:class:`~zdsl.sources.base.DataSource` in ``zdsl/sources/<kind>.py``: its settings and check,
how it meets the model, what it tells the sizing and how it is printed back. The runtime side
of the same kind (prepared once before the ranks start, then its batches) is
``zdsl/runtime/data/<kind>.py``, registered in ``zdsl/runtime/data/__init__.py``.

Adding a source: its module here, its module in the runtime, and a line in each registry. A
source whose batches come from outside is ``fed`` (``fed.py``): a schedule without ``data``,
whose batches the user's own loop feeds.
"""
from __future__ import annotations

from zdsl.sources import corpus, fed, jsonl, python, synthetic, text, tokens
from zdsl.sources.base import DataSource

# kind -> source, in the order hints list them
SOURCES: dict[str, DataSource] = {s.kind: s for s in (
    corpus.SOURCE, tokens.SOURCE, python.SOURCE, text.SOURCE, synthetic.SOURCE, jsonl.SOURCE, fed.SOURCE)}
# how "data is ..." lists them: the sources of a file first, the user's function last
_LISTED_BY_ARGUMENT = ("file", None, "function")


def source_of(kind: str) -> DataSource:
    """The source of ``kind``; ValueError for a kind no source has (the checker only lets known ones through)."""
    try:
        return SOURCES[kind]
    except KeyError:
        raise ValueError(f"unknown data source {kind!r} (expected {', '.join(SOURCES)})") from None


def listing() -> str:
    """Every source as a reader meets them: ``corpus(...), tokens(...), ... or python(...)``."""
    calls = [f"{s.kind}(...)" for s in sorted(SOURCES.values(), key=lambda s: _LISTED_BY_ARGUMENT.index(s.argument))]
    return f"{', '.join(calls[:-1])} or {calls[-1]}"


def sizing_data(data) -> dict:
    """``{"data": data}`` where the model's sizing takes the source (``zdsl.compile.models.units_for``:
    one row of a ``python(...)`` function's tensors, or of a fed batch, sizes a built model;
    ``jsonl(...)``'s padded or packed rows make the built-in GPT hold an attention mask; fed batches,
    whose row the Python API records from the first); else nothing, so sizers that take the model
    alone still work for such data."""
    return {"data": data} if data is not None and source_of(data.kind).sizes_the_model(data) else {}
