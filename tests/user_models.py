"""Users' models for the tests, in both forms of the unit protocol (zdsl.runtime.models.protocol).

``build(dropout=..., tied=...)`` is in the first form (units take the hidden state alone, the
last ``(hidden, targets)``; it must keep working) and adds, each optionally: dropout (HF GPT-2
uses 0.1), an output projection tied to the token embedding and registered a second time at the
top level as ``lm_head`` (so the state dict lists the weight under two names, as HF's GPT-2
does), and persistent buffers (an integer and a float one).

``build_batched(...)`` takes the batch as real models need it: positions (a learned table and
rotary tables), the attention mask (a 4-D causal and padding mask), both made once per
micro-batch by ``prepare`` from a buffer outside every unit, and labels with -100.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.loss import causal_lm_loss
from zdsl.runtime.models.protocol import run_units

FACTORY = f"{Path(__file__).resolve()}:build"   # as a schedule names it: model "FILE:build"(...)
BATCHED_FACTORY = f"{Path(__file__).resolve()}:build_batched"


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


class Rotary(nn.Module):
    """Rotary tables from positions (a buffer, no parameter: ``prepare`` may read it)."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq          # (B, T, head_dim / 2)
        return angles.cos()[:, None], angles.sin()[:, None]             # (B, 1, T, head_dim / 2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


NOISY_FACTORY = f"{Path(__file__).resolve()}:build_noisy"


class NoisyBlock(Block):
    """Drops in every mode, eval included (``F.dropout(training=True)``), as a model that keeps its
    dropout on in evaluation does: an evaluation then moves the global generator, which the rank
    state must put back (tests/runtime/test_eval_rng.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.dropout(F.gelu(self.up(self.norm(x))), p=0.25, training=True))


def build_noisy(vocab: int = 64, context: int = 16, hidden: int = 32, layers: int = 2) -> SmallLM:
    model = SmallLM(vocab, context, hidden, layers, dropout=0.0, tied=False)
    model.blocks = nn.ModuleList(NoisyBlock(hidden, 0.0) for _ in range(layers))
    return model


class BatchEmbed(nn.Module):
    takes_batch = True

    def __init__(self, vocab: int, context: int, hidden: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(2 * context, hidden)   # rows may start past 0 (packed sequences)

    def forward(self, idx: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.tokens(idx) + self.positions(batch.position_ids())


class BatchBlock(nn.Module):
    """Attention with rotary q and k and the prepared mask, then an MLP."""
    takes_batch = True

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm_2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm_1(x)).split(C, dim=2))
        cos, sin = batch.extras["cos"], batch.extras["sin"]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.extras["mask"])
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.norm_2(x))))


class BatchHead(nn.Module):
    takes_batch = True

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return causal_lm_loss(self.out(self.norm(x)), batch.labels)


class BatchedLM(nn.Module):
    def __init__(self, vocab: int, context: int, hidden: int, layers: int, heads: int):
        super().__init__()
        self.rotary = Rotary(hidden // heads)   # outside every unit: read by prepare only
        self.embed = BatchEmbed(vocab, context, hidden)
        self.blocks = nn.ModuleList(BatchBlock(hidden, heads) for _ in range(layers))
        self.head = BatchHead(vocab, hidden)

    def units(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def prepare(self, batch: Batch) -> None:
        ids = batch.input_ids
        T = ids.shape[1]
        batch.extras["cos"], batch.extras["sin"] = self.rotary(batch.position_ids())
        mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()[None, None]   # causal
        if batch.attention_mask is not None:   # no padding key; a padding query sees itself (no empty row)
            itself = torch.eye(T, dtype=torch.bool, device=ids.device)
            mask = (mask & batch.attention_mask.bool()[:, None, None, :]) | itself
        batch.extras["mask"] = mask

    def forward(self, batch: Batch) -> torch.Tensor:
        return run_units(self, batch)


def build_batched(vocab: int = 64, context: int = 16, hidden: int = 32, layers: int = 2,
                  heads: int = 2) -> BatchedLM:
    return BatchedLM(vocab, context, hidden, layers, heads)
