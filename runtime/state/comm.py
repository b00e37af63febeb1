"""Collectives (``comm.all_gather|reduce_scatter|all_reduce``) and where gradients are averaged.

Gradients are averaged as DDP does: multiplied by 1/world just before they are reduced, then
summed. :func:`plan_prescale` reads from the graph where each 1/world factor goes (after a
backward, or inside a collective); the backward and :class:`Collectives` apply it. Where a
gradient is reduce-scattered within a shard group and its shard then all-reduced across the
group's replicas (HSDP, MiCS), the 1/world factor before the reduce-scatter is the only one: the
two sums together are the sum over every rank. Each collective runs on the process group of its
op's group (``Op.group``), issued with ``async_op=True``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zdsl.ir import Op, TaskGraph, parse_buffer_name
from zdsl.runtime.dist import collectives
from zdsl.runtime.state.buffers import BufferTable
from zdsl.runtime.state.errors import StateError


class Collective:
    """A collective in flight: ``is_completed()``/``wait()`` finish it exactly once."""

    def __init__(self, work, finish=None):
        self.work, self._finish = work, finish
        self._lock = threading.Lock()
        self._done = False

    def _complete(self) -> None:
        with self._lock:
            if not self._done:
                self._done = True
                if self._finish is not None:
                    self._finish()

    def is_completed(self) -> bool:
        if self.work is not None and not self.work.is_completed():
            return False
        self._complete()
        return True

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self._complete()
        return True


@dataclass
class Prescale:
    """Where gradients get their 1/world factor."""
    after_backward: dict[int, list[int]] = field(default_factory=dict)   # backward op id -> units
    in_collective: set[int] = field(default_factory=set)                 # all-reduce op ids


def plan_prescale(graph: TaskGraph, world: int, error: Callable[[Op, str], StateError]) -> Prescale:
    """Where each gradient's 1/world factor is applied: after the last backward that writes
    ``grad_full[u]`` before a collective reduces it; in an all-reduce of a gradient no
    backward wrote since its last reduction (the pipeline reduces it twice: averaging
    values every rank already holds leaves them as they are, as DDP's bits need).

    A reduce-scatter has no such case: one with no backward before it since the step
    began reads a stage-1 gradient that is still zero (nothing to scale), and one after
    another reduce-scatter of the same gradient is refused, since a reduce-scatter may
    consume its input (gloo's by all-reduce sums it in place, its own leaves it as it
    was): the second one's result would depend on the algorithm."""
    plan = Prescale()
    if world == 1:
        return plan
    writer: dict[str, int] = {}       # grad_full name -> last backward since its last reduction
    scattered: dict[str, int] = {}    # grad_full name -> its reduce-scatter, if no backward since
    in_comm: dict[str, bool] = {}     # grad_full name -> this reduction scales in the collective
    for op in graph.ops:
        if op.kind == "compute.backward":
            for written in op.writes:
                if written.startswith("grad_full["):
                    writer[written] = op.id
                    scattered.pop(written, None)
        elif op.kind in ("comm.reduce_scatter", "comm.all_reduce") and op.reads \
                and op.reads[0].startswith("grad_full["):
            name = op.reads[0]
            if op.part == 0:
                w = writer.pop(name, None)
                if op.kind == "comm.reduce_scatter" and w is None and name in scattered:
                    raise error(op, f"reduce-scatters {name} again with no backward since its "
                                    f"reduce-scatter (op {scattered[name]}), which may have consumed "
                                    f"it; scatter each gradient once, after its last backward")
                if op.kind == "comm.reduce_scatter":
                    scattered[name] = op.id
                in_comm[name] = w is None and op.kind == "comm.all_reduce"
                unit = parse_buffer_name(name)[1]     # never None: the name is grad_full[u]
                if w is not None and unit is not None:
                    plan.after_backward.setdefault(w, []).append(unit)
            if in_comm[name]:
                plan.in_collective.add(op.id)
    return plan


class Collectives:
    """Issues one rank's collectives on its buffers, each over its op's group (``groups``: the
    process groups of ``runtime/dist/group.py``; None: every collective on the default group)."""

    def __init__(self, table: BufferTable, world: int, prescale: Prescale, groups=None):
        self.table, self.world, self.prescale, self.groups = table, world, prescale, groups

    def group_of(self, op: Op):
        return None if self.groups is None else self.groups.of(op.group)

    def start(self, op: Op) -> Collective:
        if op.kind == "comm.all_reduce":
            return self.all_reduce(op)
        table = self.table
        src_name = next(n for n in op.reads if n != "token")
        src = table.read_tensor(src_name, op)
        writes = [n for n in op.writes if n != "token"]
        fp, group = table.flats[table.unit_of_op(op)], self.group_of(op)
        if op.kind == "comm.all_gather":
            dst = table.write(writes[0], op)
            if table.slot(src_name).buf.kind == "param_sec":  # hpZ: within the node, from the secondary shard
                return Collective(fp.gather_secondary(op.part, dst, src, group, async_op=True))
            work = fp.gather(op.part, dst, src, group, async_op=True)
            if len(writes) == 1:
                return Collective(work)
            sec = table.write(writes[1], op)     # hpZ: keep this rank's node-local slice of the result
            return Collective(work, lambda: fp.keep_secondary(op.part, dst, sec))
        if op.kind == "comm.reduce_scatter":
            return self.reduce_scatter(op, fp, src, table.write(writes[0], op), group)
        raise table.error(op, "not a collective")

    def all_reduce(self, op: Op) -> Collective:
        """The norm; a full gradient (stage 0, as DDP); a gradient shard across its replicas."""
        table, group = self.table, self.group_of(op)
        name = op.writes[0] if op.writes else op.reads[0]
        slot, t = table.slot(name, op), table.read_tensor(name, op)
        if slot.buf.kind == "norm":
            return Collective(collectives.all_reduce(t, group=group, async_op=True))
        if slot.buf.kind == "grad_shard":
            c, d = table.flats[table.unit_of_op(op)].layout.shard_range(op.part)
            return Collective(collectives.all_reduce(t[c:d], group=group, async_op=True))
        if slot.buf.kind != "grad_full":
            raise table.error(op, f"all-reduce of {name} is not defined")
        a, b = table.flats[table.unit_of_op(op)].layout.full_range(op.part)
        if op.id in self.prescale.in_collective:
            t[a:b].mul_(1.0 / self.world)
        return Collective(collectives.all_reduce(t[a:b], group=group, async_op=True))

    def reduce_scatter(self, op: Op, fp, src, dst, group) -> Collective:
        if not op.accumulate:
            return Collective(fp.reduce_scatter(op.part, dst, src, group, async_op=True))
        c, d = fp.layout.shard_range(op.part)
        tmp = torch.empty(d - c, dtype=dst.dtype, device=dst.device)
        work = collectives.reduce_scatter(tmp, src[slice(*fp.layout.full_range(op.part))], group=group,
                                          async_op=True)
        return Collective(work, lambda: dst[c:d].add_(tmp))
