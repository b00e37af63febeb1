"""``zdsl.initialize``: compile the schedule, join the ranks, shard the model, start the loop.

Every rank calls it with the same schedule (its graph's digest is compared, as ``zdsl run``
does) in a process a launcher started (torchrun; its variables), or in a plain ``python
script.py`` for a schedule of ``ranks 1``; a script that joined its own process group keeps it
(the engine uses the default group and leaves it to the script). The rank's set-up is
``zdsl run``'s own (``runtime/run/train.py``: ``prepare_host``, ``open_rank``).
"""
from __future__ import annotations

import atexit
import contextlib
import weakref
from pathlib import Path

from zdsl.errors import ZdslApiError
from zdsl.runtime.api.calls import engine_call
from zdsl.runtime.api.given import GIVEN_FACTORY, as_unit_model, differences, sizing_hook


@engine_call("zdsl.initialize()")
def initialize(schedule, model=None, *, overrides: dict | None = None, timeout_s: float | None = None):
    """The :class:`~zdsl.runtime.api.engine.Engine` of this rank for the ``.zs`` file ``schedule``.

    ``model``: None trains the schedule's ``model``; a module is trained itself (``given.py``:
    the unit protocol, a chain of children, or ``zdsl.units``), and then the schedule names no
    model, or the same one (the same units' parameter names and shapes). ``overrides``: ``--set``'s
    ``{key: value}``. ``timeout_s``: the longest any collective or call of the engine waits for the
    other ranks. Default: ``zdsl launch --timeout``, else 120 s.
    Under ``zdsl launch`` the schedule's fit on this machine is checked before the rank allocates,
    as ``zdsl run`` checks it (``runtime/run/script_rank.py``)."""
    from zdsl.runtime.run.script_rank import launch_timeout
    timeout_s = launch_timeout(timeout_s)
    given = as_unit_model(model) if model is not None else None
    compiled = compile_for(str(schedule), overrides, given)
    return start(compiled, given, timeout_s)


def compile_for(path: str, overrides: dict | None, given):
    """``compile_file`` of ``path`` (with ``given`` sized where the schedule's model would be);
    :class:`ZdslApiError` with the positioned diagnostics when it does not compile."""
    from zdsl.driver import compile_file, memo_units_for
    overrides = {str(k): str(v) for k, v in (overrides or {}).items()}
    units_for, named = None, None
    if given is not None:
        if "model" in overrides:
            raise ZdslApiError("initialize(): overrides set `model` and model= gives one: one model only")
        named = model_statement(path)
        if named is None:
            overrides["model"] = f'"{GIVEN_FACTORY}"()'
            units_for = sizing_hook(given, memo_units_for())
    compiled = compile_file(path, overrides, units_for, simulate=False)
    if not compiled.ok:
        raise ZdslApiError(f"{path} does not compile:\n{diagnostics_text(compiled)}")
    differ = differences(compiled.units, given) if named is not None else None
    if differ is not None:
        raise ZdslApiError(f"{named}: the schedule names a model and initialize() was given model="
                           f"{getattr(given, 'given', type(given).__name__)}, another one ({differ}): one model "
                           f"only; remove the model statement to train the object, or leave out model= to train "
                           f"the schedule's")
    return compiled


def model_statement(path: str) -> str | None:
    """``file:line:col`` of the schedule's own ``model`` statement (its includes too), or None;
    None also when it does not parse (compiling then says why)."""
    from zdsl.lang.include import expand_includes
    from zdsl.lang.parse import parse_file
    try:
        program = parse_file(path)
        statements = expand_includes(program, {program.file: program.source})
    except Exception:       # noqa: BLE001 - compile_file then reports it, positioned
        return None
    found = next((s for s in statements if getattr(s, "keyword", None) == "model"), None)
    return None if found is None else f"{found.span.file}:{found.span.line}:{found.span.column}"


def diagnostics_text(compiled) -> str:
    """The errors of a compile, rendered as ``zdsl check`` prints them."""
    from zdsl.lang.errors import attach_sources, render
    errors = [d for d in compiled.diagnostics if d.severity == "error"]
    try:
        attach_sources(errors, {compiled.path: Path(compiled.path).read_text(errors="replace")})
    except OSError:
        pass
    return "\n".join(render(d) for d in errors)


def start(compiled, given, timeout_s: float):
    """Join the ranks, build the rank's state and start the engine's loop (``compile_for``'s result)."""
    from zdsl.runtime.run.script_rank import launch_preflight
    launch_preflight(compiled, timeout_s)          # under zdsl launch: the fit, before the rank allocates
    from zdsl.runtime.api.background import Background
    from zdsl.runtime.api.batches import Compiled
    from zdsl.runtime.api.calls import CallCheck
    from zdsl.runtime.api.engine import Engine
    from zdsl.runtime.api.flow import StepFlow
    from zdsl.runtime.run.train import LaunchError, open_rank
    graph, schedule = compiled.graph, compiled.schedule
    stack = contextlib.ExitStack()
    try:
        rank, world, device = join(graph, stack, timeout_s)
        run = open_rank(stack, graph, schedule, compiled.units, rank, world, device, model=given,
                        eval_graph=compiled.eval_graph)
        eval_executor = forward_only_executor(compiled, run)
        calls = CallCheck(rank, world, timeout_s)
        stack.callback(calls.close)
        loop = Background(f"zdsl-engine-rank{rank}")
        stack.callback(loop.close)
        flow = StepFlow(run, loop.nursery, timeout_s)
        engine = Engine(run, stack, loop, flow, calls, Compiled.of(schedule), eval_executor)
    except LaunchError as exc:
        stack.close()
        raise ZdslApiError(str(exc)) from None
    except BaseException:
        stack.close()
        raise
    atexit.register(close_at_exit, weakref.ref(engine))    # its NVMe files go even if the script forgets close()
    return engine


def close_at_exit(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


def join(graph, stack: contextlib.ExitStack, timeout_s: float):
    """This rank in the group (the script's, the launcher's, or alone for ``ranks 1``), its device
    and host prepared as ``zdsl run`` prepares them; (rank, world, device)."""
    import torch.distributed as dist

    from zdsl.runtime.dist.group import init_group, join_alone, launched_rank, leave_group
    from zdsl.runtime.run.train import prepare_host
    found = launched_rank()
    rank, world = found if found is not None else (0, 1)
    if world != graph.ranks:
        how = (f"start it with torchrun --nproc-per-node {graph.ranks} (or --set ranks={world})" if found is None else
               f"launch {graph.ranks} ranks, or set `ranks {world}` (overrides={{'ranks': '{world}'}})")
        raise ZdslApiError(f"the schedule trains on {graph.ranks} ranks (`ranks {graph.ranks}`) but this script runs "
                           f"as {world}; {how}")
    joined_before = dist.is_initialized()
    device = prepare_host(graph, rank, world)
    if not joined_before:
        if found is None:
            join_alone(device, timeout_s)
        else:
            init_group(rank, world, device, timeout_s)
        stack.callback(leave_group)
    return rank, world, device


def forward_only_executor(compiled, run):
    """The executor of the schedule's forward-only graph (its ``eval`` one, else made here from
    the same pipelines and units), on the rank's state, as ``runtime/run/evaluate.py`` makes it."""
    from zdsl.driver import compile_eval
    from zdsl.runtime.exec.executor import Executor
    from zdsl.runtime.exec.streams import lane_streams
    from zdsl.runtime.run.train import agree_on_graph
    graph = compiled.eval_graph
    if graph is None:
        graph = compile_eval(compiled.schedule, compiled.units)
        agree_on_graph(graph, run.rank, run.world, run.device)
    executor = Executor(graph, run.state, run.rank, record=False,
                        streams=lane_streams(graph, run.device, timing=False))
    executor.fault = None       # ZDSL_FAULT names a training op and step
    return executor
