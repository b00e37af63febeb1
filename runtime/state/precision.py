"""Mixed precision: compute dtypes and fp16's dynamic loss scale.

bf16 and fp16 runs keep parameters and gradients in the compute dtype and an
fp32 master copy of the rank's shard with the optimizer state (ZeRO's 2+2+12
bytes per parameter). fp16's narrow range needs a loss scale: the loss is
multiplied by it before backward, gradients are divided by it before the
step, an overflow (inf or nan in the global gradient norm, which every rank
computes identically after its all-reduce) skips the step and halves the
scale, and ``growth_interval`` clean steps double it (as torch.amp's
GradScaler).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    try:
        return DTYPES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r} (expected fp32, bf16 or fp16)") from None


@dataclass
class LossScaler:
    """Dynamic loss scale (enabled for fp16 only; otherwise the scale stays 1)."""
    enabled: bool
    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    clean_steps: int = 0
    overflows: int = 0

    def __post_init__(self):
        if not self.enabled:
            self.scale = 1.0

    def update(self, overflow: bool) -> None:
        """After a step: back off on overflow, grow after enough clean steps."""
        if not self.enabled:
            return
        if overflow:
            self.overflows += 1
            self.clean_steps = 0
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.clean_steps = 0
            self.scale *= self.growth_factor


def overflowed(value: torch.Tensor) -> bool:
    return not bool(torch.isfinite(value).all())
