"""Llama and the families that share its decoder layer (Mistral, Qwen2, Qwen3) as units:
embed_tokens, transformers' own ``<Family>DecoderLayer`` per layer, norm + lm_head.

The rotary tables are computed once per micro-batch in ``prepare`` from the batch's
positions by the family's rotary module (buffers only, held by the model outside every
unit), cast once to the layers' dtype, and each layer reads them from ``batch.extras``.
HF names: ``model.embed_tokens.weight``, ``model.layers.<i>.*``, ``model.norm.weight``,
``lm_head.weight``.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.hf.causal_lm import DecoderUnit, HeadUnit, HfCausalLM

# model_type -> the class-name prefix in transformers.models.<model_type>.modeling_<model_type>
PREFIXES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
ROTARY = "hf.rotary"          # extras: (cos, sin) in fp32, (B, T, head_dim); (ROTARY, dtype): in the layers' dtype


class LlamaEmbedding(nn.Module):
    """Unit 0: token embeddings (positions enter through the rotary tables)."""
    takes_batch = True

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, input_ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rotary_tables(batch, hidden.dtype)      # the layers' tables, no fp32 ones left in between
        return hidden


def rotary_tables(batch: Batch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``prepare``'s fp32 tables in the layers' dtype, cast once per micro-batch (not by every layer,
    each keeping its own copy for backward); the cast replaces the fp32 ones, as every layer of a
    micro-batch runs in one dtype."""
    if dtype == torch.float32:
        return batch.extras[ROTARY]
    tables = batch.extras.get((ROTARY, dtype))
    if tables is None:
        cos, sin = batch.extras.pop(ROTARY)
        tables = batch.extras[(ROTARY, dtype)] = (cos.to(dtype), sin.to(dtype))
    return tables


def _call_layer(layer, hidden: torch.Tensor, batch: Batch, mask: torch.Tensor):
    return layer(hidden, attention_mask=mask, position_ids=batch.position_ids(),
                 position_embeddings=rotary_tables(batch, hidden.dtype))


class Llama(HfCausalLM):
    def __init__(self, config, rotary: nn.Module, **parts):
        super().__init__(config, **parts)
        self.rotary_emb = rotary          # buffers only (inv_freq): not a unit's

    @torch.no_grad()
    def prepare(self, batch: Batch) -> None:
        super().prepare(batch)
        probe = torch.empty(0, device=batch.input_ids.device)      # fp32: each layer casts to its dtype
        batch.extras[ROTARY] = self.rotary_emb(probe, batch.position_ids())


def _window(layer, config) -> int | None:
    """A layer's sliding window: Qwen's attention says per layer (None on full-attention layers),
    Mistral's config for every layer."""
    return getattr(layer.self_attn, "sliding_window", getattr(config, "sliding_window", None))


def build(config) -> Llama:
    family = PREFIXES[config.model_type]
    modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    layer_cls = getattr(modeling, f"{family}DecoderLayer")
    norm_cls = getattr(modeling, f"{family}RMSNorm")
    rotary = getattr(modeling, f"{family}RotaryEmbedding")(config=config)
    embedding = LlamaEmbedding(config)
    layers = [DecoderUnit(layer, _call_layer, _window(layer, config))
              for layer in (layer_cls(config, layer_idx=i) for i in range(config.num_hidden_layers))]
    tied = config.tie_word_embeddings
    lm_head = None if tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    head = HeadUnit("norm", norm_cls(config.hidden_size, eps=config.rms_norm_eps), lm_head,
                    embedding, "embed_tokens.weight")
    return Llama(config, rotary, embedding=embedding, layers=layers, head=head, prefix="model.",
                 layers_name="layers")
