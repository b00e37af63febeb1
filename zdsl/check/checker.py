"""The checker: syntax tree to a typed, complete :class:`~zdsl.schedule.Schedule`.

It reads each statement's values (types, ranges, names), fills defaults,
resolves what needs the model (``recompute blocks`` -> unit indices), and
applies the rules ZeRO and DeepSpeed impose (sharding is a prefix of
optimizer, gradients, parameters; parameters are offloaded only at stage 3;
...). Every problem becomes a positioned diagnostic; all of a file's errors
are reported at once. The span of each statement is kept in
``Schedule.spans`` under its keyword (``prefetch``, ``offload.parameters``,
``memory.device``, ``train.steps``, ...) so later stages can point at it.

This module reads the statements in order and applies the rules across them; each
statement's own check lives with its concept: ``model``, ``data`` (with the sources of
``zdsl/sources/``), ``training``, ``machine``, ``placement`` and ``pipelines``, all
filling one :class:`~zdsl.check.draft.Draft`. A schedule may leave ``model`` and ``data`` to the
user's own loop (``loop.py``).

Public API: :func:`load_schedule` and :func:`check_text`.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from zdsl.check.data import DataChecks
from zdsl.check.draft import Draft, where
from zdsl.check.hierarchy import check_hierarchy, check_per_node, check_secondary
from zdsl.check.machine import check_link, check_machine, check_ranks, machine_for_device
from zdsl.check.model import UnitsFor, check_freeze, check_loop_model, check_model, default_units_for
from zdsl.check.pipelines import check_pipeline, check_pipelines_complete
from zdsl.check.placement import PlacementChecks
from zdsl.check.training import check_checkpoint, check_optimizer, check_train
from zdsl.check.values import Reader
from zdsl.lang import ast
from zdsl.lang.errors import NOTE, Diagnostic, ZsError, attach_sources, error, note
from zdsl.lang.include import expand_includes
from zdsl.lang.overrides import apply_overrides
from zdsl.lang.parse import parse_text, read_source
from zdsl.schedule import DataSpec, Schedule

# data before model: a model built to be sized takes python(...) data's tensors
STATEMENT_ORDER = ("schedule", "data", "model", "train", "optimizer", "ranks", "machine", "link", "zero",
                   "shard", "secondary", "offload", "prefetch", "bucket", "overlap", "recompute", "persist",
                   "memory", "checkpoint", "freeze", "eval")


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
    """Parse and check schedule ``text`` as if read from ``file``; ``units_for`` sizes the model
    (default: the built-in GPT only)."""
    def run():
        program = parse_text(text, file)
        return check_program(program, overrides or {}, units_for or default_units_for)
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


def check_program(program: ast.Program, overrides: dict[str, str],
                  units_for: UnitsFor) -> tuple[Schedule, list[Diagnostic]]:
    """The schedule ``program`` describes and its warnings; :class:`ZsError` with every error."""
    sources = {program.file: program.source}
    try:
        statements = expand_includes(program, sources)
        statements = apply_overrides(statements, overrides, sources)
    except ZsError as exc:
        attach_sources(exc.diagnostics, sources)
        raise
    draft = Draft(Schedule(name=_name_of(program.file), file=program.file), Reader())
    by_key = _by_keyword(statements, draft.report)
    data = DataChecks(draft)
    checks = _statement_checks(draft, data, units_for)
    if "data" not in by_key:
        draft.schedule.data = DataSpec("fed")       # the batches come from the user's loop
    for keyword in STATEMENT_ORDER:
        if keyword == "model" and "model" not in by_key:
            check_loop_model(draft, units_for)      # the model comes from the user's loop
        if keyword == "shard" and "shard" in by_key:     # several `shard ... over` statements are one sharding
            checks[keyword](by_key[keyword])
            continue
        for stmt in by_key.get(keyword, []):
            checks[keyword](stmt)
    check_hierarchy(draft)
    machine_for_device(draft, "machine" in by_key)
    data.against_model()
    _placement_warnings(draft)
    pipelines = [s for s in by_key.get("pipeline", []) if isinstance(s, ast.PipelineStmt)]
    for stmt in pipelines:
        check_pipeline(draft, stmt)
    if pipelines:
        check_pipelines_complete(draft, pipelines)
    diagnostics = draft.report.diagnostics
    attach_sources(diagnostics, sources)
    if draft.report.failed:
        raise ZsError(_in_reading_order(diagnostics, program.file))
    return draft.schedule, _in_reading_order([d for d in diagnostics if d.severity != NOTE], program.file)


def _name_of(file: str) -> str:
    """The schedule's name where it has no ``schedule`` statement: its file's stem."""
    name = re.sub(r"\W", "_", Path(file).stem) if not file.startswith("<") else "schedule"
    return name if name.isidentifier() else "_" + name


def _statement_checks(draft: Draft, data: DataChecks, units_for: UnitsFor) -> dict[str, Callable]:
    """Keyword -> the check that reads such a statement into ``draft``."""
    placement = PlacementChecks(draft)
    return {"schedule": lambda st: _schedule(draft, st), "data": data.check_data,
            "model": lambda st: check_model(draft, st, units_for),
            "train": lambda st: check_train(draft, st), "optimizer": lambda st: check_optimizer(draft, st),
            "ranks": lambda st: _ranks(draft, st),
            "machine": lambda st: check_machine(draft, st), "link": lambda st: check_link(draft, st),
            "shard": placement._shards,
            "secondary": lambda st: check_secondary(draft, st),
            **{k: getattr(placement, f"_{k}") for k in ("zero", "offload", "prefetch", "bucket",
                                                        "overlap", "recompute", "persist", "memory")},
            "checkpoint": lambda st: check_checkpoint(draft, st), "freeze": lambda st: check_freeze(draft, st),
            "eval": data.check_eval}


def _ranks(draft: Draft, st: ast.RanksStmt) -> None:
    check_ranks(draft, st)
    check_per_node(draft, st)


def _by_keyword(statements: list[ast.Stmt], report: Reader) -> dict[str, list[ast.Stmt]]:
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
            if _more_groups(stmt, by_key.get("shard", []), seen.get(key)):
                by_key["shard"].append(stmt)     # a state sharded over another group
                continue
        elif isinstance(stmt, ast.PipelineStmt):
            key = f"pipeline.{stmt.keyword}"
        if key in seen and key not in ("memory", "link"):     # several, each of its own tiers (levels)
            first = seen[key]
            what = "sharding" if key == "zero" else \
                f"the {stmt.keyword} pipeline" if group == "pipeline" else f"`{key}`"
            report.error(stmt.key_span, f"{what} is set twice",
                         hint=f"the first is at {where(first.key_span)}; keep one")
            if key not in noted:
                noted.add(key)
                report.diagnostics.append(note(first.key_span, f"{what} first set here"))
            continue
        seen[key] = stmt
        by_key.setdefault(group, []).append(stmt)
    return by_key


def _more_groups(stmt: ast.Stmt, shards: list[ast.Stmt], first: ast.Stmt | None) -> bool:
    """A second ``shard ... over`` statement after others that all say ``over`` (and no ``zero``):
    the states each names are sharded over its group."""
    def over(s: ast.Stmt) -> bool:
        return isinstance(s, ast.ShardStmt) and s.over is not None
    return first is not None and over(stmt) and bool(shards) and first is shards[0] and all(map(over, shards))


def _schedule(draft: Draft, st: ast.ScheduleStmt) -> None:
    draft.schedule.name = st.name.value
    draft.schedule.description = st.description.value if st.description else ""
    draft.span("schedule", st.span)


def _placement_warnings(draft: Draft) -> None:
    """Placement settings that the sharding makes pointless."""
    s = draft.schedule
    if s.persist_below and s.stage < 3 and "persist" in s.spans:
        draft.report.warn(s.spans["persist"],
                          "persist has an effect only with zero 3 (parameters are not sharded here)")
    if "prefetch" in s.spans and s.stage < 3 and s.placed("optimizer").tier != "nvme" and s.prefetch > 1:
        draft.report.warn(s.spans["prefetch"], "prefetch has no effect here: parameters are gathered only at zero 3",
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
        at = (False, 0, 0) if s is None else (s.file != main_file, s.line, s.column)
        last = (0 if d.is_error else 1, at, i)
        keyed.append((last + (0,), d))
    return [d for _, d in sorted(keyed, key=lambda kd: kd[0])]
