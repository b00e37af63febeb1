"""Tiny Hugging Face models for the tests: configs made with transformers' own classes and saved
with ``save_pretrained`` (weights included unless asked not to), as a user's folder would be."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers import GPT2Config
from transformers import LlamaConfig
from transformers import MistralConfig
from transformers import Qwen2Config
from transformers import Qwen3Config

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

CONTEXT = 16
VOCAB = 256
_DECODER = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=VOCAB, intermediate_size=128, max_position_embeddings=32)
# GPT-2's embeddings are tied (its default), the others' not; dropout off so runs compare exactly.
CONFIGS = {
    "gpt2": lambda **kw: GPT2Config(**{**dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                               bos_token_id=0, eos_token_id=0), **kw}),
    "llama": lambda **kw: LlamaConfig(**{**_DECODER, **kw}),
    "mistral": lambda **kw: MistralConfig(**{**_DECODER, "sliding_window": 8, **kw}),
    "qwen2": lambda **kw: Qwen2Config(**{**_DECODER, **kw}),
    "qwen3": lambda **kw: Qwen3Config(**{**_DECODER, "head_dim": 16, **kw}),
}


def save_tiny(family: str, folder: Path, weights: bool = True, seed: int = 0, **changes) -> Path:
    """A model folder: ``config.json``, and ``model.safetensors`` of transformers' own init from ``seed``."""
    config = CONFIGS[family](**changes)
    if weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return Path(folder)


def transformers_model(folder: Path, attn: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation=attn)


def transformers_loss(model, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """transformers' own loss for zdsl's ``(idx, targets)``. zdsl's targets are already shifted
    (``targets[:, t]`` is the token after ``idx[:, t]``) while transformers shifts its labels
    itself, so it gets the whole window of context + 1 tokens as both input_ids and labels: its
    logits at 0..T-1 then predict exactly ``targets``, and the extra last token changes no
    earlier logit (attention is causal) and is not counted (nothing follows it)."""
    window = torch.cat([idx, targets[:, -1:]], dim=1)
    return model(input_ids=window, labels=window).loss
