"""Checking how the model trains: ``train``, ``optimizer`` (with its rate schedule and the
parameters exempt from weight decay) and ``checkpoint``."""
from __future__ import annotations

from zdsl.check.draft import Draft
from zdsl.check.values import describe
from zdsl.lang import ast
from zdsl.lang.errors import did_you_mean
from zdsl.lr import DECAYS
from zdsl.model.decay import NO_DECAY_CLASSES
from zdsl.schedule import PRECISIONS, CheckpointSpec, OptimizerSpec, TrainSpec

# Every optimizer also takes the rate schedule (zdsl/lr.py) and the decay groups (zdsl/model/decay.py).
_SCHEDULE_KEYS = ("warmup", "decay", "min_lr", "decay_steps", "no_decay")
OPTIMIZERS = {
    "adamw": ("lr", "betas", "eps", "weight_decay", "clip", *_SCHEDULE_KEYS),
    "adam": ("lr", "betas", "eps", "weight_decay", "clip", *_SCHEDULE_KEYS),
    "sgd": ("lr", "momentum", "weight_decay", "clip", *_SCHEDULE_KEYS),
}
TRAIN_RANGES = {"steps": (1, 10 ** 9), "batch": (1, 10 ** 6), "accumulate": (1, 10 ** 6), "seed": (0, 2 ** 63 - 1)}


def check_train(draft: Draft, st: ast.TrainStmt) -> None:
    draft.span("train", st.span)
    report = draft.report
    given = report.keywords(st.args, ("steps", "batch", "accumulate", "precision", "seed"), "train")
    train = TrainSpec()
    for key, arg in given.items():
        draft.span(f"train.{key}", arg.span)
        value: str | int | None = report.choice(arg.value, "precision", PRECISIONS) if key == "precision" \
            else report.integer(arg.value, key, *TRAIN_RANGES[key])
        if value is not None:
            setattr(train, key, value)
    draft.schedule.train = train


def check_optimizer(draft: Draft, st: ast.CallStmt) -> None:
    draft.span("optimizer", st.span)
    report, call = draft.report, st.call
    kind = report.choice(call.callee, "optimizer", tuple(OPTIMIZERS))
    if kind is None:
        return
    given = report.keywords(call.args, OPTIMIZERS[kind], f"{kind}()")
    optimizer = OptimizerSpec(kind=kind)
    for key, arg in given.items():
        draft.span(f"optimizer.{key}", arg.span)
        if key == "no_decay":
            _no_decay(draft, arg.value, optimizer)
            continue
        if key == "clip" and isinstance(arg.value, ast.Name) and arg.value.value == "none":
            continue
        value = _setting(draft, key, arg.value)
        if value is not None:
            setattr(optimizer, key, value)
    _lr_schedule(draft, optimizer, given)
    if "no_decay" in given and optimizer.weight_decay == 0:
        report.warn(given["no_decay"].span, "no_decay has no effect: no parameter decays without "
                                            "weight_decay", hint="add e.g. weight_decay=0.1")
    draft.schedule.optimizer = optimizer


def _setting(draft: Draft, key: str, v):
    """One optimizer setting's value (None after an error)."""
    report = draft.report
    if key in ("lr", "eps", "clip"):
        return report.real(v, key, 0.0, None, lo_open=True)
    if key in ("weight_decay", "min_lr"):
        return report.real(v, key, 0.0, None)
    if key == "momentum":
        return report.real(v, "momentum", 0.0, 1.0, hi_open=True)
    if key in ("warmup", "decay_steps"):
        return report.integer(v, key, 0 if key == "warmup" else 1, 10 ** 9)
    if key == "decay":
        return report.choice(v, "decay", DECAYS)
    return _betas(draft, v)


def _lr_schedule(draft: Draft, o: OptimizerSpec, given: dict) -> None:
    """The rate schedule's values against each other and the training steps (zdsl/lr.py)."""
    report, steps = draft.report, draft.schedule.train.steps
    if "min_lr" in given and o.min_lr > o.lr:
        report.error(given["min_lr"].value.span, f"min_lr {o.min_lr:g} is above lr {o.lr:g}",
                     hint="the rate decays from lr down to min_lr")
    for key in ("min_lr", "decay_steps"):
        if key in given and o.decay == "constant":
            report.error(given[key].value.span, f"{key} has no effect with decay=constant",
                         hint="add decay=cosine or decay=linear, or remove it")
    if o.warmup > steps:    # torchtitan warns and warms up over the whole run
        report.warn(given["warmup"].value.span, f"warmup {o.warmup} is longer than the {steps} "
                    f"training steps: the rate warms up over all {steps} and never decays",
                    hint=f"warmup={steps // 10 or 1}")
    elif o.decay_steps is not None and o.warmup + o.decay_steps > steps:
        report.error(given["decay_steps"].value.span, f"warmup {o.warmup} plus decay_steps "
                     f"{o.decay_steps} is more than the {steps} training steps",
                     hint=f"decay_steps={steps - o.warmup}" if steps > o.warmup else "lower warmup")


def _no_decay(draft: Draft, v, o: OptimizerSpec) -> None:
    """``no_decay=(biases, norms, "*.glob")``: classes by name, parameter names by glob."""
    items = v.items if isinstance(v, ast.Tuple) else [v]
    classes, globs = [], []
    for item in items:
        if isinstance(item, ast.Str) and item.value:
            globs.append(item.value)
        elif isinstance(item, ast.Name) and item.value in NO_DECAY_CLASSES:
            classes.append(item.value)
        else:
            draft.report.error(item.span, f"no_decay takes {', '.join(NO_DECAY_CLASSES)} or a quoted "
                               f"name glob, not {describe(item)}",
                               hint=did_you_mean(describe(item), NO_DECAY_CLASSES, what="a class is one of")
                               or 'e.g. no_decay=(biases, norms) or no_decay="*.bias"')
    o.no_decay, o.no_decay_names = tuple(dict.fromkeys(classes)), tuple(dict.fromkeys(globs))


def _betas(draft: Draft, v) -> tuple[float, float] | None:
    if not isinstance(v, ast.Tuple) or len(v.items) != 2:
        draft.report.error(v.span, f"betas must be two numbers, not {describe(v)}", hint="betas=(0.9, 0.999)")
        return None
    first, second = (draft.report.real(x, "a beta", 0.0, 1.0, hi_open=True) for x in v.items)
    return None if first is None or second is None else (first, second)


def check_checkpoint(draft: Draft, st: ast.CheckpointStmt) -> None:
    draft.span("checkpoint", st.span)
    report = draft.report
    every = report.integer(st.every, "checkpoint interval", 1, 10 ** 9)
    directory = report.string(st.dir, "the checkpoint folder")
    keep = 0 if st.keep is None else report.integer(st.keep, "keep", 0, 10 ** 6)
    if every is not None and directory is not None and keep is not None:
        draft.schedule.checkpoint = CheckpointSpec(every, directory, keep)
