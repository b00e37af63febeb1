"""The built-in GPT (nanoGPT class), split into units.

Unit protocol (what zdsl needs of any model, built-in or a user's own)
-----------------------------------------------------------------------
A model is a plain ``nn.Module`` that also offers:

``units() -> list[nn.Module]``
    An ordered chain of at least two modules. Every parameter of the model
    is registered in exactly one unit; a unit's parameters are flattened in
    its ``named_parameters()`` order (registration order).
    * Unit 0 takes the token ids, an int64 tensor ``(batch, context)``.
    * Unit i > 0 takes unit i-1's output (one tensor).
    * The last unit takes ``(hidden, targets)`` (targets: int64
      ``(batch, context)``) and returns the scalar mean loss.
    Units only pass one tensor forward; everything else a unit needs must be
    its own parameters or a declared tied parameter.

``tied: dict[tuple[int, int], str | tuple[str, ...]]``
    ``{(user_unit, owner_unit): "param name in the owner unit"}``: unit
    ``user_unit`` reads a parameter registered in ``owner_unit`` without
    registering it itself (here the head reads the embedding's
    ``wte.weight``). zdsl gathers the owner's parameters where the user runs
    and sends the user's gradient of that parameter to the owner's gradient.
    Optional; missing means no tied parameters.

``forward(idx, targets) -> loss``
    Running the units in order. Keeps the model usable as a plain module
    (DDP, FSDP2, DeepSpeed, export).

A user's model comes from ``model "file.py:build"(k=v, ...)``: ``build(**kwargs)``
returns such a module (see ``zdsl.runtime.models.protocol``).

This GPT: token and position embeddings, pre-LayerNorm blocks (causal
self-attention through ``scaled_dot_product_attention`` and a GELU MLP),
final LayerNorm, logits through the token embedding's weight (tied), biases,
no dropout. Parameter names and order per unit are exactly
``zdsl.units.gpt_units`` (a test holds them together).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Embedding(nn.Module):
    """Unit 0: token ids -> hidden states (token plus position embedding)."""

    def __init__(self, vocab: int, context: int, width: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: one unit."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Last unit: final LayerNorm, logits through the embedding's ``wte`` (tied), loss.

    The embedding is held outside the module tree so ``wte.weight`` stays
    registered once (in unit 0); zdsl's flat buffers swap the parameter's
    storage and this reference follows.
    """

    def __init__(self, width: int, embedding: Embedding):
        super().__init__()
        self.ln_f = nn.LayerNorm(width)
        object.__setattr__(self, "_embedding", embedding)   # not a submodule: tied, not owned

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.ln_f(x), self._embedding.wte.weight)
        # The loss in fp32 whatever the compute dtype (as mixed-precision peers do).
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """nanoGPT-class GPT; ``units()`` = [embedding, *blocks, head].

    ``seed`` makes the initialisation deterministic without touching torch's
    global random state (its CPU generator is restored after the modules'
    default init): parameters are then initialised (nanoGPT's scheme: normal
    with std 0.02, residual projections scaled by 1/sqrt(2*layers), LayerNorm
    1/0, biases 0) from a private generator on the CPU and moved to
    ``device``, so every device and every peer (DDP, FSDP2, ...) starts from
    the same numbers. Under
    ``with torch.device("meta")`` the model stays on meta (sizing).
    """

    def __init__(self, layers: int = 4, width: int = 128, heads: int = 4, vocab: int = 256,
                 context: int = 64, seed: int = 0, device: str | torch.device | None = None):
        super().__init__()
        self.config = dict(layers=layers, width=width, heads=heads, vocab=vocab, context=context)
        ambient_meta = torch.empty(0).device.type == "meta"
        rng = None if ambient_meta else torch.random.get_rng_state()
        try:
            # Built on the CPU (not on meta: meta tensors pull in ~75 MB of torch's Python
            # decompositions), with torch's default init whose draws are then undone.
            with torch.device("meta" if ambient_meta else "cpu"):
                self.embedding = Embedding(vocab, context, width)
                self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
                self.head = Head(width, self.embedding)
        finally:
            if rng is not None:
                torch.random.set_rng_state(rng)
        self.tied = {(layers + 1, 0): "wte.weight"}
        if not ambient_meta:
            self.reset_parameters(seed)
            if device is not None:
                self.to(device)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        proj_std = 0.02 / math.sqrt(2 * len(self.blocks))
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                value = torch.zeros(p.shape)
            elif ".ln_" in name or name.startswith("head.ln_f"):
                value = torch.ones(p.shape)
            else:
                std = proj_std if name.endswith("c_proj.weight") else 0.02
                value = torch.empty(p.shape).normal_(0.0, std, generator=g)
            p.copy_(value.to(p.dtype))

    def units(self) -> list[nn.Module]:
        return [self.embedding, *self.blocks, self.head]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets)


def build(layers: int = 4, width: int = 128, heads: int = 4, vocab: int = 256, context: int = 64,
          seed: int = 0, device=None) -> GPT:
    """Factory with the same shape as a user's ``build`` (unit protocol)."""
    return GPT(layers=layers, width=width, heads=heads, vocab=vocab, context=context,
               seed=seed, device=device)
