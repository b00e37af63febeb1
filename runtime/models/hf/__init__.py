"""Hugging Face causal LMs as zdsl models: ``model hf("DIR", key=value...)``.

:func:`load` builds the family ``config.json``'s ``model_type`` names, split
into units (unit protocol: ``zdsl.runtime.models.protocol``) from
transformers' own layer modules, so its numbers are transformers'. With
weights in DIR they are loaded unit by unit; with ``config.json`` alone the
parameters get HF's init scheme from the schedule's seed. Under
``torch.device("meta")`` (sizing) nothing is allocated or read, but the
weights' headers are checked against the model's shapes.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zdsl.compile.hf_folder import HF_FAMILIES
from zdsl.compile.hf_folder import HfModelError
from zdsl.runtime.models.hf import gpt2
from zdsl.runtime.models.hf import llama
from zdsl.runtime.models.hf.config import load_config
from zdsl.runtime.models.hf.weights import check_weights
from zdsl.runtime.models.hf.weights import load_unit
from zdsl.runtime.models.hf.weights import weight_files

# model_type -> build(config); the families zdsl.compile.hf_folder.HF_FAMILIES names.
FAMILIES = {"gpt2": gpt2.build, **{name: llama.build for name in llama.PREFIXES}}
assert tuple(FAMILIES) == HF_FAMILIES


def load(spec, seed: int = 0) -> nn.Module:
    """The model ``ModelSpec`` kind "hf" names: weights loaded if the folder has them, else seeded."""
    folder, config = load_config(spec)
    meta = torch.empty(0).device.type == "meta"
    rng = None if meta else torch.random.get_rng_state()
    try:    # built on the CPU with torch's default init, whose draws are undone (or on meta: sizing)
        with torch.device("meta" if meta else "cpu"):
            model = FAMILIES[config.model_type](config)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise HfModelError(f"transformers cannot build this {config.model_type} from its config: "
                           f"{type(exc).__name__}: {exc}", hint="check the overrides against each other "
                           "(e.g. heads must divide width)") from None
    finally:
        if rng is not None:
            torch.random.set_rng_state(rng)
    files = weight_files(folder)
    if files is not None:
        check_weights(model, files)
    if meta:
        return model
    if files is None:
        model.reset_parameters(seed)
    else:
        for u in range(len(model.units())):
            load_unit(model, u, files)
    return model
