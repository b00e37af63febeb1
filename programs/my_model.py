"""An example of your own model for zdsl: a small byte-level MLP language model.

zdsl trains any ``nn.Module`` that follows the unit protocol (written down in
``zdsl/runtime/models/protocol.py``): ``units()`` returns the model as an
ordered chain of modules, and zdsl gathers, computes, frees and offloads one
unit at a time. Point a schedule at this file with

    model "my_model.py:build"(hidden=64, layers=2)

(the path is relative to the schedule file). ``build(**kwargs)`` receives
the keyword arguments written in the schedule.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.loss import causal_lm_loss
from zdsl.runtime.models.protocol import run_units


class Embed(nn.Module):
    """Unit 0: token ids (batch, context) -> hidden states (batch, context, hidden)."""

    takes_batch = True   # zdsl calls embed(input_ids, batch): the micro-batch's positions are in it

    def __init__(self, vocab: int, context: int, hidden: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(context, hidden)

    def forward(self, idx: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.tokens(idx) + self.positions(batch.position_ids())


class Block(nn.Module):
    """A middle unit: one residual MLP over each position (no attention: it stays tiny). It needs
    nothing from the batch, so it takes the hidden state alone."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    """The last unit: (hidden, batch) -> the mean cross-entropy over the counted labels (-100: not counted)."""

    takes_batch = True

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return causal_lm_loss(self.out(self.norm(x)), batch.labels)


class TinyMLPLM(nn.Module):
    def __init__(self, vocab: int, context: int, hidden: int, layers: int):
        super().__init__()
        self.embed = Embed(vocab, context, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = Head(vocab, hidden)

    def units(self) -> list[nn.Module]:
        """The unit chain zdsl schedules: embedding, each block, head."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """As a plain module: the loss of token ids and their next tokens."""
        return run_units(self, Batch.of(idx, targets))


def build(vocab: int = 256, context: int = 32, hidden: int = 64, layers: int = 2) -> TinyMLPLM:
    """The factory a schedule names: ``model "my_model.py:build"(hidden=64)``."""
    return TinyMLPLM(vocab, context, hidden, layers)
