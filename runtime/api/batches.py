"""What ``engine(x)`` takes, and the shape the schedule compiled for.

``x`` is a tensor (unit 0's input), a pair ``(inputs, labels)`` (the last unit of a model of the
unit protocol scores ``labels``, as ``zdsl run``'s batches give them), or a ``Batch``. The step
graph was planned for one shape: ``train batch=`` rows of what the schedule's data gives (a
``python(...)`` function's row, a fed batch's as the first ``engine(x)`` gave it, else ``context``
token ids). A training batch of another shape is
refused, saying what was compiled and what to change; a forward-only pass may have any number of
rows (it holds no activations for a backward), its row shape checked the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zdsl.errors import ZdslApiError
from zdsl.runtime.models.batch import Batch


@dataclass(frozen=True)
class Compiled:
    """The batch a schedule's graph was compiled for: rows, then each tensor's row shape and dtype."""
    rows: int
    inputs: tuple
    input_dtype: torch.dtype
    labels: tuple
    label_dtype: torch.dtype
    source: str                 # where the row shape comes from, for the message

    @classmethod
    def of(cls, schedule) -> "Compiled":
        """What the schedule's data sizes the graph with (``runtime/sizing.py``'s ``sizing_inputs``):
        one row of the source's own tensors, else token ids of the run's context."""
        from zdsl.compile.models import run_context
        from zdsl.runtime.data import runtime_source
        from zdsl.runtime.sizing import sizing_inputs
        rows, data = schedule.train.batch, schedule.data
        context, sample, _ = sizing_inputs(data, run_context(schedule))
        if sample is not None:
            inputs, labels = sample
            return cls(rows, tuple(inputs.shape[1:]), inputs.dtype, tuple(labels.shape[1:]), labels.dtype,
                       runtime_source(data.kind).row_origin(data))
        return cls(rows, (context,), torch.int64, (context,), torch.int64,
                   f"each row {context} token ids (the data's context)")

    def describe(self) -> str:
        shape = lambda row: tuple([self.rows, *row])   # noqa: E731
        return f"inputs {dtype_name(self.input_dtype)} {shape(self.inputs)}"

    def check(self, batch: Batch, call: str, rank: int, training: bool) -> str | None:
        """Why ``batch`` is not of the compiled shape, or None."""
        x = batch.input_ids
        rows_ok = x.dim() > 0 and (x.shape[0] == self.rows or not training)
        if rows_ok and tuple(x.shape[1:]) == self.inputs and same_kind(x.dtype, self.input_dtype):
            if batch.labels is None or tuple(batch.labels.shape[1:]) == self.labels:
                return None
            got = f"labels of shape {tuple(batch.labels.shape)}"
            want = f"labels {tuple([self.rows, *self.labels])}"
        else:
            got = f"inputs {dtype_name(x.dtype)} {tuple(x.shape)}"
            want = self.describe()
        return (f"rank {rank}: {call}: a batch of {got}, but the schedule was compiled for {want} (train batch="
                f"{self.rows}, {self.source}); feed batches of that shape, or change `train batch=` or the data "
                f"statement to the batches you feed")


def same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Float against float, integer against integer (fp32 features feed bf16 weights, cast in unit 0)."""
    return a.is_floating_point == b.is_floating_point


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_batch(x, call: str, rank: int) -> Batch:
    """``x`` (a tensor, a pair, or a ``Batch``) as a ``Batch``; :class:`ZdslApiError` for anything else."""
    if isinstance(x, Batch):
        return x
    if isinstance(x, torch.Tensor):
        return Batch(input_ids=x.detach(), labels=None)
    if isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x):
        return Batch.of(x[0].detach(), x[1].detach())
    raise ZdslApiError(f"rank {rank}: {call}: takes a tensor, a pair (inputs, labels) of tensors or a Batch, "
                       f"not {type(x).__name__}")
