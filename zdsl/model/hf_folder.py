"""A Hugging Face model folder as the compiler sees it: no torch, no transformers.

``model hf("DIR", key=value...)`` names a local folder (relative to the
schedule's folder) or a hub id already in the local HF cache; nothing is ever
downloaded. This module finds the folder, reads its ``config.json``, checks
the family (``model_type``) and maps zdsl's override names to the family's
config fields, so ``zdsl check`` can point at a bad statement and check the
data against the model's context and vocab without importing torch. The
model itself is built by ``zdsl.runtime.models.hf``.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

# model_type -> the runtime module that builds it (zdsl.runtime.models.hf.FAMILIES has these keys).
HF_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")

# zdsl's override names -> the config fields they may mean, the first the family's config has.
OVERRIDE_ALIASES = {
    "layers": ("num_hidden_layers", "n_layer"),
    "width": ("hidden_size", "n_embd"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
    "context": ("max_position_embeddings", "n_positions"),
    "kv_heads": ("num_key_value_heads",),
    "ffn": ("intermediate_size", "n_inner"),
}
# Not a config field but how the model runs: config._attn_implementation.
ATTENTION_KEY = "attn_implementation"
ATTENTION_CHOICES = ("sdpa", "eager")

GET_FILES_HINT = ("zdsl never downloads: where there is network, `huggingface-cli download NAME --local-dir DIR` "
                  "(or `model.save_pretrained(\"DIR\")` in Python), then bring DIR here; a hub id is looked up "
                  "in the local Hugging Face cache only")
PROTOCOL_WAY_OUT = 'or write the model in the unit protocol and name it `model "file.py:build"(...)`'


class HfModelError(ValueError):
    """An HF model that cannot be used. ``key``: the override argument at fault (None: the folder)."""

    def __init__(self, message: str, hint: str | None = None, key: str | None = None):
        super().__init__(message)
        self.hint = hint
        self.key = key


def transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


def find_folder(name: str, base: str | Path | None = None) -> Path:
    """The model folder ``name`` means: a folder relative to ``base`` (the schedule's folder) or
    absolute, else a hub id (``org/name``) whose files the local HF cache already holds."""
    local = Path(name).expanduser()
    if not local.is_absolute() and base is not None:
        local = Path(base) / local
    if local.is_dir():
        return local.resolve()
    cached = _cached_snapshot(name)
    if cached is not None:
        return cached
    raise HfModelError(f"no model folder {str(local)!r} and no {name!r} in the local Hugging Face cache",
                       hint=GET_FILES_HINT.replace("NAME", name).replace("DIR", Path(name).name or name))


def _cached_snapshot(name: str) -> Path | None:
    """The cached snapshot folder holding ``name``'s config.json (local files only, no network)."""
    if name.count("/") > 1 or name.startswith((".", "/", "~")) or importlib.util.find_spec("huggingface_hub") is None:
        return None
    from huggingface_hub import try_to_load_from_cache  # optional extra, lazily; reads HF_HOME itself
    try:
        found = try_to_load_from_cache(repo_id=name, filename="config.json")
    except Exception:   # noqa: BLE001 - not a valid repo id: simply not cached
        return None
    return Path(found).parent if isinstance(found, str) else None


def read_config(folder: Path) -> dict:
    """``config.json`` as a dict; its ``model_type`` must be a supported family."""
    path = folder / "config.json"
    if not path.is_file():
        raise HfModelError(f"{folder} has no config.json, so it is not a Hugging Face model folder",
                           hint="point at the folder `save_pretrained` or `huggingface-cli download` wrote")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HfModelError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise HfModelError(f"{path} is not a JSON object")
    family = config.get("model_type")
    if family not in HF_FAMILIES:
        raise HfModelError(f"model_type {family!r} in {path} is not a family zdsl builds",
                           hint=f"supported: {', '.join(HF_FAMILIES)}; {PROTOCOL_WAY_OUT}")
    return config


def config_field(key: str, fields) -> str | None:
    """The config field an override ``key`` sets, given the config's ``fields``: an alias's first
    field the config has, or ``key`` itself when it is a field; None if neither."""
    for name in OVERRIDE_ALIASES.get(key, ()):
        if name in fields:
            return name
    return key if key in fields and key not in OVERRIDE_ALIASES else None


def model_sizes(folder: Path, overrides: dict) -> dict[str, int | None]:
    """The model's ``vocab`` and ``context`` (the positions it was made for) after overrides, from
    config.json alone; None where config.json does not say."""
    config = read_config(folder)
    fields = dict(config)
    for key, value in overrides.items():
        fields[config_field(key, config) or OVERRIDE_ALIASES.get(key, (key,))[0]] = value
    out = {}
    for key in ("vocab", "context"):
        name = config_field(key, fields)
        value = fields.get(name) if name else None
        out[key] = value if isinstance(value, int) and not isinstance(value, bool) else None
    return out
