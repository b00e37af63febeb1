"""A user's model for the tests: what programs/my_model.py shows, plus what real models carry.

``build(dropout=..., tied=...)`` follows the unit protocol (zdsl.runtime.models.gpt) and adds,
each optionally: dropout (HF GPT-2 uses 0.1), an output projection tied to the token embedding
and registered a second time at the top level as ``lm_head`` (so the state dict lists the weight
under two names, as HF's GPT-2 does), and persistent buffers (an integer and a float one).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

FACTORY = f"{Path(__file__).resolve()}:build"   # as a schedule names it: model "FILE:build"(...)


class Embed(nn.Module):
    def __init__(self, vocab: int, context: int, hidden: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(context, hidden)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("position_ids", torch.arange(context))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tokens(idx) + self.positions(self.position_ids[:idx.shape[1]]))


class Block(nn.Module):
    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("residual_scale", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.residual_scale + self.drop(self.down(self.drop(F.gelu(self.up(self.norm(x))))))


class Head(nn.Module):
    """The last unit. With ``lm_head`` given, its projection is that (tied) module, held outside
    this unit's module tree so the weight stays registered in unit 0 only."""

    def __init__(self, vocab: int, hidden: int, lm_head: nn.Linear | None):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        if lm_head is None:
            self.out = nn.Linear(hidden, vocab, bias=False)
        else:
            object.__setattr__(self, "out", lm_head)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class SmallLM(nn.Module):
    def __init__(self, vocab: int, context: int, hidden: int, layers: int, dropout: float, tied: bool):
        super().__init__()
        self.embed = Embed(vocab, context, hidden, dropout)
        self.blocks = nn.ModuleList(Block(hidden, dropout) for _ in range(layers))
        lm_head = None
        if tied:
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            self.lm_head.weight = self.embed.tokens.weight
            lm_head = self.lm_head
            self.tied = {(layers + 1, 0): "tokens.weight"}
        self.head = Head(vocab, hidden, lm_head)

    def units(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets)


def build(vocab: int = 64, context: int = 16, hidden: int = 32, layers: int = 2, dropout: float = 0.0,
          tied: bool = False) -> SmallLM:
    return SmallLM(vocab, context, hidden, layers, dropout, tied)
