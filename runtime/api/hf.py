"""A Hugging Face causal LM given to ``initialize(..., model=)``: an instance or its folder.

Split by ``runtime/models/hf/`` into the units ``model hf("DIR")`` trains (embedding, each decoder
layer, head), with one difference: the head returns the logits, not zdsl's loss, so the user's loop
computes its own loss from ``engine(input_ids)``. An instance's weights are its own: read from its
state dict unit by unit as ``RankState`` asks (the split model is built lazily, its parameters on
meta until then); a folder's are read from its safetensors as ``model hf`` reads them.

``engine.export(DIR, format="hf")`` writes the trained weights as a folder ``from_pretrained``
loads (:func:`export_hf_folder`, with ``runtime/checkpoint/export_hf.py``'s writer).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from zdsl.errors import ZdslApiError
from zdsl.runtime.models.hf.causal_lm import HeadUnit


class LogitsHead(HeadUnit):
    """The head unit of a model the user's loop scores: final norm and logits, no loss."""

    def forward(self, hidden: torch.Tensor, batch) -> torch.Tensor:
        return self.logits(hidden)


def is_hf_causal_lm(model) -> bool:
    """Whether ``model`` is a transformers model (without importing transformers for anything else)."""
    return type(model).__module__.startswith("transformers.") and hasattr(getattr(model, "config", None),
                                                                          "model_type")


def hf_units(model):
    """``model`` (a transformers causal LM instance, or the path of its folder) split into units."""
    from zdsl.model.hf_folder import HfModelError
    try:
        split = from_folder(Path(model)) if isinstance(model, (str, Path)) else from_instance(model)
    except HfModelError as exc:
        hint = f"; {exc.hint}" if getattr(exc, "hint", None) else ""
        raise ZdslApiError(f"model={model if isinstance(model, (str, Path)) else type(model).__name__}: "
                           f"{exc}{hint}") from None
    split.head.__class__ = LogitsHead
    split.given = type(model).__name__ if not isinstance(model, (str, Path)) else Path(model).name
    return split


def from_folder(folder: Path):
    from zdsl.runtime.models.hf import load
    from zdsl.schedule import ModelSpec
    if not (folder / "config.json").is_file():
        raise ZdslApiError(f"model={str(folder)!r}: not a Hugging Face model folder (no config.json); give "
                           f"the folder save_pretrained wrote, or the model object")
    return load(ModelSpec(kind="hf", path=str(folder.resolve())), lazy=True)


def from_instance(model):
    """The instance's family split over a copy of its config, each unit's values its state dict's."""
    from zdsl.model.hf_folder import HF_FAMILIES
    from zdsl.runtime.models.hf import FAMILIES
    from zdsl.runtime.models.hf.causal_lm import parameters_on_meta
    from zdsl.runtime.models.hf.config import apply_overrides
    config = copy.deepcopy(model.config)
    if config.model_type not in FAMILIES:
        raise ZdslApiError(f"model={type(model).__name__}: zdsl splits the Hugging Face families "
                           f"{', '.join(HF_FAMILIES)}, not {config.model_type!r}; list its units with "
                           f"zdsl.units(model, [...]) (module names in the order they run)")
    apply_overrides(config, {})         # the attention implementation as `model hf` settles it
    with parameters_on_meta():
        split = FAMILIES[config.model_type](config)
    state = model.state_dict()

    def values(u: int) -> dict[str, torch.Tensor]:
        unit = split.units()[u]
        return {name: state[split.hf_name(u, name)].detach().to("cpu", torch.float32).clone()
                for name, _ in unit.named_parameters()}
    split.defer(values)
    return split


def export_hf_folder(engine, folder, dtype: str = "fp32") -> list[str]:
    """The engine's model as an HF folder (every rank calls it; rank 0 writes): the files written."""
    from zdsl.runtime.checkpoint.export import export_dtype
    from zdsl.runtime.checkpoint.export_hf import hf_config, hf_names_by_key, write_hf_folder
    from zdsl.runtime.checkpoint.stformat import byte_view, dtype_code
    model = engine.run.model
    if not hasattr(model, "hf_name"):
        raise ZdslApiError(f"engine.export(format=\"hf\") writes Hugging Face models (model= a transformers "
                           f"causal LM or its folder, or `model hf(...)`); this one is "
                           f"{getattr(model, 'given', type(model).__name__)}: export it with format=\"plain\"")
    full = engine.state_dict()
    if engine.rank != 0:
        return []
    out_dtype = export_dtype(dtype, "float32")
    names = hf_names_by_key(model)
    specs = [(hf, dtype_code(out_dtype), tuple(full[key].shape)) for key, hf in names.items()]
    tensors = (byte_view(full[key].to(out_dtype).contiguous()) for key in names)
    return write_hf_folder(folder, hf_config(model, out_dtype), specs, tensors,
                           metadata={"zdsl_step": str(engine.global_step)})
