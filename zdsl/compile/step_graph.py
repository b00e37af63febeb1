"""One build of a step's task graph: homes, buffers, the phases issued, the ops finished.

Contract: :func:`build_step` is deterministic in (schedule, units, pipelines, choices); the
default :class:`HostChoices` give the graph as the pipelines state it, and the host budget
(:mod:`zdsl.compile.host_budget`) rebuilds with its choices, each of which only moves reads
or leaves out frees of NVMe state's host copies. :func:`graph_of` assembles a ``TaskGraph``
from finished ops, for the training graph here and the eval graph
(:mod:`zdsl.compile.eval_graph`) alike.
"""
from __future__ import annotations

from dataclasses import dataclass

from zdsl.compile.buffers import BufferTable
from zdsl.compile.emission import OpStream
from zdsl.compile.finish import finish_ops
from zdsl.compile.homes import UnitHomes
from zdsl.compile.lowering_error import LoweringError
from zdsl.compile.phases import run_step_phases
from zdsl.ir import Op, TaskGraph, UnitInfo
from zdsl.model.decay import NoDecayError, decay_groups
from zdsl.model.layout import flat_ranges
from zdsl.model.units import UnitSpec
from zdsl.schedule import Pipeline, Schedule


@dataclass(frozen=True)
class HostChoices:
    """What the host budget decided for NVMe state; the defaults decide nothing."""
    keep: frozenset = frozenset()     # (host copy, end): frees left out (zdsl/compile/residency.py)
    read_ahead: int = 0               # the step's optimizer reads woven into the backward
    rehome: frozenset = frozenset()   # (state, unit) on NVMe held on the host through the cycle


@dataclass
class StepBuild:
    """A built step graph with the op stream that built it (positions of its frees) and its choices."""
    graph: TaskGraph
    stream: OpStream
    choices: HostChoices


def build_step(schedule: Schedule, units: list[UnitSpec], pipelines: dict[str, Pipeline],
               choices: HostChoices = HostChoices()) -> StepBuild:
    homes = UnitHomes(schedule, units, choices.rehome)
    stream = OpStream(homes, BufferTable(homes, homes.model_state_names()), choices.keep)
    run_step_phases(stream, pipelines, choices.read_ahead)
    ops = finish_ops(stream, schedule.overlap)
    config = schedule.to_config()
    if choices.read_ahead:
        config["read_ahead"] = choices.read_ahead
    graph = graph_of(homes, stream.buffers, ops, schedule.train.accumulate, config)
    return StepBuild(graph, stream, choices)


def graph_of(homes: UnitHomes, buffers: BufferTable, ops: list[Op], accumulate: int, config: dict) -> TaskGraph:
    schedule = homes.schedule
    per_node = schedule.per_node if schedule.per_node and schedule.per_node < homes.ranks else 0
    return TaskGraph(schedule=schedule.name, ranks=homes.ranks, stage=schedule.stage, precision=homes.precision,
                     accumulate=accumulate, units=unit_infos(homes), buffers=buffers.by_name, ops=ops, config=config,
                     per_node=per_node)


def unit_infos(homes: UnitHomes) -> list[UnitInfo]:
    infos = []
    decay = decay_ranges(homes)
    batch, elem_bytes = homes.batch, homes.elem_bytes
    for i, (spec, layout) in enumerate(zip(homes.specs, homes.layouts)):
        infos.append(UnitInfo(
            index=i, name=spec.name, numel=spec.numel, padded_numel=layout.padded_numel,
            shard_numel=layout.shard_numel, parts=layout.parts, uses=list(spec.uses),
            recompute=i in homes.recompute, persistent=i in homes.persist,
            act_bytes=batch * spec.act_elems(elem_bytes) * elem_bytes,
            input_bytes=batch * spec.input_elems_per_seq * elem_bytes,
            fwd_flops=spec.fwd_flops_per_seq * batch, master=homes.has_master(i), decay=decay[i],
            frozen=[k for k, f in enumerate(homes.frozen[i]) if f] or None, trains=homes.trains[i],
            frozen_parts=layout.frozen_parts, frozen_part_numel=layout.frozen_part_numel,
            runs=[list(r) for r in layout.runs] or None))
    return infos


def decay_ranges(homes: UnitHomes) -> list[list[tuple[int, int]] | None]:
    """Per unit, the ranges weight decay applies to (None: all; see zdsl/model/decay.py)."""
    o = homes.schedule.optimizer
    if not (o.no_decay or o.no_decay_names):
        return [None] * homes.n_units
    try:       # the groups' ranges are in registration order: placed where the layout puts them
        return [flat_ranges(layout, ranges) for layout, ranges in
                zip(homes.layouts, decay_groups(homes.specs, o.no_decay, o.no_decay_names).ranges)]
    except NoDecayError as exc:
        error = LoweringError(str(exc), hint=exc.hint)
        error.span = homes.schedule.spans.get("optimizer.no_decay")
        raise error from None
