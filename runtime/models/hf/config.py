"""An HF model folder's config as transformers' config class, with the schedule's overrides.

Finding the folder and reading ``config.json`` are the compiler's (torch-free,
``zdsl.model.hf_folder``); here the overrides are checked against the
family's own config class (every field it has, not only those config.json
lists) and applied. Loading is local only: transformers never goes to the hub.
"""
from __future__ import annotations

import difflib
from pathlib import Path

from zdsl.model.hf_folder import (
    ATTENTION_CHOICES,
    ATTENTION_KEY,
    OVERRIDE_ALIASES,
    HfModelError,
    config_field,
    read_config,
    transformers_installed,
)

DEFAULT_ATTENTION = "sdpa"    # transformers' own default where torch has it


def load_config(spec):
    """``ModelSpec`` kind "hf" -> (folder, transformers config with overrides applied)."""
    if not transformers_installed():
        raise HfModelError("model hf(...) needs transformers, which is not installed",
                           hint="pip install 'zdsl[hf]'")
    from transformers import AutoConfig
    folder = Path(spec.path)
    read_config(folder)                    # the family check and its message, before transformers reads it
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:               # noqa: BLE001 - transformers' own reasons, kept in the message
        raise HfModelError(f"transformers cannot read {folder / 'config.json'}: {type(exc).__name__}: {exc}") \
            from None
    apply_overrides(config, dict(spec.args))
    return folder, config


def apply_overrides(config, overrides: dict) -> None:
    """Set each override on ``config``: zdsl's names (layers, width, ...) or the config's own fields."""
    attention = overrides.pop(ATTENTION_KEY, None) or config._attn_implementation or DEFAULT_ATTENTION
    if attention not in ATTENTION_CHOICES:
        raise HfModelError(f"{ATTENTION_KEY} is one of {', '.join(ATTENTION_CHOICES)}, not {attention!r}",
                           key=ATTENTION_KEY)
    fields = {**config.to_dict(), **dict.fromkeys(getattr(config, "attribute_map", {}))}   # GPT-2's hidden_size...
    before = {k: getattr(config, k, None) for k in ("hidden_size", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim")}
    for key, value in overrides.items():
        name = config_field(key, fields)
        if name is None:
            known = [k for k in OVERRIDE_ALIASES if config_field(k, fields)] + sorted(
                k for k in fields if not k.startswith("_"))
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            raise HfModelError(f"a {config.model_type} model has no setting {key!r}",
                               hint=(f"did you mean {' or '.join(map(repr, close))}? " if close else "")
                               + "zdsl's names: " + ", ".join(k for k in OVERRIDE_ALIASES if config_field(k, fields))
                               + "; or any field of its config.json", key=key)
        setattr(config, name, value)
    _follow_shape(config, before, {config_field(k, fields) for k in overrides})
    config._attn_implementation = attention


def _follow_shape(config, before: dict, given: set) -> None:
    """A width or head count override carries the fields derived from them along (head_dim; the
    key/value heads of a model without grouped-query attention), unless those were ``given`` too."""
    if before["head_dim"] is not None and "head_dim" not in given and \
            before["head_dim"] == before["hidden_size"] // before["num_attention_heads"]:
        config.head_dim = config.hidden_size // config.num_attention_heads
    if before["num_key_value_heads"] is not None and "num_key_value_heads" not in given and \
            before["num_key_value_heads"] == before["num_attention_heads"]:
        config.num_key_value_heads = config.num_attention_heads
    types = getattr(config, "layer_types", None)
    if types and len(types) != config.num_hidden_layers and "layer_types" not in given:
        if len(set(types)) > 1:
            raise HfModelError(f"this {config.model_type} mixes attention kinds by layer; with "
                               f"{config.num_hidden_layers} layers, give layer_types too", key="layers")
        config.layer_types = [types[0]] * config.num_hidden_layers
