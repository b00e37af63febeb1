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
from zdsl.runtime.api.given import as_unit_model, differences, sizing_hook


@engine_call("zdsl.initialize()")
def initialize(schedule, model=None, *, overrides: dict | None = None, timeout_s: float | None = None):
    """The :class:`~zdsl.runtime.api.engine.Engine` of this rank for the ``.zs`` file ``schedule``.

    ``model``: None trains the schedule's ``model``; a module is trained itself (``given.py``:
    the unit protocol, a chain of children, or ``zdsl.units``), and then the schedule names no
    model, or the same one (the same units' parameter names and shapes). A schedule without
    ``data`` trains on the batches the loop feeds; where the model is the user's, its graph is
    compiled at the first ``engine(x)``, from that batch's row (``deferred.py``). ``overrides``:
    ``--set``'s ``{key: value}``. ``timeout_s``: the longest any collective or call of the engine
    waits for the other ranks. Default: ``zdsl launch --timeout``, else 120 s.
    Under ``zdsl launch`` the schedule's fit on this machine is checked before the rank allocates,
    as ``zdsl run`` checks it (``runtime/run/script_rank.py``). A group that cannot be joined (the
    rendezvous times out, MASTER_ADDR does not resolve) raises :class:`ZdslApiError` naming the rank,
    the address and port, the timeout and the fix, not torch's traceback."""
    from zdsl.runtime.run.script_rank import launch_timeout
    timeout_s = launch_timeout(timeout_s)
    given = as_unit_model(model) if model is not None else None
    loaded, units_for = load_for(str(schedule), overrides, given)
    if loaded.graph is None:            # the model's row is the first batch's
        from zdsl.runtime.api.deferred import DeferredEngine
        return DeferredEngine(loaded, lambda completed, agree: start(finish_for(completed, given, units_for), given,
                                                                     timeout_s, agree),
                              join_early(loaded.schedule, timeout_s))
    return start(loaded, given, timeout_s)


def load_for(path: str, overrides: dict | None, given):
    """``path`` checked, with ``given`` sized where the schedule has no model statement, and compiled
    (:func:`finish_for`) unless the model's row comes from the first fed batch (then its graph is
    None); with the sizing hook used. :class:`ZdslApiError` with the positioned diagnostics where it
    does not compile."""
    from zdsl.driver import load, memo_units_for
    from zdsl.sources.fed import FedSource
    overrides = {str(k): str(v) for k, v in (overrides or {}).items()}
    if given is not None and "model" in overrides:
        raise ZdslApiError("initialize(): overrides set `model` and model= gives one: one model only")
    units_for = sizing_hook(given, memo_units_for())
    loaded = load(path, overrides, units_for)
    if not loaded.ok:
        raise ZdslApiError(f"{path} does not compile:\n{diagnostics_text(loaded)}")
    schedule = loaded.schedule
    assert schedule is not None           # loaded.ok: the check went through
    if schedule.model.kind == "loop" and given is None:
        raise ZdslApiError(f"{path} has no model statement: give initialize() the model (model=m), or add a model "
                           f"statement")
    if FedSource.deferred(schedule.data, schedule.model.kind):
        return loaded, units_for
    return finish_for(loaded, given, units_for), units_for


def compile_for(path: str, overrides: dict | None, given):
    """:func:`load_for`'s schedule alone: compiled, or checked where its graph waits for the first batch."""
    return load_for(path, overrides, given)[0]


def finish_for(loaded, given, units_for):
    """Size, lower and verify a checked schedule (``load_for``'s; ``units_for``: its sizing hook), and
    check that a model the schedule names is ``given``'s; :class:`ZdslApiError` where it fails."""
    from zdsl.driver import compile_loaded, gc_paused
    with gc_paused():
        compiled = compile_loaded(loaded, units_for, simulate=False)
    if not compiled.ok:
        raise ZdslApiError(f"{compiled.path} does not compile:\n{diagnostics_text(compiled)}")
    named = compiled.schedule.spans.get("model")
    differ = differences(compiled.units, given) if named is not None and given is not None else None
    if differ is not None:
        raise ZdslApiError(f"{named.file}:{named.line}:{named.column}: the schedule names a model and initialize() "
                           f"was given model={getattr(given, 'given', type(given).__name__)}, another one ({differ}): "
                           f"one model only; remove the model statement to train the object, or leave out model= to "
                           f"train the schedule's")
    return compiled


def diagnostics_text(compiled) -> str:
    """The errors of a compile, rendered as ``zdsl check`` prints them."""
    from zdsl.lang.errors import attach_sources, render
    errors = [d for d in compiled.diagnostics if d.severity == "error"]
    try:
        attach_sources(errors, {compiled.path: Path(compiled.path).read_text(errors="replace")})
    except OSError:
        pass
    return "\n".join(render(d) for d in errors)


def start(compiled, given, timeout_s: float, agree=None):
    """Join the ranks, build the rank's state and start the engine's loop (``finish_for``'s result);
    ``agree(rank, world)``, once joined, checks what the ranks must share besides the graph."""
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
        if agree is not None:
            agree(rank, world)
        run = open_rank(stack, graph, schedule, compiled.units, rank, world, device, model=given,
                        eval_graph=compiled.eval_graph)
        eval_executor = forward_only_executor(compiled, run)
        calls = CallCheck(rank, world, timeout_s)
        stack.callback(calls.close)
        loop = Background(f"zdsl-engine-rank{rank}")
        stack.callback(loop.close)
        assert loop.nursery is not None     # Background() returns once its loop holds one
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
    rank, world = same_world(graph.ranks, found)
    joined_before = dist.is_initialized()
    device = prepare_host(graph, rank, world)
    if not joined_before:
        try:
            if found is None:
                join_alone(device, timeout_s)
            else:
                init_group(rank, world, device, timeout_s)
        except (dist.DistError, ValueError) as exc:     # the environment's, not the script's: no torch traceback
            raise ZdslApiError(rendezvous_failure(rank, world, timeout_s, exc, launched=found is not None)) from None
        stack.callback(leave_group)
    return rank, world, device


def same_world(ranks: int, found: tuple[int, int] | None) -> tuple[int, int]:
    """(rank, world) of this process (``launched_rank()``'s ``found``, else alone), or
    :class:`ZdslApiError` saying how to launch it where the world is not the schedule's ``ranks``."""
    rank, world = found if found is not None else (0, 1)
    if world != ranks:
        how = (f"start it with torchrun --nproc-per-node {ranks} (or --set ranks={world})" if found is None else
               f"launch {ranks} ranks, or set `ranks {world}` (overrides={{'ranks': '{world}'}})")
        raise ZdslApiError(f"the schedule trains on {ranks} ranks (`ranks {ranks}`) but this script runs "
                           f"as {world}; {how}")
    return rank, world


def join_early(schedule, timeout_s: float) -> contextlib.ExitStack:
    """For an engine compiled at the first ``engine(x)`` (``deferred.py``) under a launcher, with no
    group joined yet: join it now, so that what the ranks check before that call (a deferred
    ``load_checkpoint``) is agreed by all of them at once, not by each alone while the others wait
    out the timeout. The stack leaves the group (empty where nothing was joined: a group of the
    script's, or a plain ``python script.py``, whose one rank has nobody to agree with)."""
    import torch.distributed as dist

    from zdsl.runtime.dist.group import init_group, launched_rank, leave_group
    from zdsl.runtime.run.train import LaunchError, pick_device
    stack = contextlib.ExitStack()
    found = launched_rank()
    if found is None or dist.is_initialized():
        return stack
    rank, world = same_world(schedule.ranks, found)
    try:
        device = pick_device(schedule.device, rank)
        init_group(rank, world, device, timeout_s)
    except LaunchError as exc:
        raise ZdslApiError(f"rank {rank}: {exc}") from None
    except (dist.DistError, ValueError) as exc:         # as join's: the environment's, no torch traceback
        raise ZdslApiError(rendezvous_failure(rank, world, timeout_s, exc)) from None
    stack.callback(leave_group)
    return stack


def rendezvous_failure(rank: int, world: int, timeout_s: float, exc: BaseException, launched: bool = True) -> str:
    """Why this rank could not join the group (a rendezvous timed out, MASTER_ADDR does not resolve or
    answer, a malformed MASTER_PORT): what it tried, torch's reason, and the fix. ``launched``: the
    launcher's variables named the rendezvous (else the rank tried a loopback port of its own)."""
    from zdsl import env
    where = (f"MASTER_ADDR={env.raw('MASTER_ADDR')!r}, MASTER_PORT={env.raw('MASTER_PORT')!r}" if launched
             else "a free loopback port")
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (f"rank {rank}: zdsl.initialize(): could not join the group of {world} ranks at {where} within "
            f"timeout_s={timeout_s:g} s: {reason}; check that MASTER_ADDR names the host of rank 0 and resolves "
            f"and answers from here, that MASTER_PORT is the port rank 0 listens on, and that all {world} ranks "
            f"were started (a slow start needs a longer initialize(timeout_s=...) or zdsl launch --timeout)")


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
