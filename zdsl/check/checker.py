"""The checker: syntax tree to a typed, complete :class:`~zdsl.schedule.Schedule`.

It reads each statement's values (types, ranges, names), fills defaults,
resolves what needs the model (``recompute blocks`` -> unit indices), and
applies the rules ZeRO and DeepSpeed impose (sharding is a prefix of
optimizer, gradients, parameters; parameters are offloaded only at stage 3;
...). Every problem becomes a positioned diagnostic; all of a file's errors
are reported at once. The span of each statement is kept in
``Schedule.spans`` under its keyword (``prefetch``, ``offload.parameters``,
``memory.device``, ``train.steps``, ...) so later stages can point at it.

Public API: :func:`load_schedule` and :func:`check_text`.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from zdsl.lang import ast
from zdsl.check.pipelines import check_pipeline
from zdsl.check.pipelines import check_pipelines_complete
from zdsl.check.placement import PlacementChecks
from zdsl.lang.errors import (NOTE, Diagnostic, ZsError, attach_sources, did_you_mean, error,
                     note)
from zdsl.lang.include import expand_includes
from zdsl.lang.include import path_exists
from zdsl.lang.include import resolve_relative
from zdsl.lang.overrides import MACHINE_KEYS
from zdsl.lang.overrides import apply_overrides
from zdsl.lang.parse import parse_text
from zdsl.lang.parse import read_source
from zdsl.schedule import (ALL_OVERLAPS, DEVICES, MACHINE_MAY_BE_ZERO, MACHINE_OPTIONS, PRECISIONS,
                       CheckpointSpec, DataSpec, MachineProfile, ModelSpec, OptimizerSpec, Schedule, Span, TrainSpec)
from zdsl.schedule import MACHINE_TUPLES
from zdsl.schedule import TOKEN_DTYPES
from zdsl.schedule import EvalSpec
from zdsl.compile.freeze import FreezeError
from zdsl.compile.freeze import frozen_params
from zdsl import python_source
from zdsl import jsonl_source
from zdsl import text_source
from zdsl.compile.decay import NO_DECAY_CLASSES
from zdsl.lr import DECAYS
from zdsl.compile.hf_folder import ATTENTION_CHOICES
from zdsl.compile.hf_folder import ATTENTION_KEY
from zdsl.compile.hf_folder import HfModelError
from zdsl.compile.hf_folder import find_folder
from zdsl.compile.hf_folder import model_sizes
from zdsl.compile.hf_folder import read_config
from zdsl.compile.hf_folder import transformers_installed
from zdsl.compile.units import GPT_DEFAULTS
from zdsl.compile.units import UnitSpec
from zdsl.compile.units import gpt_units
from zdsl.check.values import Reader
from zdsl.check.values import describe

# Sizes a model: units_for(model), and units_for(model, data=...) for data python(...), whose
# function's tensors a built model is sized with (zdsl.compile.models.units_for).
UnitsFor = Callable[..., list[UnitSpec]]

# Every optimizer also takes the rate schedule (zdsl/lr.py) and the decay groups (zdsl/compile/decay.py).
_SCHEDULE_KEYS = ("warmup", "decay", "min_lr", "decay_steps", "no_decay")
OPTIMIZERS = {
    "adamw": ("lr", "betas", "eps", "weight_decay", "clip", *_SCHEDULE_KEYS),
    "adam": ("lr", "betas", "eps", "weight_decay", "clip", *_SCHEDULE_KEYS),
    "sgd": ("lr", "momentum", "weight_decay", "clip", *_SCHEDULE_KEYS),
}
# ``data SOURCE(...)``: its settings, and an example for a hint.
# python(...) takes any key=value: its settings go to the user's function as keyword arguments.
DATA_SETTINGS = {"corpus": ("context",), "tokens": ("dtype", "context", "vocab"), "python": (),
                 "text": ("tokenizer", "context"), "synthetic": ("context", "vocab"),
                 "jsonl": ("tokenizer", "prompt", "response", "pack", "context")}
DATA_EXAMPLES = {"corpus": 'corpus("stdlib", context=64)',
                 "tokens": 'tokens("train.bin", dtype=uint16, context=64)',
                 "text": 'text("corpus/", tokenizer="tokenizer.json", context=64)',
                 "jsonl": 'jsonl("sft.jsonl", tokenizer="tokenizer.json", pack=true, context=256)',
                 "synthetic": "synthetic(vocab=256, context=64)",
                 "python": 'python("data.py:batches", features=16)'}
# ``machine cpu(...)`` option -> MachineProfile field.
MACHINE_FIELDS = dict(MACHINE_OPTIONS)
CUDA_PROFILE = MachineProfile(name="cuda", flops=2e14, host_flops=5e10, link_bandwidth=1e11,
                              link_latency=1e-5, pcie_bandwidth=2.5e10, disk_read=3e9,
                              disk_write=2e9, memory_bandwidth=2e12, comm_slots=1)
CPU_PROFILE = MachineProfile()
MAX_RANKS = 1 << 16
# data before model: a model built to be sized takes python(...) data's tensors
STATEMENT_ORDER = ("schedule", "data", "model", "train", "optimizer", "ranks", "machine", "zero",
                   "shard", "offload", "prefetch", "bucket", "overlap", "recompute", "persist",
                   "memory", "checkpoint", "freeze", "eval")


def default_units_for(spec: ModelSpec, data=None) -> list[UnitSpec] | None:
    """Built-in models are sized here; a user's model needs the runtime, so None."""
    if spec.kind == "gpt":
        return gpt_units(**{**GPT_DEFAULTS, **spec.args})
    return None


def load_schedule(path: str, overrides: dict[str, str] | None = None,
                  units_for: UnitsFor | None = None) -> tuple[Schedule, list[Diagnostic]]:
    """Read, parse and check the .zs file at ``path``.

    Returns the schedule and its warnings; raises :class:`ZsError` (or its
    subclass :class:`~zdsl.lang.errors.UsageError` for a bad override key) with
    every error found.
    """
    return _guarded(lambda: check_text(read_source(path), path, overrides, units_for))


def check_text(text: str, file: str = "<string>", overrides: dict[str, str] | None = None,
               units_for: UnitsFor | None = None) -> tuple[Schedule, list[Diagnostic]]:
    """Parse and check schedule ``text`` as if read from ``file``."""
    def run():
        program = parse_text(text, file)
        return Checker(units_for).check(program, overrides or {})
    return _guarded(run)


def _guarded(run):
    """Last line of defence: any Python exception becomes a diagnostic, never a traceback."""
    try:
        return run()
    except ZsError:
        raise
    except RecursionError:
        raise ZsError([error(None, "schedule is nested too deeply")]) from None
    except Exception as exc:   # noqa: BLE001 - a bug, but still reported in our format
        raise ZsError([error(None, f"internal error: {type(exc).__name__}: {exc}",
                             hint="please report this with the schedule that caused it")]) from None


class Checker(PlacementChecks):
    def __init__(self, units_for: UnitsFor | None = None):
        self.units_for = units_for
        self.r = Reader()
        self.sources: dict[str, str] = {}
        self.units: list[UnitSpec] | None = None
        self._token_counts: dict[str, int | None] = {}   # data/eval tokens(...): the file's length in tokens

    # -- driver ----------------------------------------------------------------

    def check(self, program: ast.Program, overrides: dict[str, str]):
        self.sources[program.file] = program.source
        try:
            statements = expand_includes(program, self.sources)
            statements = apply_overrides(statements, overrides, self.sources)
        except ZsError as exc:
            attach_sources(exc.diagnostics, self.sources)
            raise
        self.file = program.file
        name = re.sub(r"\W", "_", Path(program.file).stem) if not program.file.startswith("<") \
            else "schedule"
        if not name.isidentifier():
            name = "_" + name
        self.s = Schedule(name=name, file=program.file)
        self.s.overlap = set(ALL_OVERLAPS)
        by_key = self._index(statements)
        for keyword in STATEMENT_ORDER:
            for stmt in by_key.get(keyword, []):
                getattr(self, f"_{keyword}")(stmt)
        if "model" not in by_key:
            self.r.error(Span(program.file, 1, 1), "the schedule has no model statement",
                         hint="add e.g. `model gpt(layers=2, width=64, heads=4)`")
        self._cross_checks(by_key)
        pipelines = by_key.get("pipeline", [])
        for stmt in pipelines:
            check_pipeline(self, stmt)
        if pipelines:
            check_pipelines_complete(self, pipelines)
        diagnostics = self.r.diagnostics
        attach_sources(diagnostics, self.sources)
        if self.r.failed:
            raise ZsError(_in_reading_order(diagnostics, program.file))
        return self.s, _in_reading_order([d for d in diagnostics if d.severity != NOTE],
                                         program.file)

    def _index(self, statements: list[ast.Stmt]) -> dict[str, list[ast.Stmt]]:
        """Statements by keyword; a statement given twice is an error at the repeat, with a
        note at the first (once, however often it is repeated)."""
        by_key: dict[str, list[ast.Stmt]] = {}
        seen: dict[str, ast.Stmt] = {}
        noted: set[str] = set()
        for stmt in statements:
            group = "pipeline" if isinstance(stmt, ast.PipelineStmt) else stmt.keyword
            key = stmt.keyword
            if isinstance(stmt, ast.OffloadStmt):
                key = f"offload.{stmt.state.value}"
            elif key == "shard":
                key = "zero"
            elif isinstance(stmt, ast.PipelineStmt):
                key = f"pipeline.{stmt.keyword}"
            if key in seen and key != "memory":
                first = seen[key]
                what = "sharding" if key == "zero" else \
                    f"the {stmt.keyword} pipeline" if group == "pipeline" else f"`{key}`"
                self.r.error(stmt.key_span, f"{what} is set twice",
                             hint=f"the first is at {_where(first.key_span)}; keep one")
                if key not in noted:
                    noted.add(key)
                    self.r.diagnostics.append(note(first.key_span, f"{what} first set here"))
                continue
            seen[key] = stmt
            by_key.setdefault(group, []).append(stmt)
        return by_key

    def span(self, key: str, span: Span) -> None:
        self.s.spans.setdefault(key, span)

    # -- statements --------------------------------------------------------------

    def _schedule(self, st: ast.ScheduleStmt) -> None:
        self.s.name = st.name.value
        self.s.description = st.description.value if st.description else ""
        self.span("schedule", st.span)

    def _model(self, st: ast.CallStmt) -> None:
        self.span("model", st.span)
        self._errors_before_model = sum(d.is_error for d in self.r.diagnostics)
        call = st.call
        if isinstance(call.callee, ast.Name) and call.callee.value == "hf":
            spec = self._hf_model(call)
            if spec is None:
                return
            self.s.model = spec
        elif isinstance(call.callee, ast.Name):
            if call.callee.value != "gpt":
                self.r.error(call.callee.span, f"unknown model {call.callee.value!r}",
                             hint=did_you_mean(call.callee.value, ["gpt", "hf"]) or
                             'built-in: gpt(...); Hugging Face: hf("DIR"); your own: "file.py:build"(...)')
                return
            self.s.model = ModelSpec("gpt", self._gpt_args(call))
            if sum(d.is_error for d in self.r.diagnostics) > self._errors_before_model:
                return
        else:
            factory = self._factory(call.callee)
            if factory is None:
                return
            for arg in call.args:
                if arg.key is None:
                    self.r.error(arg.span, "a model factory takes key=value arguments", hint="write name=value")
            self.s.model = ModelSpec("user", self._settings(call, "model"), factory)
        self._size_model(st)

    def _gpt_args(self, call: ast.Call) -> dict:
        given = self.r.keywords(call.args, tuple(GPT_DEFAULTS), "gpt()")
        args = dict(GPT_DEFAULTS)
        limits = {"layers": 100_000, "width": 1 << 20, "heads": 1 << 12, "vocab": 1 << 24,
                  "context": 1 << 24}
        for key, arg in given.items():
            value = self.r.integer(arg.value, f"gpt({key}=)", 1, limits[key])
            if value is not None:
                args[key] = value
                self.span(f"model.{key}", arg.span)
        if args["width"] % args["heads"]:
            at = given.get("heads") or given.get("width")
            self.r.error(at.value.span if at else call.span,
                         f"heads ({args['heads']}) must divide width ({args['width']})",
                         hint=f"e.g. width={args['heads'] * max(1, args['width'] // args['heads'])}")
        return args

    def _hf_model(self, call: ast.Call) -> ModelSpec | None:
        """``hf("DIR", key=value...)``: a Hugging Face model folder and overrides of its config."""
        positional = [a for a in call.args if a.key is None]
        if len(positional) != 1:
            self.r.error(positional[1].span if positional[1:] else call.span,
                         "hf(...) takes one model folder, then key=value overrides",
                         hint='model hf("path/to/model", layers=2)')
            return None
        where = positional[0].value
        name = self.r.string(where, "the model folder")
        args = self._settings(call, "model")
        if ATTENTION_KEY in args and args[ATTENTION_KEY] not in ATTENTION_CHOICES:
            self.r.error(self.s.spans[f"model.{ATTENTION_KEY}"],
                         f"{ATTENTION_KEY} is one of {', '.join(ATTENTION_CHOICES)}")
        if name is None:
            return None
        if not transformers_installed():
            self.r.error(call.callee.span, "model hf(...) needs transformers, which is not installed",
                         hint="pip install 'zdsl[hf]'")
            return None
        try:   # the overrides are checked against the family's config class when sized
            folder = find_folder(name, resolve_relative(".", where.span.file))
            read_config(folder)
        except HfModelError as exc:
            self.r.error(where.span, str(exc), hint=exc.hint)
            return None
        return ModelSpec("hf", args, path=str(folder))

    def _factory(self, callee: ast.Str) -> str | None:
        text = callee.value
        target, sep, func = text.rpartition(":")
        if not sep or not target or not func.isidentifier():
            self.r.error(callee.span, f"model factory {text!r} must be \"file.py:function\" "
                                      "or \"package.module:function\"",
                         hint='e.g. model "my_model.py:build"(hidden=64)')
            return None
        if target.endswith(".py"):
            path = Path(resolve_relative(target, callee.span.file))
            if not path_exists(path, "file"):
                self.r.error(callee.span, f"model file not found: {path}",
                             hint="a model file's path is relative to the schedule file")
                return None
            return f"{path.resolve()}:{func}"
        if not all(part.isidentifier() for part in target.split(".")):
            self.r.error(callee.span, f"{target!r} is neither a .py file nor a module name")
            return None
        return text

    def _size_model(self, st: ast.CallStmt) -> None:
        """The model's units, for the checks that need them (None if unknown)."""
        if sum(d.is_error for d in self.r.diagnostics) > self._errors_before_model:
            return
        try:
            units = (self.units_for or default_units_for)(self.s.model, **python_source.sizing_data(self.s.data))
        except ZsError:
            raise
        except python_source.PythonDataError as exc:   # the data function sizing called broke its contract
            self.r.error(self.s.spans.get("data") or st.call.span, str(exc), hint=exc.hint)
            return
        except HfModelError as exc:    # the runtime checked the config against transformers' class
            self.r.error(self.s.spans.get(f"model.{exc.key}") or st.call.span, str(exc), hint=exc.hint)
            return
        except Exception as exc:   # noqa: BLE001 - a user's factory may raise anything
            self.r.error(st.call.callee.span, f"cannot size the model: {type(exc).__name__}: {exc}")
            return
        if units is not None and not units:
            self.r.error(st.call.span, "the model has no units")
            return
        self.units = list(units) if units is not None else None

    def _data(self, st: ast.CallStmt) -> None:
        self.span("data", st.span)
        spec = self._data_source(st.call, "data")
        if spec is not None:
            self.s.data = spec

    def _data_source(self, call: ast.Call, key: str) -> DataSpec | None:
        """A data source call (``data``'s, ``eval``'s); ``key`` prefixes the spans of its settings."""
        kind = self.r.choice(call.callee, "data source", tuple(DATA_SETTINGS)) \
            if isinstance(call.callee, ast.Name) else None
        if kind is None:
            if isinstance(call.callee, ast.Str):
                self.r.error(call.callee.span, "data is corpus(...), tokens(...), text(...), jsonl(...), "
                                               "synthetic(...) or python(...)",
                             hint=f'write python("{call.callee.value}") for your function'
                                  if ":" in call.callee.value else
                                  f'write corpus("{call.callee.value}") for text, '
                                  f'tokens("{call.callee.value}") for a file of token ids')
            return None
        if kind == "python":
            return self._python_source(call, key)
        if kind == "jsonl":
            return self._jsonl_source(call, key)
        positional = [a for a in call.args if a.key is None]
        keyword = [a for a in call.args if a.key is not None]
        source, source_span = None, call.span
        if kind in ("corpus", "tokens", "text"):
            if not positional:
                self.r.error(call.span, f"{kind} needs a source", hint=DATA_EXAMPLES[kind])
                return None
            source_span = positional[0].value.span
            source = self.r.string(positional[0].value, f"the {kind} file")
            if source is not None and kind == "tokens":
                source = self._tokens_path(source, source_span)
            elif source is not None and kind == "text":
                source = self._text_path(source, source_span)
            elif source is not None and source != "stdlib":
                source = self._corpus_path(source, source_span)
            positional = positional[1:]
        for extra in positional:
            self.r.error(extra.span, f"{kind} takes key=value settings here")
        given = self.r.keywords(keyword, DATA_SETTINGS[kind], f"{kind}()")
        args, dtype, tokenizer = {}, None, None
        for name, arg in given.items():
            if name == "tokenizer":
                self.span(f"{key}.tokenizer", arg.span)
                tokenizer = self._tokenizer(arg.value, args)
                continue
            if name == "dtype":
                dtype = self.r.choice(arg.value, "token dtype", tuple(TOKEN_DTYPES))
                self.span(f"{key}.dtype", arg.span)
                continue
            value = self.r.integer(arg.value, f"{kind}({name}=)", 1, 1 << 24)
            if value is not None:
                args[name] = value
                self.span(f"{key}.{name}", arg.span)
        if kind == "tokens":
            dtype = dtype or ("uint16" if "dtype" not in given else None)
            if source is not None and dtype is not None:
                self._token_counts[key] = self._whole_tokens(source, dtype, source_span)
        if kind == "text" and "tokenizer" not in given:
            self.r.error(call.span, "text needs a tokenizer", hint=DATA_EXAMPLES["text"])
        if kind == "text" and (missing := text_source.tokenizers_missing()):
            self.r.error(call.callee.span, missing)
        return DataSpec(kind, source, args, dtype if kind == "tokens" else None, tokenizer)

    def _settings(self, call: ast.Call, key: str, reserved=(), why: str = "", fix: str = "") -> dict:
        """A call's free-form ``name=value`` settings (passed on to a user's function or a model's
        config), their spans under ``key``; a name set twice or ``reserved`` is an error (``why``,
        ``fix``: its message and hint, ``{name}`` filled in)."""
        args: dict = {}
        for arg in call.args:
            if arg.key is None:
                continue
            name = arg.key.value
            if name in args:
                self.r.error(arg.key.span, f"{name} is set twice")
            elif name in reserved:
                self.r.error(arg.key.span, why.format(name=name), hint=fix.format(name=name))
            else:
                args[name] = self.r.python(arg.value)
                self.span(f"{key}.{name}", arg.span)
        return args

    def _python_source(self, call: ast.Call, key: str) -> DataSpec | None:
        """``python("file.py:batches", k=v...)``: the user's function (found as zdsl/python_source.py
        says), its settings passed to it as keyword arguments."""
        positional = [a for a in call.args if a.key is None]
        if not positional:
            self.r.error(call.span, "python needs the function that makes batches", hint=DATA_EXAMPLES["python"])
            return None
        for extra in positional[1:]:
            self.r.error(extra.span, "python takes key=value settings after the function",
                         hint=DATA_EXAMPLES["python"])
        args = self._settings(call, key, reserved=python_source.CALL_ARGS,
                              why="zdsl passes {name} to the function itself",
                              fix=f"remove {{name}}=; the function is called with "
                                  f"{', '.join(python_source.CALL_ARGS)} and the settings written here")
        where = positional[0].value
        target = self.r.string(where, "the data function")
        if target is None:
            return None
        try:
            source = python_source.resolve(target, where.span.file)
        except python_source.PythonDataError as exc:
            self.r.error(where.span, str(exc), hint=exc.hint)
            return None
        return DataSpec("python", source, args)

    def _jsonl_source(self, call: ast.Call, key: str) -> DataSpec | None:
        """``jsonl("FILE", tokenizer=..., prompt=, response=, pack=, context=)``: the file is read here as
        the runtime reads it (zdsl/jsonl_source.py), so a bad line is an error before any rank starts."""
        positional = [a for a in call.args if a.key is None]
        if not positional:
            self.r.error(call.span, "jsonl needs a file", hint=DATA_EXAMPLES["jsonl"])
            return None
        for extra in positional[1:]:
            self.r.error(extra.span, "jsonl takes key=value settings after the file", hint=DATA_EXAMPLES["jsonl"])
        given = self.r.keywords([a for a in call.args if a.key is not None], DATA_SETTINGS["jsonl"], "jsonl()")
        args, tokenizer = dict(jsonl_source.DEFAULTS), None
        for name, arg in given.items():
            self.span(f"{key}.{name}", arg.span)
            if name == "tokenizer":
                tokenizer = self._tokenizer(arg.value, args)
            elif name == "pack":
                args[name] = self.r.boolean(arg.value, "jsonl(pack=)")
            elif name in ("prompt", "response"):
                args[name] = self.r.string(arg.value, f"the {name}'s field name")
            else:
                args[name] = self.r.integer(arg.value, f"jsonl({name}=)", 1, 1 << 24)
        if "tokenizer" not in given:
            self.r.error(call.span, "jsonl needs a tokenizer", hint=DATA_EXAMPLES["jsonl"])
        elif missing := text_source.tokenizers_missing("jsonl"):
            self.r.error(call.callee.span, missing)
        if args["prompt"] is not None and args["prompt"] == args["response"]:
            self.r.error(given["response"].span if "response" in given else call.span,
                         f'prompt and response both name the field "{args["prompt"]}"',
                         hint='jsonl("FILE", ..., prompt="question", response="answer")')
            return None
        where = positional[0].value
        source = self.r.string(where, "the jsonl file")
        if source is None or tokenizer is None or None in args.values():
            return None
        path = Path(resolve_relative(source, where.span.file)).expanduser()
        if not path.is_file():
            self.r.error(where.span, f"jsonl not found: {path}" if not path_exists(path) else f"{path} is not a file",
                         hint="a file of one JSON object per line, relative to the schedule's folder")
            return None
        try:
            jsonl_source.check_jsonl(path, args["prompt"], args["response"])
        except jsonl_source.JsonlSourceError as exc:
            self.r.error(where.span, str(exc), hint=f'each line one JSON object with string fields '
                                                    f'"{args["prompt"]}" and "{args["response"]}"')
            return None
        return DataSpec("jsonl", str(path.resolve()), args, None, tokenizer)

    def _text_path(self, source: str, span: Span) -> str | None:
        """A text file, or a folder holding at least one (zdsl/text_source.py's rule), or "stdlib"."""
        if source == text_source.STDLIB:
            return source
        path = Path(resolve_relative(source, span.file)).expanduser()
        if not path_exists(path):
            self.r.error(span, f"text not found: {path}",
                         hint="a text file or a folder of them, relative to the schedule's folder")
            return None
        if not text_source.text_files(path):
            self.r.error(span, f"no text files in {path}" if path.is_dir() else f"{path} is not a text file",
                         hint="text files are the regular files that hold no NUL byte; names starting "
                              "with . are skipped")
            return None
        return str(path.resolve())

    def _tokenizer(self, value, args: dict) -> str | None:
        """tokenizer="tokenizer.json" or an HF model folder: it must parse, and have an end-of-text
        token; its id count becomes the data's vocab."""
        given = self.r.string(value, "the tokenizer")
        if given is None:
            return None
        path = Path(resolve_relative(given, value.span.file)).expanduser()
        try:
            file = text_source.tokenizer_file(path)
            data = text_source.tokenizer_json(file)
            text_source.end_of_text(file, data)
        except text_source.TextSourceError as exc:
            self.r.error(value.span, str(exc), hint='a tokenizer.json file, or a Hugging Face model folder '
                                                    'holding one')
            return None
        args["vocab"] = text_source.id_count(data)
        return str(path.resolve())

    def _corpus_path(self, source: str, span: Span) -> str | None:
        here = Path(resolve_relative(source, span.file))
        for candidate in (here, Path(source)):
            if path_exists(candidate):
                return str(candidate.resolve())
        self.r.error(span, f"corpus not found: {source}",
                     hint='a path relative to the schedule file, or "stdlib"')
        return None

    def _tokens_path(self, source: str, span: Span) -> str | None:
        path = Path(resolve_relative(source, span.file)).expanduser()
        if path_exists(path, "file") and os.access(path, os.R_OK):
            return str(path.resolve())
        why = "is a folder, not a file" if path_exists(path) and path.is_dir() \
            else "cannot be read" if path_exists(path) else "not found"
        self.r.error(span, f"token file {why}: {path}",
                     hint="a path relative to the schedule's folder to a flat file of token ids "
                          "(nanoGPT's prepare.py writes train.bin)")
        return None

    def _whole_tokens(self, path: str, dtype: str, span: Span) -> int | None:
        """The file's token count; an error where its size is not a whole number of tokens."""
        size, width = os.path.getsize(path), TOKEN_DTYPES[dtype]
        if size == 0:
            self.r.error(span, f"token file {path} is empty (0 bytes)",
                         hint="regenerate it (nanoGPT: python prepare.py)")
            return None
        if size % width:
            other = [d for d, w in TOKEN_DTYPES.items() if size % w == 0 and d != dtype]
            self.r.error(span, f"token file {path} holds {size} bytes, not a whole number of {dtype} "
                               f"tokens ({width} bytes each)",
                         hint=(f"is it dtype={other[0]}? " if other else "")
                              + "a file cut short by an interrupted write ends in part of a token")
            return None
        return size // width

    def _tokens_long_enough(self, key: str = "data") -> None:
        """A window is context+1 tokens: the file must hold at least one."""
        data, count = self._source(key), self._token_counts.get(key)
        context = data.args.get("context")
        if data.kind != "tokens" or count is None or context is None or count >= context + 1:
            return
        self.r.error(self.s.spans.get(f"{key}.context") or self.s.spans.get(key),
                     f"token file {data.source} holds {count} tokens; context={context} needs at "
                     f"least {context + 1} (a window of context+1 tokens)",
                     hint=f"a shorter context (at most {count - 1}) or a longer file")

    def _train(self, st: ast.TrainStmt) -> None:
        self.span("train", st.span)
        given = self.r.keywords(st.args, ("steps", "batch", "accumulate", "precision", "seed"),
                                "train")
        t = TrainSpec()
        ranges = {"steps": (1, 10 ** 9), "batch": (1, 10 ** 6), "accumulate": (1, 10 ** 6),
                  "seed": (0, 2 ** 63 - 1)}
        for key, arg in given.items():
            self.span(f"train.{key}", arg.span)
            if key == "precision":
                value = self.r.choice(arg.value, "precision", PRECISIONS)
            else:
                value = self.r.integer(arg.value, key, *ranges[key])
            if value is not None:
                setattr(t, key, value)
        self.s.train = t

    def _optimizer(self, st: ast.CallStmt) -> None:
        self.span("optimizer", st.span)
        call = st.call
        kind = self.r.choice(call.callee, "optimizer", tuple(OPTIMIZERS))
        if kind is None:
            return
        given = self.r.keywords(call.args, OPTIMIZERS[kind], f"{kind}()")
        o = OptimizerSpec(kind=kind)
        for key, arg in given.items():
            self.span(f"optimizer.{key}", arg.span)
            v = arg.value
            if key == "lr":
                value = self.r.real(v, "lr", 0.0, None, lo_open=True)
            elif key == "eps":
                value = self.r.real(v, "eps", 0.0, None, lo_open=True)
            elif key == "weight_decay":
                value = self.r.real(v, "weight_decay", 0.0, None)
            elif key == "momentum":
                value = self.r.real(v, "momentum", 0.0, 1.0, hi_open=True)
            elif key == "clip":
                if isinstance(v, ast.Name) and v.value == "none":
                    continue
                value = self.r.real(v, "clip", 0.0, None, lo_open=True)
            elif key in ("warmup", "decay_steps"):
                value = self.r.integer(v, key, 0 if key == "warmup" else 1, 10 ** 9)
            elif key == "decay":
                value = self.r.choice(v, "decay", DECAYS)
            elif key == "min_lr":
                value = self.r.real(v, "min_lr", 0.0, None)
            elif key == "no_decay":
                self._no_decay(v, o)
                continue
            else:   # betas
                value = self._betas(v)
            if value is not None:
                setattr(o, key, value)
        self._lr_schedule(o, given)
        if "no_decay" in given and o.weight_decay == 0:
            self.r.warn(given["no_decay"].span, "no_decay has no effect: no parameter decays without "
                                                "weight_decay", hint="add e.g. weight_decay=0.1")
        self.s.optimizer = o

    def _lr_schedule(self, o: OptimizerSpec, given: dict) -> None:
        """The rate schedule's values against each other and the training steps (zdsl/lr.py)."""
        steps = self.s.train.steps
        if "min_lr" in given and o.min_lr > o.lr:
            self.r.error(given["min_lr"].value.span, f"min_lr {o.min_lr:g} is above lr {o.lr:g}",
                         hint="the rate decays from lr down to min_lr")
        for key in ("min_lr", "decay_steps"):
            if key in given and o.decay == "constant":
                self.r.error(given[key].value.span, f"{key} has no effect with decay=constant",
                             hint="add decay=cosine or decay=linear, or remove it")
        if o.warmup > steps:    # torchtitan warns and warms up over the whole run
            self.r.warn(given["warmup"].value.span, f"warmup {o.warmup} is longer than the {steps} "
                        f"training steps: the rate warms up over all {steps} and never decays",
                        hint=f"warmup={steps // 10 or 1}")
        elif o.decay_steps is not None and o.warmup + o.decay_steps > steps:
            self.r.error(given["decay_steps"].value.span, f"warmup {o.warmup} plus decay_steps "
                         f"{o.decay_steps} is more than the {steps} training steps",
                         hint=f"decay_steps={steps - o.warmup}" if steps > o.warmup else "lower warmup")

    def _no_decay(self, v, o: OptimizerSpec) -> None:
        """``no_decay=(biases, norms, "*.glob")``: classes by name, parameter names by glob."""
        items = v.items if isinstance(v, ast.Tuple) else [v]
        classes, globs = [], []
        for item in items:
            if isinstance(item, ast.Str) and item.value:
                globs.append(item.value)
            elif isinstance(item, ast.Name) and item.value in NO_DECAY_CLASSES:
                classes.append(item.value)
            else:
                self.r.error(item.span, f"no_decay takes {', '.join(NO_DECAY_CLASSES)} or a quoted "
                             f"name glob, not {describe(item)}",
                             hint=did_you_mean(describe(item), NO_DECAY_CLASSES, what="a class is one of")
                             or 'e.g. no_decay=(biases, norms) or no_decay="*.bias"')
        o.no_decay, o.no_decay_names = tuple(dict.fromkeys(classes)), tuple(dict.fromkeys(globs))

    def _betas(self, v) -> tuple[float, float] | None:
        if not isinstance(v, ast.Tuple) or len(v.items) != 2:
            self.r.error(v.span, f"betas must be two numbers, not {describe(v)}",
                         hint="betas=(0.9, 0.999)")
            return None
        b = [self.r.real(x, "a beta", 0.0, 1.0, hi_open=True) for x in v.items]
        return None if None in b else (b[0], b[1])

    def _ranks(self, st: ast.RanksStmt) -> None:
        self.span("ranks", st.span)
        n = self.r.integer(st.count, "ranks", 1, MAX_RANKS)
        if n is not None:
            self.s.ranks = n
        if st.device is not None:
            device = self.r.choice(st.device, "device", DEVICES)
            if device is not None:
                self.s.device = device
                self.span("device", st.device.span)

    def _machine(self, st: ast.CallStmt) -> None:
        self.span("machine", st.span)
        call = st.call
        base = self.r.choice(call.callee, "machine", ("cpu", "cuda"))
        if base is None:
            return
        profile = MachineProfile(**{**vars(CUDA_PROFILE if base == "cuda" else CPU_PROFILE)})
        given = self.r.keywords(call.args, MACHINE_KEYS, f"machine {base}")
        for key, arg in given.items():
            # rates must be > 0; a fixed cost per op may be 0, cores 0 turns sharing off, and
            # the per-collective and host rates 0 mean "derived from the others"
            if key == "comm_slots":     # a count of the backend's threads, not a rate
                value = self.r.integer(arg.value, key, 1, 1024)
            elif key in ("disk_ranks", "compute_ranks"):   # a count of ranks; 0: unknown
                value = self.r.integer(arg.value, key, 0, MAX_RANKS)
            elif key in MACHINE_TUPLES:
                value = self._machine_tuple(arg.value, key)
            elif key == "comm_under_load":  # a share of a collective's rate
                value = self.r.real(arg.value, key, 0.0, 1.0)
            else:
                value = self.r.real(arg.value, key, 0.0, None, lo_open=key not in MACHINE_MAY_BE_ZERO)
            if value is not None:
                setattr(profile, MACHINE_FIELDS[key], value)
                self.span(f"machine.{key}", arg.span)
        self._machine_tables(profile, given)
        self.s.machine = profile

    def _machine_tuple(self, v, key: str) -> tuple[float, ...] | None:
        """``flops_widths=(64, 512, 2048)``, ``flops_bf16=(...)``: numbers > 0 (one: a 1-tuple)."""
        items = v.items if isinstance(v, ast.Tuple) else [v]
        values = [self.r.real(x, f"each of {key}", 0.0, None, lo_open=True) for x in items]
        return None if None in values else tuple(values)

    def _machine_tables(self, profile: MachineProfile, given: dict) -> None:
        """The per-precision rates have one number per ``flops_widths``, which increase."""
        widths = profile.flops_widths
        if "flops_widths" in given and any(b <= a for a, b in zip(widths, widths[1:])):
            self.r.error(given["flops_widths"].value.span, "flops_widths must increase, "
                         f"not {', '.join(f'{w:g}' for w in widths)}", hint="flops_widths=(64, 512, 2048)")
        for key in MACHINE_TUPLES[1:]:
            rates = getattr(profile, key)
            if key in given and rates and len(rates) != len(widths):
                self.r.error(given[key].value.span,
                             f"{key} has {len(rates)} rate(s) for {len(widths)} flops_widths: one per width",
                             hint=f"flops_widths=(64, 512), {key}=(7e10, 2e11)")

    def _checkpoint(self, st: ast.CheckpointStmt) -> None:
        self.span("checkpoint", st.span)
        every = self.r.integer(st.every, "checkpoint interval", 1, 10 ** 9)
        directory = self.r.string(st.dir, "the checkpoint folder")
        keep = 0 if st.keep is None else self.r.integer(st.keep, "keep", 0, 10 ** 6)
        if None not in (every, directory, keep):
            self.s.checkpoint = CheckpointSpec(every, directory, keep)

    def _freeze(self, st: ast.FreezeStmt) -> None:
        self.span("freeze", st.span)
        globs = tuple(dict.fromkeys(p.value for p in st.patterns if p.value))
        for p in st.patterns:
            if not p.value:
                self.r.error(p.span, "an empty freeze pattern", hint='e.g. freeze embed*, "*.bias"')
        if self.units is not None:      # else sized later, by the runtime, which checks again
            try:
                frozen_params(self.units, globs)
            except FreezeError as exc:
                at = next((p.span for p in st.patterns if p.value == exc.glob), st.span)
                self.r.error(at, str(exc), hint=exc.hint)
                return
        self.s.freeze = globs

    def _eval(self, st: ast.EvalStmt) -> None:
        self.span("eval", st.span)
        every = self.r.integer(st.every, "eval interval", 1, 10 ** 9)
        batches = 1 if st.batches is None else self.r.integer(st.batches, "eval batches", 1, 10 ** 6)
        self.span("eval.data", st.source.span)
        data = self._data_source(st.source, "eval.data")
        if None not in (every, batches, data):
            self.s.eval = EvalSpec(every, data, batches)

    # -- rules across statements -----------------------------------------------

    def _source(self, key: str) -> DataSpec:
        """The data source ``key`` names: "data" (training) or "eval.data"."""
        return self.s.data if key == "data" else self.s.eval.data

    def _user_model_data(self, key: str = "data") -> None:
        """zdsl cannot see a user model's context or vocab, so the data must state them."""
        data, spans = self._source(key), self.s.spans
        needed = ("context",) if data.kind in ("corpus", "text", "jsonl") else ("context", "vocab")
        missing = [k for k in needed if k not in data.args]
        if missing:
            at = spans.get(key) or spans["model"]
            example = DATA_EXAMPLES[data.kind].replace(")", ", vocab=256)") if data.kind == "tokens" \
                else DATA_EXAMPLES[data.kind]
            self.r.error(at, f"with your own model the data must give its {' and '.join(missing)}",
                         hint=f"data {example}")

    def _data_fits(self, ctx: int, vocab: int, call: str, key: str = "data") -> None:
        """The data's context and vocab default to the model's and must fit in them (``call``:
        the model statement's opening, for the hints)."""
        data = self._source(key)
        data.args.setdefault("context", ctx)
        if data.kind in ("synthetic", "tokens"):
            data.args.setdefault("vocab", vocab)
        at = self.s.spans.get(f"{key}.context") or self.s.spans.get(key)
        if data.args["context"] > ctx:
            self.r.error(at, f"data context {data.args['context']} is longer than the "
                             f"model's context {ctx}",
                         hint=f"model {call}context={data.args['context']}) or a shorter data context")
        if data.kind in ("text", "jsonl") and data.args.get("vocab", 0) > vocab:
            self.r.error(self.s.spans.get(f"{key}.tokenizer") or at,
                         f"the tokenizer {data.tokenizer} produces ids up to {data.args['vocab'] - 1} "
                         f"({data.args['vocab']} ids) but the model's vocab is {vocab}",
                         hint=f"model {call}vocab={data.args['vocab']}) or a tokenizer made for this model")
        if data.kind in ("synthetic", "tokens") and data.args["vocab"] > vocab:
            self.r.error(self.s.spans.get(f"{key}.vocab") or at,
                         f"data vocab {data.args['vocab']} is larger than the model's vocab {vocab}")
        if data.kind == "corpus" and vocab < 256:
            self.r.error(self.s.spans.get("model.vocab") or self.s.spans.get("model"),
                         f"corpus data is byte-level (256 tokens) but the model's vocab is {vocab}",
                         hint=f"model {call}vocab=256)")

    def _data_fits_model(self, key: str) -> None:
        """The data source ``key`` against the model's context and vocab."""
        model = self.s.model
        if self._source(key).kind == "python":       # its tensors are seen when the function is called
            return
        if model.kind == "gpt" and self.units is not None:
            self._data_fits(model.args.get("context"), model.args.get("vocab"), "gpt(", key)
        if model.kind == "hf" and model.path is not None:
            sizes = model_sizes(Path(model.path), model.args)
            if None in sizes.values():
                self._user_model_data(key)
            else:
                self._data_fits(sizes["context"], sizes["vocab"], 'hf(..., ', key)
        if model.kind == "user" and "model" in self.s.spans:
            self._user_model_data(key)

    def _cross_checks(self, by_key) -> None:
        s = self.s
        if "machine" not in by_key and s.device == "cuda":
            s.machine = MachineProfile(**vars(CUDA_PROFILE))
        for key in ("data", "eval.data") if s.eval is not None else ("data",):
            if key == "eval.data" and "context" in s.data.args \
                    and "python" not in (s.data.kind, s.eval.data.kind):   # evaluated as it trains, unless told
                s.eval.data.args.setdefault("context", s.data.args["context"])
            self._data_fits_model(key)
            self._tokens_long_enough(key)
        if s.persist_below and s.stage < 3 and "persist" in s.spans:
            self.r.warn(s.spans["persist"], "persist has an effect only with zero 3 "
                                            "(parameters are not sharded here)")
        if "prefetch" in s.spans and s.stage < 3 and s.placed("optimizer").tier != "nvme" \
                and s.prefetch > 1:
            self.r.warn(s.spans["prefetch"], "prefetch has no effect here: parameters are "
                                             "gathered only at zero 3",
                        hint="add `zero 3`, or remove prefetch")


def _in_reading_order(diagnostics: list[Diagnostic], main_file: str) -> list[Diagnostic]:
    """Errors first, each kind top to bottom (the main file before included ones and
    overrides); a note stays right after the error it explains."""
    keyed, last = [], (0, (0, 0, 0), 0)
    for i, d in enumerate(diagnostics):
        if d.severity == NOTE:
            keyed.append((last + (1,), d))
            continue
        s = d.span
        where = (False, 0, 0) if s is None else (s.file != main_file, s.line, s.column)
        last = (0 if d.is_error else 1, where, i)
        keyed.append((last + (0,), d))
    return [d for _, d in sorted(keyed, key=lambda kd: kd[0])]


def _where(span: Span) -> str:
    return f"{span.file}:{span.line}:{span.column}"
