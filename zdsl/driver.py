"""The compiler pipeline: a .zs file to a checked, verified and simulated task graph.

Every command that needs a graph (``check``, ``plan``, ``run``, ``tune``, ``calibrate``, the
benchmarks) calls :func:`compile_file`; it reads top-down as the steps it chains:

1. **load** (:mod:`zdsl.lang` parses, :mod:`zdsl.check` checks): the file to a ``Schedule``;
2. **size** (:mod:`zdsl.compile.models`): the model to its units, on the meta device;
3. **lower** (:mod:`zdsl.compile.lower`): policies to explicit pipelines;
4. **instantiate** (:mod:`zdsl.compile.instantiate`): pipelines times units to a ``TaskGraph``;
5. **verify** (:mod:`zdsl.compile.verify`): races, deadlocks and memory, simulating the step
   with :mod:`zdsl.planner` once; the simulation is kept for the plan;
6. **evaluation** (:mod:`zdsl.compile.eval_graph`), for a schedule with ``eval``: the forward
   phase alone, sized at the eval data's context, instantiated and verified the same way.

Contract: never raises for a bad schedule or model. Everything wrong is a positioned
diagnostic in the returned :class:`Compiled`, which is carried as far as it would go.
No torch is imported here (a user's model factory may import it when sized). The checker (lark)
and the compiler are imported by the steps that use them: ``zdsl.cli`` imports this module for
every command, most of which compile nothing.
"""
from __future__ import annotations

import contextlib
import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from zdsl.lang.errors import Diagnostic, UsageError, ZsError, attach_sources, capped, more_line, render
from zdsl.sim.profile_cache import calibrated_for

if TYPE_CHECKING:
    from zdsl.ir import TaskGraph
    from zdsl.model.units import UnitSpec
    from zdsl.schedule import DataSpec, ModelSpec, Schedule
    from zdsl.sim.simulate import Simulation

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


@dataclass
class Compiled:
    """A schedule carried as far through the compiler as it would go."""
    path: str
    diagnostics: list[Diagnostic] = field(default_factory=list)
    schedule: Schedule | None = None
    units: list[UnitSpec] | None = None
    graph: TaskGraph | None = None
    sim: Simulation | None = None
    eval_graph: TaskGraph | None = None      # the forward-only graph of one eval batch (``eval`` statement)
    eval_sim: Simulation | None = None
    usage_error: bool = False

    @property
    def ok(self) -> bool:
        return not any(d.severity == "error" for d in self.diagnostics)

    @property
    def model_from_loop(self) -> bool:
        """Checked, but no graph: the schedule has no model statement and nothing sized the module
        the user's loop gives (``zdsl.initialize``'s ``model=``; ``zdsl plan --model``)."""
        return self.schedule is not None and self.schedule.model.kind == "loop" and self.units is None


def compile_file(path: str, overrides: dict[str, str] | None, units_for=None,
                 simulate: bool = True) -> Compiled:
    """Load, size, lower, instantiate and verify one .zs file; collect every diagnostic.
    ``simulate=False`` skips the step simulation when no memory budget needs it."""
    with gc_paused():
        return _compile(path, overrides, units_for or memo_units_for(), simulate)


def _compile(path: str, overrides: dict[str, str] | None, units_for, simulate: bool) -> Compiled:
    return compile_loaded(load(path, overrides, units_for), units_for, simulate)


def compile_loaded(out: Compiled, units_for, simulate: bool = True) -> Compiled:
    """Steps 2 to 6 of ``load``'s result, in place: for a caller that completes the schedule between
    (the Python API records the row of a fed batch, ``runtime/api/deferred.py``)."""
    from zdsl.compile.verify import findings, to_diagnostic  # light CLI start
    if out.ok and size(out, units_for) and instantiate_graph(out):
        assert out.schedule is not None and out.graph is not None, "set by load and instantiate_graph"
        found, out.sim = findings(out.graph, out.schedule, want_sim=simulate)
        out.diagnostics.extend(to_diagnostic(f) for f in found)
        if out.ok and out.schedule.eval is not None:
            evaluation_graph(out, units_for, simulate)
    return out


def load(path: str, overrides: dict[str, str] | None, units_for=None) -> Compiled:
    """Step 1: read, parse and check; ``schedule`` is set when nothing stopped the check."""
    from zdsl.check.checker import load_schedule  # light CLI start
    out = Compiled(path)
    try:
        out.schedule, diags = load_schedule(path, overrides, units_for or memo_units_for())
    except UsageError as exc:
        out.diagnostics, out.usage_error = exc.diagnostics, True
    except ZsError as exc:
        out.diagnostics = exc.diagnostics
    else:
        out.diagnostics = list(diags)
        calibrated = calibrated_for(out.schedule) if out.ok else None
        if calibrated is not None:               # no machine statement: this machine's measured rates
            out.schedule.machine = calibrated
    return out


def size(out: Compiled, units_for) -> bool:
    """Step 2: the model's units (sizes, flops, activations) at the schedule's context."""
    from zdsl.compile.models import ModelSizingError, run_context  # light CLI start
    from zdsl.sources import sizing_data
    from zdsl.sources.python import PythonDataError
    schedule = out.schedule
    assert schedule is not None, "size follows a load that checked"
    model_span = schedule.spans.get("model")
    try:
        out.units = units_for(schedule.model, run_context(schedule), **sizing_data(schedule.data))
    except ModelSizingError as exc:
        out.diagnostics.append(Diagnostic("error", model_span, str(exc)))
        return False
    except PythonDataError as exc:            # the data function sizing called broke its contract
        out.diagnostics.append(Diagnostic("error", schedule.spans.get("data") or model_span, str(exc)))
        return False
    except Exception as exc:                  # a user's model factory that fails to build
        out.diagnostics.append(Diagnostic("error", model_span, f"cannot size the model: "
                                          f"{type(exc).__name__}: {exc}"))
        return False
    return out.units is not None              # None: the user's loop gives the model (model_from_loop)


def instantiate_graph(out: Compiled) -> bool:
    """Steps 3 and 4: lower the policies and instantiate them for every unit."""
    from zdsl.compile.instantiate import LoweringError  # light CLI start
    try:
        out.graph = compile_schedule(out.schedule, out.units)
    except LoweringError as exc:
        out.diagnostics.append(Diagnostic("error", exc.span, str(exc), exc.hint))
        return False
    except ZsError as exc:
        out.diagnostics.extend(exc.diagnostics)
        return False
    return True


def evaluation_graph(out: Compiled, units_for, simulate: bool = True) -> bool:
    """Step 6: the forward-only graph ``eval`` runs, from the same lowered pipelines, its units
    sized at the eval data's context; verified, its findings added to the diagnostics."""
    from zdsl.compile.eval_graph import eval_context, eval_findings  # light CLI start
    from zdsl.compile.instantiate import LoweringError
    from zdsl.compile.models import ModelSizingError
    from zdsl.compile.verify import to_diagnostic
    from zdsl.sources import sizing_data
    from zdsl.sources.python import PythonDataError
    schedule, train = out.schedule, out.graph
    assert schedule is not None and schedule.eval is not None and train is not None, \
        "compile_loaded builds the evaluation after the step graph, for a schedule with eval"
    span = schedule.spans.get("eval.data") or schedule.spans.get("eval")
    try:
        units = units_for(schedule.model, eval_context(schedule), **sizing_data(schedule.eval.data))
    except (ModelSizingError, PythonDataError) as exc:
        out.diagnostics.append(Diagnostic("error", span, f"cannot size the model for evaluation: {exc}"))
        return False
    except Exception as exc:                  # a user's model factory that fails at this context
        out.diagnostics.append(Diagnostic("error", span, f"cannot size the model for evaluation: "
                                                         f"{type(exc).__name__}: {exc}"))
        return False
    try:
        out.eval_graph = compile_eval(schedule, units)
    except LoweringError as exc:
        out.diagnostics.append(Diagnostic("error", exc.span or span, str(exc), exc.hint))
        return False
    found, out.eval_sim = eval_findings(train, out.eval_graph, schedule, want_sim=simulate)
    out.diagnostics.extend(to_diagnostic(f) for f in found)
    return out.ok


def compile_eval(schedule, units):
    """A checked schedule with ``eval`` and its model's units at the eval context to the
    forward-only graph of one eval batch (for callers that hold a ``Schedule``: tests)."""
    from zdsl.compile.eval_graph import instantiate_eval  # light CLI start
    from zdsl.compile.lower import lower_policies
    return instantiate_eval(schedule, units, lower_policies(schedule, units))


def compile_schedule(schedule, units):
    """A checked schedule and its model's units to the task graph of one step (lower, then
    instantiate); for callers that already hold a ``Schedule`` (tests, benchmarks)."""
    from zdsl.compile.instantiate import instantiate  # light CLI start
    from zdsl.compile.lower import lower_policies
    return instantiate(schedule, units, lower_policies(schedule, units))


def memo_units_for() -> Callable[..., list[UnitSpec]]:
    """units_for with a cache, so a user model is built on the meta device once per command."""
    from zdsl.compile.models import units_for  # light CLI start
    cache: dict[tuple[str, int | None, str], list[UnitSpec]] = {}

    def cached(spec: ModelSpec, context: int | None = None, data: DataSpec | None = None):
        if spec.kind == "loop":       # no model statement: the user's loop gives the module, unknown here
            return None
        key = (repr(spec), context, repr(data))
        if key not in cache:
            cache[key] = units_for(spec, context, data)
        return cache[key]
    return cached


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic collector off while compiling: the compiler makes hundreds of thousands
    of long-lived objects and no garbage cycles to speak of, and each full collection walks the
    whole growing graph, which made compiling superlinear in the model's depth
    (benchmarks/compile_speed.py prints the exponent)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def report(compiled: Compiled) -> None:
    """Print a file's diagnostics (errors and warnings) to stderr, positioned; past the first
    50 of a severity only how many more there are."""
    try:
        source = Path(compiled.path).read_bytes().decode("utf-8", errors="replace")
    except OSError:
        source = None
    shown, left_out = capped(compiled.diagnostics)
    if source is not None:
        attach_sources(shown, {compiled.path: source})
    for d in shown:
        print(render(d), file=sys.stderr)
    for severity, count in left_out.items():
        print(more_line(severity, count, compiled.path), file=sys.stderr)


def status_of(compiled: Compiled) -> int:
    """The exit status a command reports for a compiled file."""
    if compiled.usage_error:
        return EXIT_USAGE
    return EXIT_OK if compiled.ok else EXIT_INVALID
