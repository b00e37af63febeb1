"""A user's model object as units (runtime/api/given.py) and its schedule, without a process group.

Guards: a chain of children (nn.Sequential, or a forward that calls its children in order, checked
by tracing) is split with parameter-free children joined to a neighbour and the model's own
parameter names kept; anything else is refused with how to list its units; zdsl.units lists them;
a schedule that names another model than model= is refused, the same model accepted (the
statement honoured, the object trained); the given model is sized from the schedule's data (its
units' shapes are the object's).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import zdsl
from api_models import Mlp, Residual, schedule, sequential
from zdsl.runtime.api import ZdslApiError
from zdsl.runtime.api.given import as_unit_model
from zdsl.runtime.api.setup import compile_for
from zdsl.runtime.models.batch import Batch


def unit_names(model) -> list[list[str]]:
    return [[n for n, _ in u.named_parameters()] for u in model.units()]


def test_a_chain_module_splits_at_its_children_and_keeps_their_names():
    model = as_unit_model(Mlp())
    assert unit_names(model) == [["fc1.weight", "fc1.bias"], ["fc2.weight", "fc2.bias"]]   # relu joins fc1
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in Mlp().named_parameters()]
    x = torch.randn(3, 12)
    out = x
    for unit in model.units():
        out = unit(out)
    assert torch.equal(out, model(x))


def test_a_sequential_splits_each_parametered_child_with_the_activation_after_it():
    model = as_unit_model(sequential())
    assert unit_names(model) == [["0.weight", "0.bias"], ["2.weight", "2.bias"], ["4.weight", "4.bias"]]
    assert [type(m).__name__ for m in model.units()[0].order] == ["Linear", "Tanh"]


def test_a_module_that_is_no_chain_is_refused_with_how_to_list_its_units():
    with pytest.raises(ZdslApiError, match=r"cannot split it into units: its forward calls <built-in function "
                                           r"add>.*zdsl\.units"):
        as_unit_model(Residual())
    with pytest.raises(ZdslApiError, match="one unit"):
        as_unit_model(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ZdslApiError, match="torch.nn.Module"):
        as_unit_model(object())


def test_zdsl_units_lists_them_in_order_nested_names_allowed():
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(4, 8))
    model.add_module("blocks", nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]))
    model.add_module("head", nn.Linear(8, 2))
    split = zdsl.units(model, ["embed", ["blocks.0", "blocks.1"], model.head])
    assert unit_names(split) == [["embed.weight", "embed.bias"],
                                 ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"],
                                 ["head.weight", "head.bias"]]
    with pytest.raises(ZdslApiError, match="parameters outside every unit"):
        zdsl.units(model, ["embed", "head"])
    with pytest.raises(ZdslApiError, match="no submodule 'nope'"):
        zdsl.units(model, ["embed", "nope"])


def test_a_given_model_is_sized_from_the_schedule_data(tmp_path):
    compiled = compile_for(str(schedule(tmp_path)), None, as_unit_model(Mlp()))
    assert [dict(u.params) for u in compiled.units] == [{"fc1.weight": (16, 12), "fc1.bias": (16,)},
                                                        {"fc2.weight": (5, 16), "fc2.bias": (5,)}]
    assert compiled.units[0].fwd_flops_per_seq > 0


def build_mlp(hidden: int = 16):
    """A schedule's model "test_units.py:build_mlp": Mlp as zdsl.units splits it, its loss in the last unit."""
    return zdsl.units(Mlp(hidden=hidden), [["fc1", "relu"], "fc2"], loss=torch.nn.CrossEntropyLoss())


def test_a_schedule_that_names_another_model_than_model_is_refused(tmp_path):
    for model, differ in (("gpt(layers=2, width=32, heads=4, vocab=64, context=8)", "model= has 2 units, the "
                           "schedule's model 4"),
                          (f'"{__file__}:build_mlp"(hidden=8)', r"unit 0 holds fc1\.weight \(16, 12\) in model=, "
                           r"fc1\.weight \(8, 12\) in the schedule's model")):
        zs = schedule(tmp_path, model=model)
        with pytest.raises(ZdslApiError, match=r"api\.zs:2:1: the schedule names a model and initialize\(\) was "
                                               r"given model=Mlp, another one \(" + differ + r"\): one model only"):
            compile_for(str(zs), None, as_unit_model(Mlp()))


def test_a_schedule_that_names_the_same_model_trains_the_object(tmp_path):
    zs = schedule(tmp_path, model=f'"{__file__}:build_mlp"()')
    compiled = compile_for(str(zs), None, as_unit_model(Mlp()))
    assert compiled.schedule.model.factory.endswith("test_units.py:build_mlp")
    x, y = torch.randn(3, 12), torch.tensor([0, 1, 2])
    torch.manual_seed(0)
    split = build_mlp()
    torch.manual_seed(0)
    want = torch.nn.functional.cross_entropy(Mlp()(x), y)
    first, last = split.units()
    assert torch.equal(last(first(x, Batch.of(x, y)), Batch.of(x, y)), want)   # the loss unit zdsl run calls


def test_a_schedule_that_does_not_compile_says_where(tmp_path):
    zs = schedule(tmp_path, extra="prefetch parameters lots ahead\n")
    with pytest.raises(ZdslApiError, match=r"api\.zs does not compile:\n.*api\.zs:7:21: error: unexpected .lots."):
        compile_for(str(zs), None, as_unit_model(Mlp()))
