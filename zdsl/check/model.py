"""Checking the ``model`` statement and the model's units, and ``freeze``, which names their parameters.

``model gpt(...)`` is the built-in GPT (sized here, analytically); ``model hf("DIR", ...)`` a
Hugging Face folder and overrides of its config; ``model "file.py:build"(...)`` a user's
factory and its keyword arguments; no statement, the module the user's loop gives (kind "loop").
Once the statement is read the model is sized
(``units_for``, which builds a user's or an HF model through the runtime), so the checks that
need its units (recompute ranges, prefetch depth, freeze globs, pipelines) can use them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from zdsl.check.draft import Draft
from zdsl.lang import ast
from zdsl.lang.errors import ZsError, did_you_mean
from zdsl.lang.include import path_exists, resolve_relative
from zdsl.model.freeze import FreezeError, frozen_params
from zdsl.model.hf_folder import (
    ATTENTION_CHOICES,
    ATTENTION_KEY,
    HfModelError,
    find_folder,
    read_config,
    transformers_installed,
)
from zdsl.model.units import UnitSpec, gpt_units
from zdsl.schedule import GPT_DEFAULTS, ModelSpec, Span
from zdsl.sources import sizing_data
from zdsl.sources.python import PythonDataError

# Sizes a model: units_for(model), and units_for(model, data=...) where the data's source
# takes part in the sizing (zdsl.sources.sizing_data; zdsl.compile.models.units_for).
UnitsFor = Callable[..., list[UnitSpec]]
GPT_LIMITS = {"layers": 100_000, "width": 1 << 20, "heads": 1 << 12, "vocab": 1 << 24, "context": 1 << 24}


def default_units_for(spec: ModelSpec, data=None) -> list[UnitSpec] | None:
    """Built-in models are sized here; a user's model needs the runtime, so None."""
    if spec.kind == "gpt":
        return gpt_units(**{**GPT_DEFAULTS, **spec.args})
    return None


def check_model(draft: Draft, st: ast.CallStmt, units_for: UnitsFor) -> None:
    """``model ...``: the spec into the schedule, then its units into ``draft.units``."""
    draft.span("model", st.span)
    errors_before = draft.errors()
    call = st.call
    if isinstance(call.callee, ast.Name) and call.callee.value == "hf":
        spec = _hf_model(draft, call)
        if spec is None:
            return
        draft.schedule.model = spec
    elif isinstance(call.callee, ast.Name):
        if call.callee.value != "gpt":
            draft.report.error(call.callee.span, f"unknown model {call.callee.value!r}",
                               hint=did_you_mean(call.callee.value, ["gpt", "hf"]) or
                               'built-in: gpt(...); Hugging Face: hf("DIR"); your own: "file.py:build"(...)')
            return
        draft.schedule.model = ModelSpec("gpt", _gpt_args(draft, call))
    else:
        factory = _factory(draft, call.callee)
        if factory is None:
            return
        for arg in call.args:
            if arg.key is None:
                draft.report.error(arg.span, "a model factory takes key=value arguments", hint="write name=value")
        draft.schedule.model = ModelSpec("user", _model_settings(draft, call), factory)
    if draft.errors() == errors_before:     # sized only as written
        _size(draft, st, units_for)


def check_loop_model(draft: Draft, units_for: UnitsFor) -> None:
    """No ``model`` statement: the module the user's loop gives (``initialize(..., model=m)``), kind
    "loop". Sized by ``units_for`` where it knows that module (the API's hook), else unknown here."""
    schedule = draft.schedule
    schedule.model = ModelSpec("loop")
    try:
        units = units_for(schedule.model, **sizing_data(schedule.data))
    except ZsError:
        raise
    except Exception as exc:   # noqa: BLE001 - a user's module may raise anything
        draft.report.error(Span(schedule.file, 1, 1), f"cannot size initialize()'s model=: {type(exc).__name__}: {exc}")
        return
    draft.units = list(units) if units else None


def _model_settings(draft: Draft, call: ast.Call) -> dict:
    """The factory's arguments or the config's overrides, their spans under ``model.``."""
    return draft.report.free_settings(call.args, lambda name, span: draft.span(f"model.{name}", span))


def _gpt_args(draft: Draft, call: ast.Call) -> dict:
    report = draft.report
    given = report.keywords(call.args, tuple(GPT_DEFAULTS), "gpt()")
    args = dict(GPT_DEFAULTS)
    for key, arg in given.items():
        value = report.integer(arg.value, f"gpt({key}=)", 1, GPT_LIMITS[key])
        if value is not None:
            args[key] = value
            draft.span(f"model.{key}", arg.span)
    if args["width"] % args["heads"]:
        at = given.get("heads") or given.get("width")
        report.error(at.value.span if at else call.span, f"heads ({args['heads']}) must divide width ({args['width']})",
                     hint=f"e.g. width={args['heads'] * max(1, args['width'] // args['heads'])}")
    return args


def _hf_model(draft: Draft, call: ast.Call) -> ModelSpec | None:
    """``hf("DIR", key=value...)``: a Hugging Face model folder and overrides of its config."""
    report = draft.report
    positional = [a for a in call.args if a.key is None]
    if len(positional) != 1:
        report.error(positional[1].span if positional[1:] else call.span,
                     "hf(...) takes one model folder, then key=value overrides",
                     hint='model hf("path/to/model", layers=2)')
        return None
    where = positional[0].value
    name = report.string(where, "the model folder")
    args = _model_settings(draft, call)
    if ATTENTION_KEY in args and args[ATTENTION_KEY] not in ATTENTION_CHOICES:
        report.error(draft.schedule.spans[f"model.{ATTENTION_KEY}"],
                     f"{ATTENTION_KEY} is one of {', '.join(ATTENTION_CHOICES)}")
    if name is None:
        return None
    if not transformers_installed():
        report.error(call.callee.span, "model hf(...) needs transformers, which is not installed",
                     hint="pip install 'zdsl[hf]'")
        return None
    try:   # the overrides are checked against the family's config class when sized
        folder = find_folder(name, resolve_relative(".", where.span.file))
        read_config(folder)
    except HfModelError as exc:
        report.error(where.span, str(exc), hint=exc.hint)
        return None
    return ModelSpec("hf", args, path=str(folder))


def _factory(draft: Draft, callee: ast.Str) -> str | None:
    """``"file.py:build"`` (made absolute) or ``"package.module:build"``; None after an error."""
    report = draft.report
    text = callee.value
    target, sep, func = text.rpartition(":")
    if not sep or not target or not func.isidentifier():
        report.error(callee.span, f"model factory {text!r} must be \"file.py:function\" "
                                  "or \"package.module:function\"",
                     hint='e.g. model "my_model.py:build"(hidden=64)')
        return None
    if target.endswith(".py"):
        path = Path(resolve_relative(target, callee.span.file))
        if not path_exists(path, "file"):
            report.error(callee.span, f"model file not found: {path}",
                         hint="a model file's path is relative to the schedule file")
            return None
        return f"{path.resolve()}:{func}"
    if not all(part.isidentifier() for part in target.split(".")):
        report.error(callee.span, f"{target!r} is neither a .py file nor a module name")
        return None
    return text


def _size(draft: Draft, st: ast.CallStmt, units_for: UnitsFor) -> None:
    """The model's units, for the checks that need them (None if unknown)."""
    schedule, report = draft.schedule, draft.report
    try:
        units = units_for(schedule.model, **sizing_data(schedule.data))
    except ZsError:
        raise
    except PythonDataError as exc:   # the data function sizing called broke its contract
        report.error(schedule.spans.get("data") or st.call.span, str(exc), hint=exc.hint)
        return
    except HfModelError as exc:    # the runtime checked the config against transformers' class
        report.error(schedule.spans.get(f"model.{exc.key}") or st.call.span, str(exc), hint=exc.hint)
        return
    except Exception as exc:   # noqa: BLE001 - a user's factory may raise anything
        report.error(st.call.callee.span, f"cannot size the model: {type(exc).__name__}: {exc}")
        return
    if units is not None and not units:
        report.error(st.call.span, "the model has no units")
        return
    draft.units = list(units) if units is not None else None


def check_freeze(draft: Draft, st: ast.FreezeStmt) -> None:
    """``freeze GLOB, ...``: the parameters kept frozen, each glob matching one of the model's."""
    draft.span("freeze", st.span)
    globs = tuple(dict.fromkeys(p.value for p in st.patterns if p.value))
    for p in st.patterns:
        if not p.value:
            draft.report.error(p.span, "an empty freeze pattern", hint='e.g. freeze embed*, "*.bias"')
    if draft.units is not None:      # else sized later, by the runtime, which checks again
        try:
            frozen_params(draft.units, globs)
        except FreezeError as exc:
            at = next((p.span for p in st.patterns if p.value == exc.glob), st.span)
            draft.report.error(at, str(exc), hint=exc.hint)
            return
    draft.schedule.freeze = globs
