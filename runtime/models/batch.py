"""One micro-batch as a model's units see it (the unit protocol's per-batch context).

The protocol itself is documented in :mod:`zdsl.runtime.models.protocol`.
"""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch

# A label that is not counted in the loss (torch's cross_entropy default and Hugging Face's).
IGNORE_INDEX = -100


@dataclass
class Batch:
    """One micro-batch on the rank's device.

    ``labels[b, t]`` is the token to predict at position ``t`` (already shifted, as zdsl's
    data gives it); ``IGNORE_INDEX`` marks a position not counted in the loss. ``positions``
    None means ``0..T-1`` in every row; ``attention_mask`` None means every token is real
    (1 = real, 0 = padding). ``extras`` is filled once per micro-batch by the model's
    ``prepare(batch)`` (rotary tables, 4-D masks, ...) and read by its units."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, idx: torch.Tensor, targets: torch.Tensor) -> "Batch":
        """From the ``(idx, targets)`` pair a data source gives."""
        return cls(input_ids=idx, labels=targets)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """A copy on ``device`` (tensors in ``extras`` move too; other values are shared)."""
        def move(t):
            return t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t
        return Batch(input_ids=move(self.input_ids), labels=move(self.labels), positions=move(self.positions),
                     attention_mask=move(self.attention_mask),
                     extras={k: move(v) for k, v in self.extras.items()})

    def position_ids(self) -> torch.Tensor:
        """``positions``, or ``0..T-1`` expanded to ``(B, T)`` (a view, no copy)."""
        if self.positions is not None:
            return self.positions
        B, T = self.input_ids.shape
        return torch.arange(T, device=self.input_ids.device).expand(B, T)
