"""The built-in GPT (nanoGPT class), split into units.

It follows the unit protocol, documented in one place: :mod:`zdsl.runtime.models.protocol`.

This GPT: token and position embeddings, pre-LayerNorm blocks (causal
self-attention through ``scaled_dot_product_attention`` and a GELU MLP),
final LayerNorm, logits through the token embedding's weight (tied), biases,
no dropout. Every unit takes the batch: the embedding its positions, the blocks its
attention mask, the head its labels (``-100`` not counted). Attention is causal; a
batch with an ``attention_mask`` or ``segments`` (padded or packed rows) also hides
padding keys and other segments' keys (:func:`zdsl.runtime.models.batch.allowed_keys`),
through one additive mask per micro-batch that every block's attention shares (see
:func:`attention_mask`). A batch with neither takes the plain causal kernel (no mask at
all), bit for bit as before masks existed.
Parameter names and order per unit are exactly
``zdsl.model.units.gpt_units`` (a test holds them together).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zdsl.runtime.models.batch import Batch, allowed_keys
from zdsl.runtime.models.lazy import LazyUnits
from zdsl.runtime.models.loss import causal_lm_loss

ALLOWED = "gpt.allowed"     # extras: (B or 1, 1, T, T) bool, True where a query may see a key
ADDED = "gpt.allowed_add"  # extras: that mask as attention adds it (0 or -inf) in the blocks' dtype

# Above this many parameters (4 GiB in fp32) a GPT is built lazily, unit by unit (see GPT).
LAZY_ABOVE = 1 << 30


def parameter_count(layers: int, width: int, vocab: int, context: int) -> int:
    """Parameters of this GPT (as zdsl.model.units.gpt_parameter_count), without building it."""
    block = 12 * width * width + 13 * width
    return vocab * width + context * width + layers * block + 2 * width


class Embedding(nn.Module):
    """Unit 0: token ids -> hidden states (token plus position embedding)."""

    takes_batch = True

    def __init__(self, vocab: int, context: int, width: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)

    def forward(self, idx: torch.Tensor, batch: Batch | None = None) -> torch.Tensor:
        positions = batch.positions if batch is not None else None
        if positions is None:   # one row of positions, broadcast over the batch (bits as ever)
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

    def forward(self, x: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """``allowed``: None for plain causal attention, else :func:`attention_mask`'s additive mask."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        if allowed is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


def attention_mask(batch: Batch | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """None for a batch that needs only causality; else its mask, made once per micro-batch and
    kept in ``batch.extras``. Every query also sees itself, so that a padding query with no key
    left (a row padded on the left) gives a finite output, not NaN.

    Without ``dtype``: the boolean mask (``prepare`` makes it). With ``dtype``: the additive mask
    (0 where a query may see a key, -inf where not), which then replaces the boolean one. The
    blocks take that one: scaled_dot_product_attention turns a boolean mask into exactly this
    tensor (zeros, -inf where False) on every call and saves it for backward, one (B, 1, T, T)
    copy per block; given the additive mask it converts nothing and every block saves the same
    tensor (same values, same bits)."""
    if batch is None or not batch.masked:
        return None
    if dtype is not None:
        added = batch.extras.get(ADDED)
        if added is None or added.dtype != dtype:
            allowed = allowed_with_self(batch)
            added = torch.zeros_like(allowed, dtype=dtype).masked_fill_(allowed.logical_not(), float("-inf"))
            batch.extras[ADDED] = added
            batch.extras.pop(ALLOWED, None)     # the additive one is what the rest of the step reads
        return added
    return allowed_with_self(batch)


def allowed_with_self(batch: Batch) -> torch.Tensor:
    """The boolean mask of :func:`attention_mask` (True where a query may see a key, itself
    always), made once per micro-batch."""
    allowed = batch.extras.get(ALLOWED)
    if allowed is None:
        T = batch.input_ids.shape[1]
        allowed = allowed_keys(batch) | torch.eye(T, dtype=torch.bool, device=batch.input_ids.device)
        batch.extras[ALLOWED] = allowed
    return allowed


class Block(nn.Module):
    """A pre-LayerNorm transformer block: one unit."""

    takes_batch = True

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor, batch: Batch | None = None) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, attention_mask(batch, h.dtype))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Last unit: final LayerNorm, logits through the embedding's ``wte`` (tied), loss.

    The embedding is held outside the module tree so ``wte.weight`` stays
    registered once (in unit 0); zdsl's flat buffers swap the parameter's
    storage and this reference follows.
    """

    takes_batch = True
    _embedding: Embedding

    def __init__(self, width: int, embedding: Embedding):
        super().__init__()
        self.ln_f = nn.LayerNorm(width)
        object.__setattr__(self, "_embedding", embedding)   # not a submodule: tied, not owned

    def forward(self, x: torch.Tensor, batch: Batch | torch.Tensor) -> torch.Tensor:
        """The loss; ``batch`` is the micro-batch, or its labels alone."""
        labels = batch.loss_labels() if isinstance(batch, Batch) else batch
        logits = F.linear(self.ln_f(x), self._embedding.wte.weight)
        return causal_lm_loss(logits, labels)


class GPT(LazyUnits, nn.Module):
    """nanoGPT-class GPT; ``units()`` = [embedding, *blocks, head].

    ``seed`` makes the initialisation deterministic without touching torch's
    global random state (its CPU generator is restored after the modules'
    default init): parameters are then initialised (nanoGPT's scheme: normal
    with std 0.02, residual projections scaled by 1/sqrt(2*layers), LayerNorm
    1/0, biases 0) from a private generator on the CPU and moved to
    ``device``, so every device and every peer (DDP, FSDP2, ...) starts from
    the same numbers. Under
    ``with torch.device("meta")`` the model stays on meta (sizing).

    A GPT above ``LAZY_ABOVE`` parameters (or with ``lazy=True``) is built
    lazily, so that a model larger than host memory can be trained from NVMe:
    its modules are made on the meta device and nothing is allocated until
    :meth:`materialize_unit` gives unit 0, 1, ... (in that order) their
    values, which are the eager init's exact numbers (the private generator
    draws in the same order: parameter order is unit order). zdsl's
    ``RankState`` materialises one unit, copies it into its flat buffers and
    tiers, and drops it before the next; :meth:`materialize` does all the
    rest at once (plain use as a module).
    """

    def __init__(self, layers: int = 4, width: int = 128, heads: int = 4, vocab: int = 256,
                 context: int = 64, seed: int = 0, device: str | torch.device | None = None,
                 lazy: bool | None = None):
        super().__init__()
        self.config = dict(layers=layers, width=width, heads=heads, vocab=vocab, context=context)
        ambient_meta = torch.empty(0).device.type == "meta"
        if lazy is None:
            lazy = device is None and parameter_count(layers, width, vocab, context) > LAZY_ABOVE
        lazy = lazy and not ambient_meta
        rng = None if ambient_meta else torch.random.get_rng_state()
        try:
            # Built on the CPU (not on meta: meta tensors pull in ~75 MB of torch's Python
            # decompositions), with torch's default init whose draws are then undone;
            # lazily built models (too large for that) are made on meta.
            with torch.device("meta" if ambient_meta or lazy else "cpu"):
                self.embedding = Embedding(vocab, context, width)
                self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
                self.head = Head(width, self.embedding)
        finally:
            if rng is not None:
                torch.random.set_rng_state(rng)
        self.tied = {(layers + 1, 0): "wte.weight"}
        if lazy:
            g, names = torch.Generator().manual_seed(seed), {id(p): n for n, p in self.named_parameters()}

            def values(u: int) -> dict[str, torch.Tensor]:      # in parameter order, as the eager init draws
                return {local: self._init_value(names[id(p)], p.shape, g)
                        for local, p in self.units()[u].named_parameters()}
            self.defer(values)  # type: ignore[operator]  # LazyUnits' method: mypy reads zdsl.runtime's modules as Any
        elif not ambient_meta:
            self.reset_parameters(seed)
            if device is not None:
                self.to(device)

    def _init_value(self, name: str, shape, g: torch.Generator) -> torch.Tensor:
        """The initial fp32 value of parameter ``name`` (draws from ``g`` for weights only)."""
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if ".ln_" in name or name.startswith("head.ln_f"):
            return torch.ones(shape)
        std = 0.02 / math.sqrt(2 * len(self.blocks)) if name.endswith("c_proj.weight") else 0.02
        return torch.empty(shape).normal_(0.0, std, generator=g)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        if self.is_lazy:
            raise RuntimeError("reset_parameters on a lazily built GPT: call materialize() first")
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            p.copy_(self._init_value(name, p.shape, g).to(p.dtype))

    def units(self) -> list[nn.Module]:
        return [self.embedding, *self.blocks, self.head]

    @torch.no_grad()
    def prepare(self, batch: Batch) -> None:
        """The attention mask of a padded or packed batch, made once before the units run."""
        attention_mask(batch)

    def forward(self, idx: torch.Tensor | Batch, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of ``(idx, targets)`` or of a :class:`Batch`."""
        self.refuse_if_lazy()
        batch = idx if isinstance(idx, Batch) else Batch.of(idx, targets)
        x = self.embedding(batch.input_ids, batch)
        attention_mask(batch)
        for block in self.blocks:
            x = block(x, batch)
        return self.head(x, batch)


def build(layers: int = 4, width: int = 128, heads: int = 4, vocab: int = 256, context: int = 64,
          seed: int = 0, device=None, lazy: bool | None = None) -> GPT:
    """Factory with the same shape as a user's ``build``."""
    return GPT(layers=layers, width=width, heads=heads, vocab=vocab, context=context,
               seed=seed, device=device, lazy=lazy)
