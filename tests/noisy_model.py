"""A unit-protocol model that draws random numbers in every mode, eval included: its blocks drop
with ``F.dropout(training=True)``, as a model that keeps its dropout on in evaluation does.

An evaluation then moves the global generator; the rank state must put it back, or the next
training step draws other masks (tests/runtime/test_eval_rng.py). Named in a schedule as
``model "tests/noisy_model.py:build"(...)``; the protocol is ``programs/my_model.py``'s.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.loss import causal_lm_loss

FACTORY = f"{Path(__file__).resolve()}:build"


class Embed(nn.Module):
    takes_batch = True

    def __init__(self, vocab: int, context: int, hidden: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(context, hidden)

    def forward(self, idx: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.tokens(idx) + self.positions(batch.position_ids())


class NoisyBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.dropout(F.gelu(self.up(self.norm(x))), p=0.25, training=True))


class Head(nn.Module):
    takes_batch = True

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return causal_lm_loss(self.out(self.norm(x)), batch.labels)


class NoisyLM(nn.Module):
    def __init__(self, vocab: int, context: int, hidden: int, layers: int):
        super().__init__()
        self.embed = Embed(vocab, context, hidden)
        self.blocks = nn.ModuleList(NoisyBlock(hidden) for _ in range(layers))
        self.head = Head(vocab, hidden)

    def units(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]


def build(vocab: int = 64, context: int = 16, hidden: int = 32, layers: int = 2) -> NoisyLM:
    return NoisyLM(vocab, context, hidden, layers)
