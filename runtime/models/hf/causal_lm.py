"""What every HF family shares once split into units: the model, its decoder-layer and head units.

A family (gpt2.py, llama.py) builds an embedding unit and says how its
decoder layers are called; :class:`HfCausalLM` holds ``units()``, ``tied``,
``prepare(batch)`` (whatever the family makes per micro-batch, e.g. rotary
tables; the layers make the causal mask), the seeded initialisation and the
map from unit-local parameter names to the HF checkpoint's names.

Parameters get their values unit by unit (:meth:`HfCausalLM.materialize_unit`),
from the safetensors files or the seeded init: a model built lazily (its
parameters on meta, :func:`parameters_on_meta`) holds no unit until asked, so
zdsl's ``RankState`` never holds more than one unit's full parameters; a model
built eagerly has had every unit materialised at once.

Attention is causal whatever ``attn_implementation`` is: every layer gets an
explicit 4-D additive mask (causal, padding from ``batch.attention_mask``, packed
records kept apart by ``batch.segments``, a sliding window where the layer has one),
never ``None``; positions (rotary tables, learned embeddings) come from
``batch.position_ids()``, so a packed record starts at position 0.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from zdsl.runtime.models.batch import Batch, allowed_keys
from zdsl.runtime.models.lazy import LazyUnits, UnitValues
from zdsl.runtime.models.loss import causal_lm_loss


def additive_mask(batch: Batch, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The mask a layer adds to its attention scores, in the scores' dtype (0 where seen, the dtype's
    lowest finite value where not: a row with nothing to see stays finite). Made by the first layer
    that needs it, once per micro-batch, dtype and window, and kept in ``batch.extras``: a run
    holds one mask per window in its layers' dtype, (B, 1, T, T) for padded or packed rows, else
    (1, 1, T, T), nothing in another dtype and no boolean one."""
    key = ("hf.mask", dtype, window)
    mask = batch.extras.get(key)
    if mask is None:
        allowed = allowed_keys(batch)
        if window is not None:
            T = allowed.shape[-1]
            i = torch.arange(T, device=allowed.device)
            allowed = allowed & ((i[:, None] - i[None, :]) < window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        batch.extras[key] = mask
    return mask


class DecoderUnit(nn.Module):
    """One of transformers' own decoder layers as a unit: ``(hidden, batch) -> hidden``."""
    takes_batch = True
    _call: Callable[..., Any]

    def __init__(self, layer: nn.Module, call, window: int | None = None):
        super().__init__()
        self.layer = layer
        self.window = window                      # sliding-window attention: keys seen back from a query
        object.__setattr__(self, "_call", call)    # the family's way to call it: (layer, hidden, batch, mask)

    def forward(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        out = self._call(self.layer, hidden, batch, additive_mask(batch, hidden.dtype, self.window))
        return out[0] if isinstance(out, tuple) else out


class HeadUnit(nn.Module):
    """Last unit: final norm, logits (through the embedding's weight when tied), the loss."""
    takes_batch = True
    _embedding: nn.Module
    tied_name: str

    def __init__(self, norm_name: str, norm: nn.Module, lm_head: nn.Linear | None,
                 embedding: nn.Module | None = None, tied_name: str | None = None):
        super().__init__()
        self.norm_name = norm_name
        setattr(self, norm_name, norm)
        if lm_head is not None:
            self.lm_head = lm_head
        else:                                       # tied: read, not owned (registered in unit 0)
            if embedding is None or tied_name is None:
                raise ValueError("a head without lm_head reads the embedding's weight: give embedding and tied_name")
            object.__setattr__(self, "_embedding", embedding)
            self.tied_name = tied_name

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = getattr(self, self.norm_name)(hidden)
        if "lm_head" in self._modules:
            return self.lm_head(hidden)
        return F.linear(hidden, self._embedding.get_parameter(self.tied_name))

    def forward(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        return causal_lm_loss(self.logits(hidden), batch.loss_labels())


class HfCausalLM(LazyUnits, nn.Module):
    """A transformers causal LM as zdsl units: [embedding, *decoder layers, head].

    ``config``: the transformers config; ``prefix``: the HF name of the base model ("transformer."
    for GPT-2, "model." for Llama and kin), under which its embedding, layers (``layers_name``)
    and final norm live; ``lm_head`` is at the top."""

    def __init__(self, config, embedding: nn.Module, layers: list[DecoderUnit], head: HeadUnit,
                 prefix: str, layers_name: str):
        super().__init__()
        self.config = config
        self.embedding = embedding
        self.layers = nn.ModuleList(layers)
        self.head = head
        self.prefix, self.layers_name = prefix, layers_name
        self.tied = {} if "lm_head" in head._modules else {(len(layers) + 1, 0): head.tied_name}

    def units(self) -> list[nn.Module]:
        return [self.embedding, *self.layers, self.head]

    # -- per micro-batch ---------------------------------------------------------------

    @torch.no_grad()
    def prepare(self, batch: Batch) -> None:
        """The family's per-batch tables (buffers only, never parameters); the masks are made by
        the layers, in their dtype (:func:`additive_mask`)."""

    def forward(self, input_ids, labels=None) -> torch.Tensor:
        """The loss of ``Batch`` ``input_ids`` (or of ``input_ids``, ``labels``): the units in order."""
        self.refuse_if_lazy()  # type: ignore[operator]  # LazyUnits' method: mypy reads zdsl.runtime's modules as Any
        batch = input_ids if isinstance(input_ids, Batch) else Batch(input_ids=input_ids, labels=labels)
        self.prepare(batch)
        x = batch.input_ids
        for unit in self.units():
            x = unit(x, batch)
        return x

    # -- names -------------------------------------------------------------------------

    def hf_name(self, unit: int, name: str) -> str:
        """The HF checkpoint name of parameter ``name`` of unit ``unit``."""
        last = len(self.layers) + 1
        if unit == 0:
            return self.prefix + name
        if unit < last:
            return f"{self.prefix}{self.layers_name}.{unit - 1}.{name.removeprefix('layer.')}"
        return name if name.startswith("lm_head.") else self.prefix + name

    def hf_names(self) -> dict[str, str]:
        """Every parameter's HF name by its name in this module (``units.<u>.<name>`` order)."""
        return {f"{u}.{n}": self.hf_name(u, n) for u, unit in enumerate(self.units())
                for n, _ in unit.named_parameters()}

    # -- initialisation: values unit by unit ---------------------------------------------

    def init_std(self, hf_name: str) -> float:
        """The std of a weight's normal init (HF's: ``initializer_range``; families may scale some)."""
        return self.config.initializer_range

    def init_unit(self, u: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        """Unit ``u``'s initial fp32 values by local name, HF's init scheme: weights normal(0, std)
        drawn from ``g`` in parameter order, biases 0, norms 1, an embedding's padding row 0."""
        values = {}
        for module_name, module in self.units()[u].named_modules():
            for pname, p in module.named_parameters(recurse=False):
                name = f"{module_name}.{pname}" if module_name else pname
                if pname == "bias":
                    value = torch.zeros(p.shape)
                elif "norm" in type(module).__name__.lower():
                    value = torch.ones(p.shape)
                else:
                    value = torch.empty(p.shape).normal_(0.0, self.init_std(self.hf_name(u, name)), generator=g)
                    pad = getattr(module, "padding_idx", None)
                    if isinstance(module, nn.Embedding) and pad is not None:
                        value[pad] = 0
                values[name] = value
        return values

    def seeded(self, seed: int) -> UnitValues:
        """The seeded init as a source of unit values: one private generator seeded by ``seed``
        (torch's global RNG untouched), drawn from unit 0, 1, ... in that order."""
        g = torch.Generator().manual_seed(seed)
        return lambda u: self.init_unit(u, g)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Every unit's seeded init (:meth:`seeded`), as a lazy model would get it unit by unit."""
        if self.is_lazy:
            raise RuntimeError("reset_parameters on a lazily built HF model: call materialize() first")
        values = self.seeded(seed)
        for u in range(len(self.units())):
            self.set_unit(u, values(u))  # type: ignore[operator]  # LazyUnits' method: mypy reads zdsl.runtime's modules as Any


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside (by this thread) get their registered parameters on the meta device,
    while buffers (Llama's rotary ``inv_freq``, masks) and everything else stay real CPU tensors:
    the model's shapes without its memory (accelerate's ``init_empty_weights(include_buffers=False)``).
    A constructor's default init then runs on meta: no memory, no draws from torch's RNG."""
    original = nn.Module.register_parameter
    thread = threading.get_ident()

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta and threading.get_ident() == thread:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def residual_std(config, layers: int) -> float:
    """GPT-2's scaled init of the residual projections: initializer_range / sqrt(2 * layers)."""
    return config.initializer_range / math.sqrt(2 * layers)
