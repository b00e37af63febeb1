"""The evaluation graph: a schedule's forward phase alone, for ``eval every N steps on SOURCE``.

One eval micro-batch (``batch`` sequences of the eval data's context) through the same
forward template, placements and prefetch as training: stage 3 gathers each unit's
parameters ahead and frees them after, offloaded shards are read and copied in as
the training forward does. Nothing else: no backward, no gradient or optimizer
buffer, no reduce-scatter, no step. The runtime runs it once per eval batch on the
training's own buffers (``runtime/run/evaluate.py``), so its buffer names are a
subset of the training graph's.

Memory: a unit keeps only its input (no autograd, nothing saved for a backward). The
batch's extras (attention masks, rotary tables) live the whole pass, from the first
unit's forward to the last one's (``runtime/state/compute.py``): no buffer lives that
long, so the graph records their bytes (``config["eval_extras"]``) and
:func:`pass_extras` adds them to every point of the pass. The model states the training
graph holds (gradient shards, optimizer state) stay allocated while evaluating;
:func:`held_states` counts them, and :func:`eval_findings` checks the budgets against
the evaluation's peak plus both.
"""
from __future__ import annotations

import dataclasses

from zdsl.compile.buffers import BufferTable
from zdsl.compile.emission import OpStream
from zdsl.compile.finish import finish_ops
from zdsl.compile.homes import UnitHomes
from zdsl.compile.models import run_context
from zdsl.compile.phases import run_phase
from zdsl.compile.step_graph import graph_of
from zdsl.compile.verify import Finding, findings
from zdsl.ir import TaskGraph, parse_buffer_name
from zdsl.lang.sizes import human_bytes
from zdsl.model.units import UnitSpec
from zdsl.schedule import Pipeline, Schedule
from zdsl.sim.simulate import simulate

# What a forward-only graph may hold: the op kinds its forward template can emit.
FORWARD_KINDS = ("compute.forward", "comm.all_gather", "copy.h2d", "nvme.read", "mem.free")


def eval_context(schedule: Schedule) -> int | None:
    """Tokens per sequence the evaluation runs on: the eval data's context (the checker gives it
    the training data's unless written), else the training's (zdsl/compile/models.py)."""
    value = schedule.eval.data.args.get("context") if schedule.eval is not None else None
    return int(value) if value else run_context(schedule)


def instantiate_eval(schedule: Schedule, units: list[UnitSpec], pipelines: dict[str, Pipeline]) -> TaskGraph:
    """The forward-only graph of one eval micro-batch, from the same lowered ``pipelines`` as the
    training graph; ``units`` sized at :func:`eval_context`. The training's parts, asked for the
    forward phase of one micro-batch only."""
    homes = UnitHomes(schedule, units)
    homes.secondary = None        # hpZ keeps its node-local shard for a backward; a pass has none
    params = [homes.home_param(u) for u in range(homes.n_units)]
    stream = OpStream(homes, BufferTable(homes, params + ["loss"], forward_only=True))
    run_phase(stream, pipelines["forward"], "forward", 0)
    ops = finish_ops(stream, schedule.overlap)
    config = schedule.to_config()
    if homes.extras_elems:
        config["eval_extras"] = homes.extras_elems * homes.elem_bytes
    return graph_of(homes, stream.buffers, ops, 1, config)


def held_states(train: TaskGraph, evaluation: TaskGraph) -> dict[str, int]:
    """tier -> bytes of the training's model states the evaluation graph does not name (gradient
    shards, optimizer state), which stay allocated while it runs."""
    out: dict[str, int] = {}
    for name, buf in train.buffers.items():
        if buf.persistent and name not in evaluation.buffers:
            out[buf.tier] = out.get(buf.tier, 0) + buf.bytes
    return out


def pass_extras(evaluation: TaskGraph) -> dict[str, int]:
    """tier -> bytes of the eval batch's extras (masks, rotary tables), held on the compute device
    for the whole pass."""
    nbytes = evaluation.config.get("eval_extras", 0)
    return {"device": nbytes} if nbytes else {}


def eval_peak(train: TaskGraph, evaluation: TaskGraph, sim) -> dict[str, int]:
    """tier -> the evaluation's simulated peak plus its batch's extras and what training keeps
    allocated beside it."""
    held, extras = held_states(train, evaluation), pass_extras(evaluation)
    tiers = set(held) | set(extras) | set(sim.memory.tiers)
    return {tier: sim.memory.peak(tier) + extras.get(tier, 0) + held.get(tier, 0) for tier in sorted(tiers)}


def eval_findings(train: TaskGraph, evaluation: TaskGraph, schedule: Schedule, want_sim: bool = True):
    """The verifier's findings on the evaluation graph (races, cycles, collective order), each
    marked as the evaluation's, and the memory budgets against :func:`eval_peak`; returns
    (findings, simulation or None)."""
    unbudgeted = dataclasses.replace(schedule, memory={})      # budgets: checked below, with the held states
    found, sim = findings(evaluation, unbudgeted, want_sim=False)
    for f in found:
        f.message = f"in the evaluation graph (eval's forward-only pass): {f.message}"
    if any(f.severity == "error" for f in found):
        return found, None
    if schedule.memory or want_sim:
        sim = simulate(evaluation, schedule.machine)
        peak = eval_peak(train, evaluation, sim)
        held = held_states(train, evaluation)
        extras = pass_extras(evaluation)
        for tier, budget in sorted(schedule.memory.items()):
            if peak.get(tier, 0) > budget:
                masks = f", its batch's masks {human_bytes(extras[tier])}" if extras.get(tier) else ""
                found.append(Finding(
                    "error", f"evaluating needs {human_bytes(peak[tier])} of {tier} memory, over the budget of "
                             f"{human_bytes(budget)}: the forward pass holds {human_bytes(sim.memory.peak(tier))} "
                             f"(parameters and working buffers){masks} and the gradients and optimizer state "
                             f"training keeps beside it {human_bytes(held.get(tier, 0))}",
                    schedule.spans.get("eval"),
                    "evaluate on a shorter context (eval ... on SOURCE(context=N)) or raise the budget"))
    return found, sim


def forward_only(graph: TaskGraph) -> bool:
    """Whether ``graph`` is an evaluation graph: forward ops only, no gradient or optimizer buffer."""
    kinds = {parse_buffer_name(name)[0] for name in graph.buffers}
    return all(op.kind in FORWARD_KINDS for op in graph.ops) and not kinds & {"grad_full", "grad_shard", "optim",
                                                                              "act_grad", "act_inner", "norm"}
