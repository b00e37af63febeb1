"""``data fed``: the batches come from the user's own loop (``zdsl.initialize``'s ``engine(x)``).

A schedule without a ``data`` statement has this source. zdsl makes no batches of it: ``zdsl run``
refuses it (``zdsl/check/loop.py``), and a user's loop feeds each batch. What the compiler needs
from it is the batch's shape: ``train batch=`` rows, each ``context`` token ids where the model takes
them (its context by default, ``data fed(context=N)`` for fewer), else one row of the user's own
tensors, which ``initialize`` records from the first batch (``row``; ``runtime/api/deferred.py``).
The runtime side is ``zdsl/runtime/data/fed.py``.
"""
from __future__ import annotations

from zdsl.schedule import DataSpec
from zdsl.sources.base import DataSource, SourceCall

ROW = "row"        # args key of the first batch's row: {"inputs": shape, "inputs_dtype": name, "labels"...}


class FedSource(DataSource):
    kind = "fed"
    settings = ("context",)
    example = "fed(context=64)"
    argument = None

    def sizes_the_model(self, spec: DataSpec) -> bool:
        return True         # a recorded row sizes the user's model; before one, the sizer may wait for it

    def check(self, at: SourceCall) -> DataSpec | None:
        if at.key != "data":
            at.report.error(at.call.span, "eval batches come from zdsl: fed(...) is only the training's data",
                            hint="name a source, e.g. eval ... on synthetic(vocab=256, context=64); in your "
                                 "own loop, evaluate with engine(x) under torch.no_grad()")
            return None
        return super().check(at)

    def user_model_needs(self) -> tuple[str, ...]:
        return ()           # the batches the loop feeds give the row

    def written(self, spec: DataSpec) -> tuple[str | None, list[tuple[str, object]]]:
        return None, [(k, v) for k, v in spec.args.items() if k != ROW]

    @staticmethod
    def deferred(spec: DataSpec, model_kind: str) -> bool:
        """Whether the model is sized only from the first fed batch: its row is not yet recorded and
        the model is the user's (its inputs are its own business), not token ids of a context."""
        return spec.kind == "fed" and ROW not in spec.args and model_kind in ("loop", "user")


SOURCE = FedSource()
