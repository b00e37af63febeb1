"""GPT-2 as units: wte + wpe (+ dropout), transformers' ``GPT2Block`` per layer, ln_f + lm_head.

HF names: ``transformer.wte.weight``, ``transformer.h.<i>.*``, ``transformer.ln_f.*``,
``lm_head.weight`` (absent from a checkpoint whose embeddings are tied).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.hf.causal_lm import DecoderUnit, HeadUnit, HfCausalLM, residual_std


class GPT2Embedding(nn.Module):
    """Unit 0: token plus learned position embeddings (positions from the batch), dropout."""
    takes_batch = True

    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, input_ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.drop(self.wte(input_ids) + self.wpe(batch.position_ids()))


def _call_block(layer, hidden: torch.Tensor, batch: Batch, mask: torch.Tensor):
    return layer(hidden, attention_mask=mask)


class GPT2(HfCausalLM):
    def init_std(self, hf_name: str) -> float:
        if hf_name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
            return residual_std(self.config, self.config.n_layer)
        return self.config.initializer_range


def build(config) -> GPT2:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    embedding = GPT2Embedding(config)
    layers = [DecoderUnit(GPT2Block(config, layer_idx=i), _call_block) for i in range(config.n_layer)]
    tied = config.tie_word_embeddings
    lm_head = None if tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    head = HeadUnit("ln_f", nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon), lm_head,
                    embedding, "wte.weight")
    return GPT2(config, embedding, layers, head, prefix="transformer.", layers_name="h")
