"""``data fed``'s run-time side: zdsl makes no batches, the user's loop feeds them (``zdsl.initialize``).

The compiler side is ``zdsl/sources/fed.py``. Its one job here is the sizing's sample: the row
``initialize`` recorded from the first fed batch (``row`` in the spec's settings), on the meta device.
"""
from __future__ import annotations

from zdsl.runtime.data.source import RuntimeSource
from zdsl.sources.fed import ROW

NO_BATCHES = ("the schedule has no data statement: its batches come from your own loop (zdsl.initialize); "
              "add a data statement for zdsl to make them")


class FedSource(RuntimeSource):
    kind = "fed"

    def prepare(self, spec, schedule, progress: bool = False) -> tuple[str | None, str | None]:
        return NO_BATCHES, None

    def batch(self, spec, seed: int, step: int, micro: int, rank: int, ranks: int, batch: int):
        raise ValueError(NO_BATCHES)

    def meta_sample(self, spec):
        """One row of the fed batch as ``initialize`` recorded it, or None (token ids of the context)."""
        row = spec.args.get(ROW)
        if row is None:
            return None
        import torch

        def meta(part: str):
            if row[part] is None:            # fed without labels: a placeholder the units never read
                return torch.zeros(1, dtype=torch.int64, device="meta")
            return torch.empty([1, *row[part]], dtype=getattr(torch, row[f"{part}_dtype"]), device="meta")
        return meta("inputs"), meta("labels")

    def row_origin(self, spec) -> str:
        return "each row as the first engine(x) fed it (the schedule has no data statement)"


SOURCE = FedSource()


def row_of(inputs, labels) -> dict:
    """The row a fed batch has (its shapes past the rows, its dtypes), as ``ROW`` holds it."""
    def name(t) -> str:
        return str(t.dtype).removeprefix("torch.")
    return {"inputs": list(inputs.shape[1:]), "inputs_dtype": name(inputs),
            "labels": None if labels is None else list(labels.shape[1:]),
            "labels_dtype": None if labels is None else name(labels)}


def with_row(spec, row: dict):
    """A copy of the fed ``spec`` holding ``row``: what the compiler sizes the model with."""
    import dataclasses
    return dataclasses.replace(spec, args={**spec.args, ROW: row})
