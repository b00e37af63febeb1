"""Sizing a schedule's model as the compiler's list of units.

The built-in GPT is sized analytically (no torch). A user's own model and a
Hugging Face model (``hf``) can only be sized by building them, which needs
torch, so that path imports the runtime lazily: ``zdsl check``/``zdsl plan``
on built-in models never load torch.
"""
from __future__ import annotations

import sys
import warnings

from zdsl.compile import sizing_cache
from zdsl.model.units import UnitSpec, gpt_units
from zdsl.schedule import GPT_DEFAULTS, ModelSpec, Schedule
from zdsl.sources import source_of


class ModelSizingError(Exception):
    """The model could not be sized (unknown kind, bad arguments, user factory failed)."""


def run_context(schedule: Schedule) -> int:
    """Tokens per sequence the run trains on: the data's context, else the model's (a GPT's
    ``context`` is only the size of its position table; the data may use fewer)."""
    value = schedule.data.args.get("context") or schedule.model.args.get("context")
    return int(value) if value else GPT_DEFAULTS["context"]


def gpt_mask_elems(tokens: int) -> int:
    """Elements per sequence of the attention mask the built-in GPT holds for a padded or packed
    micro-batch (``runtime/models/gpt.py``'s ``attention_mask``): (T, T) in the blocks' dtype, made
    once and read by every block's attention, so counted once, with the micro-batch's other extras
    (``UnitSpec.extras_elems_per_seq``), held from its first forward to its last backward."""
    return tokens * tokens


def units_for(spec: ModelSpec, context: int | None = None, data=None) -> list[UnitSpec]:
    """The ordered units of the model ``spec`` describes, with parameter shapes and the costs
    of one sequence of ``context`` tokens (default: the model's own context, see run_context).
    ``data``: a source that takes part in the sizing (``zdsl.sources.sizing_data``): one whose own
    tensors give a built model its input shapes (``python(...)``), or one whose padded or packed rows
    make the built-in GPT hold an attention mask (``jsonl(...)``)."""
    if spec.kind == "gpt":
        unknown = sorted(set(spec.args) - set(GPT_DEFAULTS))
        if unknown:
            raise ModelSizingError(
                f"gpt() has no argument {unknown[0]!r}; expected one of {', '.join(GPT_DEFAULTS)}")
        args = {**GPT_DEFAULTS, **spec.args}
        bad = [k for k, v in args.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ModelSizingError(f"gpt({bad[0]}=...) must be a positive integer, got {args[bad[0]]!r}")
        if args["width"] % args["heads"]:
            raise ModelSizingError(
                f"gpt(width={args['width']}) must be a multiple of heads={args['heads']}")
        units = gpt_units(**args, tokens=context)
        if data is not None and source_of(data.kind).masked:
            units[0].extras_elems_per_seq += gpt_mask_elems(context or args["context"])
        return units
    if spec.kind in ("user", "hf"):
        key = sizing_cache.sizing_key(spec, context, data)     # a model sized before: no torch
        kept = sizing_cache.load(key) if key else None
        if kept is not None:
            return kept
        try:   # torch (and transformers for hf): only for models built to be sized
            from zdsl.runtime.sizing import units_for_user_model
        except ImportError as exc:
            raise ModelSizingError(
                f"sizing this model needs the runtime (zdsl.runtime.sizing): {exc}") from exc
        if key is None:                   # not kept: sized as it always was, warnings untouched
            return units_for_user_model(spec, context, data=data)
        with warnings.catch_warnings(record=True) as said, sizing_cache.files_read(spec) as read:
            warnings.simplefilter("always")
            units = units_for_user_model(spec, context, data=data)
        for w in said:                    # said again as they came
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        sizing = sys.modules[units_for_user_model.__module__].__file__
        if not any(w.filename == sizing for w in said):    # its estimates are said every time
            sizing_cache.store(key, units, sizing_cache.sources(spec, read))
        return units
    raise ModelSizingError(f"unknown model kind {spec.kind!r}; expected gpt, hf or a user factory")
