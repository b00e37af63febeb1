"""Sizing a model for the planner without allocating it: units on torch's meta device.

The compiler works on ``list[zdsl.model.units.UnitSpec]``: per unit, its
parameters (names and shapes, registration order), the units it reads tied
parameters from, and per-sequence forward flops, saved-activation elements
and input elements, and the kernels (aten ops) its forward and backward
dispatch. The built-in GPT is sized analytically in ``zdsl/``
(instant, no torch); a user's model is built under ``torch.device("meta")``
(no memory, no init) and one sequence of ``context`` tokens (a meta
``Batch``, given to the model's ``prepare`` first) is pushed through its
units on meta tensors, called as zdsl calls them: flops come from torch's
``FlopCounterMode``, activations from the tensors autograd saves
(``saved_tensors_hooks``; parameters excluded), inputs from each unit's
input. The units' saved tensors are measured again with their parameters in
bf16 (``UnitSpec.half_act_elems_per_seq``), in bytes: layers in a 2-byte
dtype keep some tensors in fp32 (a norm's upcast input, the loss's logits and
log-probabilities) and int64 token ids, which counting their elements at 2
bytes missed. If the model cannot run on meta (data-dependent Python control
flow), the parameters are still exact and the rest falls back to estimates
(2 flops per parameter per token; activations: the output) with a warning.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

from zdsl.model.units import UnitSpec, gpt_units
from zdsl.runtime.data import runtime_source
from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.kernel_count import model_kernels
from zdsl.runtime.models.protocol import (
    ModelProtocolError,
    build_model,
    call_unit,
    check_model,
    prepare_batch,
    tied_uses,
)
from zdsl.schedule import GPT_DEFAULTS
from zdsl.sources import source_of


def unit_specs(model_spec, context: int, base_dir=None, sample=None, masked: bool = False) -> list[UnitSpec]:
    """The units of the model a schedule names, for a sequence of ``context`` tokens, or for
    ``sample``, one row of the data's ``(inputs, targets)`` (``data python(...)``: any tensors).
    ``masked``: the data's rows are padded or packed (``jsonl(...)``), so they come with an
    ``attention_mask``."""
    if model_spec.kind == "gpt":
        return gpt_units(**{**GPT_DEFAULTS, **model_spec.args})
    with torch.device("meta"):
        model = build_model(model_spec, seed=0, base_dir=base_dir)
    where = f'model hf("{model_spec.path}")' if model_spec.kind == "hf" else f'model "{model_spec.factory}"'
    return model_unit_specs(model, where, context, sample=sample, masked=masked)


def model_unit_specs(model, where: str, context: int, sample=None, masked: bool = False) -> list[UnitSpec]:
    """:func:`unit_specs` of a model already built on the meta device (``where`` names it in
    errors and warnings); the Python API sizes a user's model object so, from a meta copy."""
    units = check_model(model, where)
    uses = tied_uses(model, len(units))
    specs = [UnitSpec(name=f"unit.{i}", params=[(n, tuple(p.shape)) for n, p in u.named_parameters()],
                      uses=uses[i], aliases=param_aliases(model, i, u)) for i, u in enumerate(units)]
    traced = False
    try:
        one_row = _measure(model, units, specs, lambda: meta_batch(context, sample, masked=masked))
        _count_extras(model, units, specs[0], one_row, meta_batch(context, sample, rows=2, masked=masked))
        traced = True
    except Exception as exc:   # the user's forward cannot run on meta: keep exact sizes, estimate the rest
        warnings.warn(f"{where}: could not trace one sequence on the meta device "
                      f"({type(exc).__name__}: {exc}); flops and activations are estimates")
        for s in specs:
            s.fwd_flops_per_seq = 2.0 * s.numel * context
            s.input_elems_per_seq = s.input_elems_per_seq or context
            s.act_elems_per_seq = s.act_elems_per_seq or context
    try:                       # apart: a backward that cannot run on meta leaves the forward's figures exact
        _count_kernels(model, units, specs, lambda: meta_batch(context, sample))
    except Exception as exc:
        warnings.warn(f"{where}: could not count its kernels on the meta device "
                      f"({type(exc).__name__}: {exc}); kernel counts are estimates")
        for s in specs:
            s.fwd_kernels = ESTIMATED_KERNELS[0] * len(s.params)
            s.bwd_kernels = ESTIMATED_KERNELS[1] * len(s.params)
    try:                       # last: it casts the units
        if traced:
            _measure_half(model, units, specs, lambda: meta_batch(context, sample, masked=masked))
    except Exception:          # traced in fp32, not in bf16 (fp32 tables meeting bf16 weights): a model
        for s in specs:        # written for fp32; its schedules are fp32 ones, so no warning
            s.half_act_elems_per_seq = None
    return specs


def param_aliases(model, index: int, unit) -> dict[str, list[str]]:
    """A unit's parameters' other names, which ``freeze`` and ``no_decay`` globs also match: the
    model's state-dict name, and a Hugging Face model's checkpoint name (``model.hf_name``)."""
    own = {id(p): n for n, p in model.named_parameters()}
    hf_name = getattr(model, "hf_name", None)
    out = {}
    for local, p in unit.named_parameters():
        names = [own[id(p)]] if id(p) in own else []
        if hf_name is not None:
            names.append(hf_name(index, local))
        out[local] = [n for n in dict.fromkeys(names) if n != local]
    return out


# Kernels per parameter tensor when a model cannot be traced: a biased linear layer's (forward: a
# transpose and an addmm for its 2 tensors; backward: a transpose, 2 matmuls, a sum, 2 accumulations).
ESTIMATED_KERNELS = (1, 3)


def meta_batch(context: int, sample=None, rows: int = 1, masked: bool = False) -> Batch:
    """``rows`` sequences of ``context`` tokens on the meta device (every label counted), or
    ``rows`` copies of the row of the data's ``sample`` pair; ``masked``: with an
    ``attention_mask``, as padded or packed rows come."""
    if sample is not None:
        batch = Batch.of(*(torch.cat([t.to("meta")] * rows) for t in sample))
    else:
        ids = torch.zeros(rows, context, dtype=torch.long, device="meta")
        batch = Batch.of(ids, ids.clone())
    if masked:
        batch.attention_mask = torch.ones(batch.input_ids.shape[:2], dtype=torch.long, device="meta")
    return batch


def _measure(model, units, specs: list[UnitSpec], example) -> Batch:
    """``example()``: a fresh meta batch of one sequence; returns it, its extras made."""
    batch = prepare_batch(model, example())
    x = batch.input_ids
    for i, (unit, spec) in enumerate(zip(units, specs)):
        spec.input_elems_per_seq = int(x.numel())
        counter = FlopCounterMode(display=False)
        with counter:
            out, saved = _saved_by(unit, x, batch, i, len(units))
        if i < len(units) - 1 and not isinstance(out, torch.Tensor):
            raise ModelProtocolError(f"unit {i} returned {type(out).__name__}; units pass one tensor forward")
        spec.fwd_flops_per_seq = float(counter.get_total_flops())
        spec.act_elems_per_seq = sum(t.numel() for t in saved)
        x = out.detach()
    return batch


def _measure_half(model, units, specs: list[UnitSpec], example) -> None:
    """``half_act_elems_per_seq``: the bytes autograd saves, one sequence, with the units' parameters
    in bf16 (as the runtime's flat parameters hold them under bf16 or fp16; the model's own buffers
    outside the units, rotary frequencies, stay fp32), in 2-byte elements."""
    for unit in units:
        unit.to(torch.bfloat16)
    batch = prepare_batch(model, example())
    x = batch.input_ids
    for i, (unit, spec) in enumerate(zip(units, specs)):
        out, saved = _saved_by(unit, x, batch, i, len(units))
        spec.half_act_elems_per_seq = -(-sum(t.numel() * t.element_size() for t in saved) // 2)
        x = out.detach()


def _saved_by(unit, x: torch.Tensor, batch: Batch, index: int, n_units: int):
    """Unit ``index``'s output for input ``x``, called as zdsl calls it, and the tensors autograd
    saves for its backward: their bases (views count once), its parameters and the batch's extras
    (prepare's, or made by this unit: a mask in the layers' dtype) left out, as the micro-batch
    holds those once whichever units save them (the runtime meters them so too)."""
    not_acts = {id(p) for p in unit.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t):
        base = t._base if t._base is not None else t
        if id(base) not in not_acts and not isinstance(base, torch.nn.Parameter):
            saved[id(base)] = base
        return t

    x_in = x.detach().requires_grad_(x.is_floating_point() and index > 0)    # unit 0's data: no gradient
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call_unit(unit, x_in, batch, last=index == n_units - 1)
    for t in batch.extra_tensors():
        saved.pop(id(t._base if t._base is not None else t), None)
    return out, list(saved.values())


def _extras_elems(batch: Batch) -> int:
    return sum(t.untyped_storage().nbytes() // t.element_size() for t in batch.extra_tensors())


def _count_extras(model, units, first: UnitSpec, one_row: Batch, two_rows: Batch) -> None:
    """Count the micro-batch's extras (masks, rotary tables) with unit 0's input, which the plan
    holds from the micro-batch's first forward to its last backward, as the runtime holds them:
    per row what grows with the rows, once per micro-batch what does not (a causal mask of
    (1, 1, T, T) every row shares). ``one_row`` has been through the units; ``two_rows`` goes now."""
    batch = prepare_batch(model, two_rows)
    x = batch.input_ids
    with torch.no_grad():
        for i, unit in enumerate(units):
            x = call_unit(unit, x, batch, last=i == len(units) - 1)
    one, two = _extras_elems(one_row), _extras_elems(batch)
    first.extras_elems_per_seq += two - one
    first.extras_elems_per_batch += 2 * one - two


def _count_kernels(model, units, specs: list[UnitSpec], example) -> None:
    batch = example()
    for spec, (fwd, bwd) in zip(specs, model_kernels(model, units, batch.input_ids, batch.labels)):
        spec.fwd_kernels, spec.bwd_kernels = fwd, bwd


DEFAULT_CONTEXT = 64


def units_for_user_model(spec, context: int | None = None, base_dir=None, data=None) -> list[UnitSpec]:
    """A user's model (``ModelSpec`` kind "user") as the compiler's units. The sequence length
    for flops and activations is ``context``, else the factory's ``context`` argument, else 64;
    with ``data python(...)`` (a ``DataSpec``), one row of what its function returns."""
    context, sample, masked = sizing_inputs(data, context, spec.args.get("context"))
    return unit_specs(spec, context, base_dir=base_dir, sample=sample, masked=masked)


def sizing_inputs(data, context: int | None = None, fallback=None) -> tuple[int, tuple | None, bool]:
    """What a built model is sized with: (context, sample, masked) for :func:`model_unit_specs`.
    ``context``, else ``fallback`` (a factory's ``context`` argument), else 64; where the data's
    rows are its own tensors (``python(...)``), one row of them; ``masked`` where its rows come
    padded or packed (``jsonl(...)``)."""
    if context is None:
        context = fallback if isinstance(fallback, int) and fallback > 0 else DEFAULT_CONTEXT
    if data is None:
        return context, None, False
    return context, runtime_source(data.kind).meta_sample(data), source_of(data.kind).masked
