"""A user's model object as units: the unit protocol as it is, or a chain of children split.

``initialize(..., model=m)`` trains ``m`` itself, in three ways:

* ``m`` follows the unit protocol (``runtime/models/protocol.py``: it has ``units()``): as it is;
* ``m`` is a Hugging Face causal LM, or its folder's path: split as ``model hf`` splits it (``hf.py``);
* ``m`` is an ``nn.Sequential``, or a module whose ``forward`` only calls its top-level children
  in order, each on the previous one's output (checked by tracing it with ``torch.fx``, every
  top-level child a leaf): split at those children, a child without parameters joined to the
  unit before it (the first ones to the unit after);
* ``units(m, [...])`` says the split: module names (dotted paths allowed) or lists of them, one
  item per unit, run in that order; the caller vouches that ``m``'s forward is that chain.
  ``units(m, [...], loss=fn)`` makes the last unit return ``fn(output, labels)``: a model of the
  unit protocol, which a schedule's ``model "file.py:build"`` can name for ``zdsl run``.

Anything else is a :class:`ZdslApiError` that says how to list its units. A split model's units
take the batch (``takes_batch``) and return what their last child returns: the last unit's output
is the model's, for the user's own loss. Parameter names stay the model's own (``fc1.weight``),
so ``engine.state_dict()`` loads into the model, and checkpoints name them so.

Sizing: the compiler sizes the model through ``units_for`` (``zdsl/driver.py``'s hook); a schedule
without a model statement has the model of kind "loop" (``zdsl/check/loop.py``), which
:func:`sizing_hook` answers with a meta-device copy of the object (no memory, no init). Where the
batches are fed (no ``data`` statement) and the model is the user's, its row is the first batch's:
the hook leaves it unsized until ``initialize`` records that row (``deferred.py``). A schedule that
names a model trains the object only where both are the same model (:func:`differences`: each
unit's parameter names and shapes), the statement honoured and the object's weights trained; else
initialize refuses.
"""
from __future__ import annotations

import copy
import itertools
from pathlib import Path

import torch
import torch.nn as nn

from zdsl.errors import ZdslApiError

HOW_TO_LIST = ("list its units with zdsl.units(model, [\"embed\", [\"block0\", \"block1\"], \"head\"]) "
               "(module names in the order they run, one item per unit), or give it a units() method "
               "(the unit protocol, zdsl.runtime.models.protocol)")


class Chain(nn.Module):
    """One unit of a split model: its modules under their names in the model, run in order."""
    takes_batch = True

    def __init__(self, named: list[tuple[str, nn.Module]], loss=None):
        super().__init__()
        self.order = [m for _, m in named]
        for name, module in named:
            place(self, name, module)
        self.loss = loss            # the last unit's: fn(output, labels) -> the loss

    def forward(self, x, batch=None):
        first = next(itertools.chain.from_iterable(m.parameters() for m in self.order), None)
        if first is not None and x.is_floating_point() and x.dtype != first.dtype:
            x = x.to(first.dtype)       # bf16/fp16 weights: the data's fp32 features cast, as DeepSpeed users do
        for module in self.order:
            x = module(x)
        return x if self.loss is None else self.loss(x, batch.labels)


class UnitModel(nn.Module):
    """A model of :class:`Chain` units; the user's modules keep their names (``state_dict`` keys)."""

    def __init__(self, model: nn.Module, groups: list[list[tuple[str, nn.Module]]], loss=None):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.chains = [Chain(g, loss if i == len(groups) - 1 else None) for i, g in enumerate(groups)]
        self.given = type(model).__name__

    def units(self) -> list[nn.Module]:
        return list(self.chains)

    def forward(self, x):
        for unit in self.chains:
            x = unit(x)
        return x


def place(root: nn.Module, dotted: str, module: nn.Module) -> None:
    """Register ``module`` in ``root`` at the dotted path ``dotted``, making plain containers on the way."""
    *path, leaf = dotted.split(".")
    for part in path:
        if part not in root._modules:
            root.add_module(part, nn.Module())
        root = root.get_submodule(part)
    root.add_module(leaf, module)


def as_unit_model(model) -> nn.Module:
    """``model`` as a model of the unit protocol (module docstring); :class:`ZdslApiError` if it is none."""
    if isinstance(model, UnitModel) or callable(getattr(model, "units", None)):
        return model
    from zdsl.runtime.api.hf import hf_units, is_hf_causal_lm
    if isinstance(model, (str, Path)) or is_hf_causal_lm(model):
        return hf_units(model)        # a Hugging Face causal LM (runtime/api/hf.py)
    if not isinstance(model, nn.Module):
        raise ZdslApiError(f"model= takes a torch.nn.Module, got {type(model).__name__}")
    order, problem = chain_order(model)
    if problem:
        raise ZdslApiError(f"model={type(model).__name__}: zdsl cannot split it into units: {problem}; "
                           f"{HOW_TO_LIST}")
    return split(model, [[name] for name in order], joined=True)


def units(model: nn.Module, groups, loss=None) -> UnitModel:
    """``model`` split as ``groups`` says: each item a module name (or the module) or a list of
    them, one unit per item, run in this order (``zdsl.units``); ``loss(output, labels)``, the
    last unit's loss, where the split is to follow the unit protocol (``zdsl run``)."""
    if not isinstance(model, nn.Module):
        raise ZdslApiError(f"zdsl.units takes a torch.nn.Module, got {type(model).__name__}")
    names = {id(m): n for n, m in model.named_modules() if n}
    listed = []
    for item in groups:
        members = item if isinstance(item, (list, tuple)) else [item]
        listed.append([member_name(model, names, m) for m in members])
    if not listed or not all(listed):
        raise ZdslApiError("zdsl.units: give one item (a module name or a list of them) per unit")
    return split(model, listed, joined=False, loss=loss)


def member_name(model: nn.Module, names: dict, member) -> str:
    """A unit member's dotted name in ``model`` (given as a name or as the module itself)."""
    if isinstance(member, nn.Module):
        if id(member) not in names:
            raise ZdslApiError(f"zdsl.units: a {type(member).__name__} that is not a submodule of the model")
        return names[id(member)]
    try:
        model.get_submodule(str(member))
    except AttributeError:
        top = ", ".join(n for n, _ in model.named_children())
        raise ZdslApiError(f"zdsl.units: the model has no submodule {member!r} (its children: {top})") from None
    return str(member)


def split(model: nn.Module, listed: list[list[str]], joined: bool, loss=None) -> UnitModel:
    """The units of ``listed`` (module names per unit); ``joined``: a unit without parameters is
    merged into its neighbour (the one before it; the first ones into the one after)."""
    groups = [[(n, model.get_submodule(n)) for n in names] for names in listed]
    if joined:
        groups = join_parameter_free(groups)
    inside = {id(p) for g in groups for _, m in g for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in inside]
    if outside:
        raise ZdslApiError(f"model={type(model).__name__}: parameters outside every unit "
                           f"({', '.join(outside[:4])}); every parameter must be in one unit; {HOW_TO_LIST}")
    if len(groups) < 2:
        raise ZdslApiError(f"model={type(model).__name__}: its parameters are in one unit, and zdsl needs at "
                           f"least two (a unit is what a gather, an offload and a prefetch move); {HOW_TO_LIST}")
    return UnitModel(model, groups, loss)


def join_parameter_free(groups: list[list]) -> list[list]:
    out: list[list] = []
    waiting: list = []
    for group in groups:
        if any(True for _, m in group for _ in m.parameters()):
            out.append(waiting + group)
            waiting = []
        elif out:
            out[-1] = out[-1] + group
        else:
            waiting += group
    if waiting:
        out.append(waiting)       # only parameter-free children: the caller refuses one unit
    return out


class _TopLevelTracer(torch.fx.Tracer):
    """Traces a module's own forward, each top-level child a leaf (called, not looked into)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return "." not in qualname or super().is_leaf_module(m, qualname)


def chain_order(model: nn.Module) -> tuple[list[str], str | None]:
    """The top-level children in the order ``model.forward`` calls them, each on the previous
    one's output, and None; or why its forward is not such a chain."""
    children = [n for n, _ in model.named_children()]
    if isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward:
        return children, None
    try:
        graph = _TopLevelTracer().trace(model)
    except Exception as exc:    # noqa: BLE001 - any user forward: its reason is the message
        return [], f"torch.fx cannot trace its forward ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        return [], f"its forward takes {len(inputs)} inputs; a chain of units takes one tensor"
    order, prev = [], inputs[0]
    for node in nodes[1:]:
        if node.op == "output" and node.args == (prev,):
            break
        if node.op != "call_module" or node.args != (prev,) or node.kwargs:
            what = f"calls {node.target}" if node.op.startswith("call") else f"uses {node.op} {node.target}"
            return [], f"its forward {what} besides calling its children one after another"
        order.append(str(node.target))
        prev = node
    repeated = sorted({n for n in order if order.count(n) > 1})
    if repeated:
        return [], f"its forward calls {repeated[0]} more than once"
    unused = [n for n, m in model.named_children() if n not in order and any(True for _ in m.parameters())]
    if unused:
        return [], f"its forward never calls {unused[0]}, which has parameters"
    return order, None


def meta_copy(model: nn.Module) -> nn.Module:
    """``model`` with every parameter and buffer on the meta device (no memory, no init), to size."""
    memo: dict[int, object] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def sizing_hook(given: nn.Module | None, units_for):
    """``units_for`` (zdsl/driver.py) that sizes ``given`` where the schedule has no model statement
    (kind "loop"; None without ``given``), leaves a user's model with fed batches unsized (None) until
    their row is recorded, and every other model to ``units_for``; sized once per context and data."""
    from zdsl.sources.fed import FedSource
    sized: dict[tuple, list] = {}

    def hooked(spec, context: int | None = None, data=None):
        if data is not None and FedSource.deferred(data, spec.kind):
            return None                 # sized from the first batch (deferred.py)
        if spec.kind != "loop":
            return units_for(spec, context, data)
        if given is None:
            return None
        key = (context, repr(data))
        if key not in sized:
            sized[key] = size_given(given, context, data)
        return sized[key]
    return hooked


def size_given(given: nn.Module, context: int | None, data) -> list:
    """The compiler's units of ``given``: a meta copy traced as a named model would be."""
    from zdsl.runtime.sizing import model_unit_specs, sizing_inputs
    context, sample, masked = sizing_inputs(data, context, data.args.get("context") if data is not None else None)
    name = getattr(given, "given", type(given).__name__)
    return model_unit_specs(meta_copy(given), f"model={name}", context, sample=sample, masked=masked)


def as_units(model: nn.Module) -> list[nn.Module]:
    """A unit-protocol model's units (read through getattr: nn.Module's ``__getattr__`` types every
    attribute it does not declare as a tensor or a module)."""
    return list(getattr(model, "units")())


def differences(units: list, given: nn.Module) -> str | None:
    """Where ``given``'s units differ from the compiler's ``units`` (a schedule's model), in
    parameter names and shapes, or None when they are the same model."""
    mine = [[(n, tuple(p.shape)) for n, p in u.named_parameters()] for u in as_units(given)]
    theirs = [[(n, tuple(shape)) for n, shape in spec.params] for spec in units]
    if len(mine) != len(theirs):
        return f"model= has {len(mine)} units, the schedule's model {len(theirs)}"
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            diff = next(((x, y) for x, y in itertools.zip_longest(a, b) if x != y))
            show = lambda p: "nothing" if p is None else f"{p[0]} {p[1]}"   # noqa: E731
            return f"unit {i} holds {show(diff[0])} in model=, {show(diff[1])} in the schedule's model"
    return None
