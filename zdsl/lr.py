"""The learning rate at each step: linear warmup, then a stable stretch, then decay.

One formula, torch-free, used by the runtime (every optimizer path sets its
rate from it before each step); the parity tests' ``LambdaLR`` reference writes
the same formula out on its own, so a mistake here cannot hide in it. It is
torchtitan's ``linear_warmup_stable_decay`` with ``min_lr`` given as a rate.
For global step ``s`` (0-based, the same on every rank; a resumed run starts
at its checkpoint's step), ``T`` training steps, ``W = min(warmup, T)``
(torchtitan clamps a warmup longer than training; the checker warns),
``D = decay_steps`` (default ``T - W``) and ``m = min_lr / lr``::

    factor(s) = (s + 1) / (W + 1)                  s < W          (warmup; step 0 gets lr/(W+1))
              = 1                                  s < T - D      (stable)
              = m + (1 - m) * g(p)                 otherwise      (decay)
    p = min(1, (s + 1 - (T - D)) / D)
    g(p) = 1 - p (linear),  (1 + cos(pi * p)) / 2 (cosine),  1 (constant)

    lr(s) = lr * factor(s)

The last training step reaches ``min_lr`` (``p = 1``). ``lr * factor`` is
exactly what ``LambdaLR(optimizer, factor)`` writes into a group's rate,
so a torch reference over the same factor gets the same bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LrSchedule:
    lr: float
    steps: int                      # training steps T (the schedule's `train steps`)
    warmup: int = 0
    decay: str = "constant"
    min_lr: float = 0.0
    decay_steps: int | None = None  # None: every step after warmup

    @classmethod
    def of(cls, optimizer: dict, steps: int) -> "LrSchedule":
        """From the task graph's ``config["optimizer"]`` (absent keys: a constant rate)."""
        return cls(lr=optimizer.get("lr", 1e-3), steps=steps, warmup=optimizer.get("warmup", 0),
                   decay=optimizer.get("decay", "constant"), min_lr=optimizer.get("min_lr", 0.0),
                   decay_steps=optimizer.get("decay_steps"))

    @property
    def constant(self) -> bool:
        """Every step runs at ``lr`` itself (nothing to set)."""
        return self.warmup == 0 and self.decay == "constant"

    def factor(self, step: int) -> float:
        if self.decay not in DECAYS:
            raise ValueError(f"unknown decay {self.decay!r} (expected {', '.join(DECAYS)})")
        w = min(self.warmup, self.steps)
        d = self.steps - w if self.decay_steps is None else self.decay_steps
        if step < w:
            return float(step + 1) / (w + 1)
        if step < self.steps - d or d <= 0 or self.decay == "constant":
            return 1.0
        p = min(1.0, float(step + 1 - (self.steps - d)) / d)
        g = 1.0 - p if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
        m = self.min_lr / self.lr
        return m + (1.0 - m) * g

    def at(self, step: int) -> float:
        return self.lr * self.factor(step)
