"""One micro-batch as a model's units see it (the unit protocol's per-batch context).

The protocol itself is documented in :mod:`zdsl.runtime.models.protocol`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

# A label that is not counted in the loss (torch's cross_entropy default and Hugging Face's).
IGNORE_INDEX = -100


@dataclass
class Batch:
    """One micro-batch on the rank's device.

    ``labels[b, t]`` is the token to predict at position ``t`` (already shifted, as zdsl's
    data gives it); ``IGNORE_INDEX`` marks a position not counted in the loss. ``positions``
    None means ``0..T-1`` in every row; ``attention_mask`` None means every token is real
    (1 = real, 0 = padding). ``segments`` None means one sequence per row; else (B, T) ints
    where a row packs several sequences: a token attends only to earlier tokens of its own
    segment (block-diagonal causal attention; ``positions`` then restart at 0 per segment).
    ``labels`` None: inputs only (``engine(x)`` given no labels; a model's loss needs them).
    ``extras`` is filled once per micro-batch by the model's ``prepare(batch)`` (rotary
    tables, 4-D masks, ...) and read by its units."""
    input_ids: torch.Tensor
    labels: torch.Tensor | None
    positions: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    extras: dict[Hashable, Any] = field(default_factory=dict)     # keys: a name, or a tuple with one

    @classmethod
    def of(cls, idx: torch.Tensor, targets: torch.Tensor | None) -> "Batch":
        """From the ``(idx, targets)`` pair a data source gives."""
        return cls(input_ids=idx, labels=targets)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """A copy on ``device`` (tensors in ``extras`` move too; other values are shared)."""
        def move(t):
            return t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t
        return Batch(input_ids=move(self.input_ids), labels=move(self.labels), positions=move(self.positions),
                     attention_mask=move(self.attention_mask), segments=move(self.segments),
                     extras={k: move(v) for k, v in self.extras.items()})

    def extra_tensors(self) -> list[torch.Tensor]:
        """The tensors ``extras`` holds (values, or inside tuple and list values), one per storage
        (on the meta device too). They belong to the micro-batch, not to any unit."""
        out: dict[int, torch.Tensor] = {}
        for value in self.extras.values():
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    out.setdefault(t.untyped_storage()._cdata, t)
        return list(out.values())

    def extras_bytes(self) -> int:
        """Bytes of the storages ``extras`` holds."""
        return sum(t.untyped_storage().nbytes() for t in self.extra_tensors())

    def loss_labels(self) -> torch.Tensor:
        """``labels``, for a loss that needs them: refused, naming the fix, when the batch has none."""
        if self.labels is None:
            raise ValueError("the model's loss needs labels and this batch has none: "
                             "give (inputs, labels) or a Batch with labels")
        return self.labels

    @property
    def masked(self) -> bool:
        """Whether attention must see more than causality: padding or packed segments."""
        return self.attention_mask is not None or self.segments is not None

    def position_ids(self) -> torch.Tensor:
        """``positions``, or ``0..T-1`` expanded to ``(B, T)`` (a view, no copy)."""
        if self.positions is not None:
            return self.positions
        B, T = self.input_ids.shape
        return torch.arange(T, device=self.input_ids.device).expand(B, T)


def allowed_keys(batch: Batch) -> torch.Tensor:
    """Which keys each query may see: (B or 1, 1, T, T) bool, causal, within the query's own
    segment, and never a padding key. A padding query may be left seeing nothing: each model
    keeps such a row finite its own way."""
    T = batch.input_ids.shape[1]
    device = batch.input_ids.device
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    if batch.segments is not None:
        allowed = allowed & (batch.segments[:, None, :, None] == batch.segments[:, None, None, :])
    if batch.attention_mask is not None:
        allowed = allowed & batch.attention_mask.bool()[:, None, None, :]
    return allowed


def as_batch(data) -> Batch:
    """A data source's micro-batch as a :class:`Batch`: a ``Batch`` as is, an ``(idx, targets)`` pair
    wrapped (the sources that give only tokens)."""
    return data if isinstance(data, Batch) else Batch.of(*data)
