"""Hugging Face causal LMs as zdsl models: ``model hf("DIR", key=value...)``.

:func:`load` builds the family ``config.json``'s ``model_type`` names, split
into units (unit protocol: ``zdsl.runtime.models.protocol``) from
transformers' own layer modules, so its numbers are transformers'. With
weights in DIR they are read unit by unit; with ``config.json`` alone the
parameters get HF's init scheme from the schedule's seed. Built lazily
(``lazy=True``, what ``RankState`` wants), no unit has values until
``materialize_unit`` asks for it, so a rank never holds the whole model.
Under ``torch.device("meta")`` (sizing) nothing is allocated or read, but the
weights' headers are checked against the model's shapes.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from zdsl.model.hf_folder import HF_FAMILIES, HfModelError
from zdsl.runtime.models.hf import gpt2, llama
from zdsl.runtime.models.hf.causal_lm import parameters_on_meta
from zdsl.runtime.models.hf.config import load_config
from zdsl.runtime.models.hf.weights import check_weights, read_unit, weight_files

# model_type -> build(config); the families zdsl.model.hf_folder.HF_FAMILIES names.
FAMILIES = {"gpt2": gpt2.build, **{name: llama.build for name in llama.PREFIXES}}
assert tuple(FAMILIES) == HF_FAMILIES


def load(spec, seed: int = 0, lazy: bool = False) -> nn.Module:
    """The model ``ModelSpec`` kind "hf" names: weights loaded if the folder has them, else seeded.

    ``lazy``: parameters stay on meta until ``materialize_unit(u)`` (u = 0, 1, ... in order) gives
    unit u its values (``RankState`` does, dropping each unit once sharded), or ``materialize()``
    gives the rest; else every unit is materialised before returning. Either way the values are
    the same bits; buffers are real CPU tensors from the start."""
    folder, config = load_config(spec)
    meta = torch.empty(0).device.type == "meta"
    rng = None if meta else torch.random.get_rng_state()
    try:    # parameters on meta (or everything: sizing); constructors' default init draws nothing kept
        with (torch.device("meta") if meta else parameters_on_meta()):
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
    model.defer(model.seeded(seed) if files is None else functools.partial(read_unit, model, files=files))
    return model if lazy else model.materialize()
