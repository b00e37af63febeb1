"""The HF Llama every peer trains under ``vs_peers.py --model hf:llama``: one saved folder.

The orchestrator saves a seeded ``LlamaForCausalLM`` (transformers' own init,
``torch.manual_seed(cfg.seed)``) with ``save_pretrained`` into one folder;
zdsl reads it through ``model hf("DIR")``, FSDP2 and DeepSpeed through
``from_pretrained``, so all start from the same bits. The loss is the
causal-LM cross entropy of the logits against zdsl's targets (already
shifted, as zdsl's data source gives them), in fp32 as zdsl's last unit
computes it.

Needs transformers (``benchmarks/setup_peers.sh`` installs it); imported only
where the Llama is wanted.
"""
from __future__ import annotations

from pathlib import Path

ATTENTION = "sdpa"     # what every peer runs, zdsl included (its default too)


def config_kwargs(cfg) -> dict:
    """LlamaConfig fields for the benchmark's sizes: HF's own FFN ratio (11008/4096), full KV heads."""
    return dict(num_hidden_layers=cfg.layers, hidden_size=cfg.width, num_attention_heads=cfg.heads,
                num_key_value_heads=cfg.heads, intermediate_size=cfg.width * 43 // 16, vocab_size=cfg.vocab,
                max_position_embeddings=cfg.context, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=0, pad_token_id=None)


def save_folder(cfg, folder: Path) -> int:
    """Write the seeded model (config.json + model.safetensors) to ``folder``; its parameter count."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config = LlamaConfig(**config_kwargs(cfg))
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def load(cfg):
    """The saved model as a user of a wrapper loads it: ``from_pretrained``, fp32, on the CPU."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(cfg.hf_dir, local_files_only=True, dtype=torch.float32,
                                                attn_implementation=ATTENTION)


def loss(model, tokens, targets):
    """fp32 cross entropy of the logits at every position against the (already shifted) targets."""
    import torch.nn.functional as F
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def blocks(model) -> list:
    """The decoder layers: FSDP2's per-layer shard groups."""
    return list(model.model.layers)
