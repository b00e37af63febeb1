"""What every data source is at run time: prepared once before the ranks start, then its batches.

One object per kind, ``SOURCE`` in ``zdsl/runtime/data/<kind>.py``, registered in
``zdsl/runtime/data/__init__.py``; the compiler side of the same kind (its settings and
check) is ``zdsl/sources/<kind>.py``. A source's module is imported when the source is
first used, by the launcher's pre-flight too, which must not load torch for a source
that prepares nothing: modules import torch and numpy where they make batches.
"""
from __future__ import annotations


class RuntimeSource:
    """A kind's run-time side; subclasses override :meth:`batch` and, where needed, the rest."""
    kind = ""

    def prepare(self, spec, schedule, progress: bool = False) -> tuple[str | None, str | None]:
        """Before any rank starts (``zdsl run``'s pre-flight; under torchrun, in each rank): the
        work done once (tokenising, a scan of the ids, a call of the user's function) and its
        checks. ``(the reason it cannot train, or None; a note for the user, or None)``;
        ``progress``: this process may draw a progress bar."""
        return None, None

    def batch(self, spec, seed: int, step: int, micro: int, rank: int, ranks: int, batch: int):
        """Rank ``rank``'s micro-batch ``micro`` of ``step`` (``zdsl.runtime.data.make_batch``'s contract)."""
        raise NotImplementedError(f"data {self.kind}(...) makes no batches")

    def vocab(self, spec) -> int:
        """Token ids the data can produce (the model's vocab must be at least this)."""
        return positive_setting(spec, "vocab")

    def meta_sample(self, spec):
        """One row of the data's ``(inputs, targets)`` on the meta device where a built model is
        sized from it (the source's tensors are its own), else None: sized at the context."""
        return None

    def row_origin(self, spec) -> str:
        """Where :meth:`meta_sample`'s row comes from, for a message about a batch of another shape."""
        return f"each row as data {spec.kind}(...) gives it"


class TokenWindows(RuntimeSource):
    """A source whose sample is ``context + 1`` token ids: the inputs, and the same shifted by one as targets."""

    def batch(self, spec, seed: int, step: int, micro: int, rank: int, ranks: int, batch: int):
        from zdsl.runtime.data.keys import step_keys
        context = positive_setting(spec, "context")
        keys = step_keys(seed, step, micro, rank, ranks, batch)
        rows = self.rows(spec, keys, context, lambda: step_keys(seed, step + 1, micro, rank, ranks, batch))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def rows(self, spec, keys, context: int, next_keys):
        """``(len(keys), context + 1)`` int64 tokens, a pure function of the keys; ``next_keys()``
        gives the next step's keys, for a source that reads ahead."""
        raise NotImplementedError


def positive_setting(spec, name: str) -> int:
    """``spec.args[name]``, which must be a positive integer (the checker filled it)."""
    value = spec.args.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"data {spec.kind}(...) needs {name}=<positive integer>, got {value!r}")
    return value
