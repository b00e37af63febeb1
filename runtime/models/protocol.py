"""The unit protocol (what zdsl needs of any model: built-in, Hugging Face or a user's own),
loading a model and checking it.

The protocol
------------
A model is a plain ``nn.Module`` that also offers:

``units() -> list[nn.Module]``
    An ordered chain of at least two modules. Every parameter of the model is registered in
    exactly one unit; a unit's parameters are flattened in its ``named_parameters()`` order
    (registration order). Units pass ONE tensor between them (the hidden state); everything
    else a unit needs comes from its own parameters, a declared tied parameter, or the batch.

The batch (:class:`zdsl.runtime.models.batch.Batch`)
    One micro-batch on the rank's device: ``input_ids`` and ``labels`` (int64 ``(B, T)``;
    ``labels[b, t]`` is the token to predict at ``t``, already shifted; ``-100`` is not
    counted in the loss), optional ``positions`` (None: ``0..T-1``; ``batch.position_ids()``
    gives them either way), ``attention_mask`` (None: every token real; 0 marks padding) and
    ``segments`` (None: one sequence per row; else a row packs several and a token attends only
    to earlier tokens of its own segment: :func:`zdsl.runtime.models.batch.allowed_keys`), and
    ``extras``, a dict the model's ``prepare`` fills. The built-in GPT and the HF models honour
    the mask, the segments and the positions; a model of yours that ignores them trains wrongly
    on padded or packed data (``data jsonl(...)``).

    ``input_ids`` is whatever unit 0 takes and ``labels`` whatever the last unit scores: token
    ids and their next tokens from the built-in data sources, but ``data python(...)`` gives
    any pair of tensors with the micro-batch's rows first (float features and class labels,
    images, ...; zdsl/runtime/data/python.py), under these same two names. zdsl moves
    them to the device as they are and never differentiates them: a float input arrives in the
    dtype the data made it (fp32, typically), so under bf16/fp16 unit 0 casts it to its weights'
    dtype (``x.to(self.fc.weight.dtype)``, as a DeepSpeed user writes ``inputs.half()``), and the
    last unit computes its own loss from ``labels`` (``F.cross_entropy(logits.float(), labels)``
    for classes). Positions, masks and segments are for sequences; such data leaves them None.

How zdsl calls a unit
    A unit whose class sets ``takes_batch = True`` is called ``unit(x, batch)``: unit 0 with
    ``x = batch.input_ids``, the others with the previous unit's output; the last returns the
    scalar loss. A unit without it is called as in the first protocol: unit 0
    ``unit(input_ids)``, a middle one ``unit(hidden)``, the last ``unit(hidden, labels)``.
    Both forms mix freely in one model. The last unit's loss is the mean over the micro-batch's
    counted tokens: :func:`zdsl.runtime.models.loss.causal_lm_loss` computes it (fp32, ``-100``
    ignored, 0 when nothing is counted).

``prepare(batch) -> None`` (optional)
    Called once per micro-batch, before unit 0, under ``torch.no_grad()``: on the rank's device
    when training, on the meta device when zdsl sizes the model (make tensors on
    ``batch.input_ids.device``). It puts per-batch tensors into ``batch.extras`` (rotary tables
    from the positions, a 4-D causal and padding mask) so that no unit recomputes them. It may
    read the model's buffers, never its parameters (they live in zdsl's flat shards and may not
    be gathered then). It must be deterministic: a recomputed unit sees the same ``batch``.
    What it and the units put into ``extras`` is held until the micro-batch's last backward (one
    micro-batch's at a time when they run one after another) and the plan counts it with the
    micro-batch's input: per row what grows with the rows, once what every row shares.

``tied: dict[tuple[int, int], str | tuple[str, ...]]`` (optional)
    ``{(user_unit, owner_unit): "param name in the owner unit"}``: unit ``user_unit`` reads a
    parameter registered in ``owner_unit`` without registering it itself (the built-in GPT's
    head reads the embedding's ``wte.weight``). zdsl gathers the owner's parameters where the
    user runs and sends the user's gradient of that parameter to the owner's gradient.

``forward(input_ids, labels)`` or ``forward(batch)``
    Running the units in order (:func:`run_units` does it for a batch), so the model stays
    usable as a plain module (DDP, FSDP2, DeepSpeed, export). zdsl itself calls the units.

A model object given to ``zdsl.initialize(..., model=m)`` (the Python API) may also be a plain
``nn.Sequential`` or a module whose ``forward`` calls its top-level children in order: it is
split into units there (``runtime/api/given.py``), or by ``zdsl.units(m, [...], loss=...)``,
which also gives a factory named in a schedule a model of this protocol from such a module.

Loading
-------
A user's model is named in a schedule as ``model "file.py:build"(k=v)`` (a file, relative to
the schedule's folder, whose folder goes on ``sys.path`` as a script's does, so it can import
the modules beside it) or ``model "pkg.module:build"()`` (an importable module).
``build(**kwargs)`` returns the module. Every way this can go wrong is a
:class:`ModelProtocolError` whose message names the factory and says what to change; it never
surfaces as a bare traceback.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.autograd import graph as autograd_graph

from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.gpt import GPT

PROTOCOL_DOC = "the unit protocol (zdsl.runtime.models.protocol)"


class ModelProtocolError(ValueError):
    """A model that cannot be loaded or does not follow the unit protocol."""


def load_factory(spec: str, base_dir: str | os.PathLike | None = None, what: str | None = None) -> Callable:
    """``"path/to/file.py:build"`` or ``"pkg.module:build"`` -> the callable. ``what`` names it in
    errors (default ``model "SPEC"``; a data function is another user callable loaded the same way)."""
    what = what or f'model "{spec}"'
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ModelProtocolError(f'{what}: expected "file.py:build" or "package.module:build"')
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = Path(target).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise ModelProtocolError(f'{what}: no such file {path}')
        name = f"zdsl_user_model_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ModelProtocolError(f'{what}: cannot load {path} as Python')
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module   # so the module pickles and dataclasses in it work
        folder = str(path.resolve().parent)
        if folder not in sys.path:   # its own imports find the modules beside it, as for a script;
            sys.path.insert(0, folder)   # kept: build() and forward() may import lazily
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise ModelProtocolError(f'{what}: importing {path} failed: {type(exc).__name__}: {exc}') \
                from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise ModelProtocolError(f'{what}: cannot import {target}: {type(exc).__name__}: {exc}') \
                from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ModelProtocolError(f'{what}: {target} defines no {attr!r}')
    if not callable(factory):
        raise ModelProtocolError(f'{what}: {attr} is not callable; it must build and return the model')
    return factory


def check_model(model, where: str) -> list[nn.Module]:
    """Check ``model`` against the unit protocol; returns its units."""
    if not isinstance(model, nn.Module):
        raise ModelProtocolError(f"{where}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    units_fn = getattr(model, "units", None)
    if not callable(units_fn):
        raise ModelProtocolError(f"{where}: the model has no units() method; {PROTOCOL_DOC} needs one "
                                 f"that returns its ordered list of unit modules")
    try:
        units = list(units_fn())
    except Exception as exc:
        raise ModelProtocolError(f"{where}: units() failed: {type(exc).__name__}: {exc}") from None
    if len(units) < 2:
        raise ModelProtocolError(f"{where}: units() returned {len(units)} unit(s); {PROTOCOL_DOC} needs at "
                                 f"least two (the first takes the data's inputs, the last returns the loss)")
    for i, u in enumerate(units):
        if not isinstance(u, nn.Module):
            raise ModelProtocolError(f"{where}: unit {i} is {type(u).__name__}, not a torch.nn.Module")
    owner: dict[int, int] = {}
    for i, u in enumerate(units):
        for name, p in u.named_parameters():
            if id(p) in owner:
                raise ModelProtocolError(
                    f"{where}: parameter {name!r} is registered in unit {owner[id(p)]} and unit {i}; register "
                    f"it in one unit and declare the other's use in `tied` ({PROTOCOL_DOC})")
            owner[id(p)] = i
    missing = [n for n, p in model.named_parameters() if id(p) not in owner]
    if missing:
        raise ModelProtocolError(f"{where}: parameters outside every unit: {', '.join(missing[:5])}"
                                 f"{' ...' if len(missing) > 5 else ''}; every parameter must belong to one unit")
    if getattr(model, "prepare", None) is not None and not callable(model.prepare):
        raise ModelProtocolError(f"{where}: `prepare` must be a method prepare(batch) that fills batch.extras "
                                 f"({PROTOCOL_DOC})")
    tied = getattr(model, "tied", {}) or {}
    if not isinstance(tied, dict):
        raise ModelProtocolError(f"{where}: `tied` must be a dict {{(user_unit, owner_unit): 'param name'}}")
    for key, names in tied.items():
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, int) for k in key)):
            raise ModelProtocolError(f"{where}: tied key {key!r} must be (user_unit, owner_unit)")
        user, own = key
        if not (0 <= user < len(units) and 0 <= own < len(units)) or user == own:
            raise ModelProtocolError(f"{where}: tied {key!r} names units outside 0..{len(units) - 1} "
                                     f"or a unit tied to itself")
        owned = dict(units[own].named_parameters())
        for name in ([names] if isinstance(names, str) else list(names)):
            if name not in owned:
                raise ModelProtocolError(f"{where}: tied {key!r}: unit {own} has no parameter {name!r} "
                                         f"(it has {', '.join(list(owned)[:6])})")
    return units


def takes_batch(unit: nn.Module) -> bool:
    """Whether zdsl calls ``unit(x, batch)`` (else the first protocol's form)."""
    return bool(getattr(unit, "takes_batch", False))


def call_unit(unit: nn.Module, x: torch.Tensor, batch: Batch, last: bool) -> torch.Tensor:
    """Run one unit as zdsl does: ``x`` is ``batch.input_ids`` for unit 0, else the previous
    unit's output; the last unit returns the loss."""
    if takes_batch(unit):
        return unit(x, batch)
    return unit(x, batch.labels) if last else unit(x)


# The engine call torch.autograd.grad makes once it has checked its arguments; private, so
# looked up, with torch.autograd.grad where a torch lacks it.
_run_backward = getattr(autograd_graph, "_engine_run_backward", None)


def unit_grads(output: torch.Tensor, inputs: list[torch.Tensor], grad_output: torch.Tensor | None) -> tuple:
    """``torch.autograd.grad(output, inputs, grad_outputs=grad_output, allow_unused=True)``,
    with ``grad_output``'s check done here: torch checks a gradient's shape through
    ``torch.fx.experimental.symbolic_shapes``, whose first import (sympy) costs every rank
    ~0.4 s of CPU in its first backward. zdsl makes ``grad_output`` itself, a plain tensor of
    the output's shape and dtype; anything else goes through torch's own check."""
    if (_run_backward is None or not isinstance(grad_output, torch.Tensor)
            or torch.overrides.has_torch_function((output, grad_output, *inputs))
            or output.is_nested or grad_output.shape != output.shape
            or grad_output.dtype != output.dtype or grad_output.device != output.device):
        return torch.autograd.grad(output, inputs, grad_outputs=grad_output, allow_unused=True)
    return _run_backward((output,), (grad_output,), False, False, tuple(inputs), True, accumulate_grad=False)


def prepare_batch(model: nn.Module, batch: Batch) -> Batch:
    """The model's ``prepare(batch)`` when it has one (under no_grad); returns ``batch``."""
    prepare = getattr(model, "prepare", None)
    if prepare is not None:
        with torch.no_grad():
            prepare(batch)
    return batch


def run_units(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The loss of ``batch`` through the model's units, as zdsl runs them (a ``forward(batch)``)."""
    prepare_batch(model, batch)
    units = unit_modules(model)
    x = batch.input_ids
    for i, unit in enumerate(units):
        x = call_unit(unit, x, batch, last=i == len(units) - 1)
    return x


def unit_modules(model: nn.Module) -> list[nn.Module]:
    """``model.units()``, the protocol's one required method (:func:`check_model` checks it)."""
    units: Callable[[], Iterable[nn.Module]] = getattr(model, "units")
    return list(units())


def tied_uses(model, n_units: int) -> list[list[int]]:
    """For each unit, the other units whose parameters it reads."""
    uses: list[list[int]] = [[] for _ in range(n_units)]
    for (user, own) in (getattr(model, "tied", {}) or {}):
        if own not in uses[user]:
            uses[user].append(own)
    return uses


def tied_indices(model: nn.Module, units: list[nn.Module]) -> dict[int, list[tuple[int, int]]]:
    """``model.tied`` -> {user unit: [(owner unit, index of the parameter in the owner)]}."""
    out: dict[int, list[tuple[int, int]]] = {}
    for (user, owner), names in dict(getattr(model, "tied", {}) or {}).items():
        owned = [n for n, _ in units[owner].named_parameters()]
        for name in ([names] if isinstance(names, str) else list(names)):
            out.setdefault(user, []).append((owner, owned.index(name)))
    return out


def build_model(model_spec, seed: int = 0, device=None, base_dir=None, lazy: bool = False) -> nn.Module:
    """The model a schedule's ``model`` statement names, initialised from ``seed``.

    ``model_spec``: ``zdsl.schedule.ModelSpec`` (kind "gpt" with its sizes, or
    "user" with ``factory``). Under ``with torch.device("meta")`` nothing is
    allocated (sizing). ``lazy``: the caller materialises the units one at a
    time (``RankState`` does), so a ``model hf`` keeps its parameters on meta
    until then (with ``device`` None); the built-in GPT decides by its size."""
    if model_spec.kind == "gpt":
        try:
            model: nn.Module = GPT(**model_spec.args, seed=seed, device=device)
        except TypeError as exc:
            raise ModelProtocolError(f"model gpt(...): {exc}") from None
        return model
    if model_spec.kind == "hf":
        from zdsl.runtime.models.hf import load  # transformers: only for model hf(...)
        model = load(model_spec, seed=seed, lazy=lazy and device is None)
        return model.to(device) if device is not None and torch.empty(0).device.type != "meta" else model
    if model_spec.kind != "user" or not model_spec.factory:
        raise ModelProtocolError(f"model kind {model_spec.kind!r}: expected gpt(...) or \"file.py:build\"(...)")
    where = f'model "{model_spec.factory}"'
    factory = load_factory(model_spec.factory, base_dir)
    meta = torch.empty(0).device.type == "meta"
    if not meta:
        torch.manual_seed(seed)
    try:
        model = factory(**model_spec.args)
    except TypeError as exc:
        raise ModelProtocolError(f"{where}: calling the factory with {model_spec.args}: {exc}") from None
    except Exception as exc:
        raise ModelProtocolError(f"{where}: the factory failed: {type(exc).__name__}: {exc}") from None
    check_model(model, where)
    if device is not None and not meta:
        model = model.to(device)
    return model
