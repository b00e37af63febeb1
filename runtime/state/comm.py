"""Collectives (``comm.all_gather|reduce_scatter|all_reduce``) and where gradients are averaged.

Gradients are averaged as DDP does: multiplied by 1/world just before they are reduced, then
summed. :func:`plan_prescale` reads from the graph where each 1/world factor goes (after a
backward, or inside a collective); the backward and :class:`Collectives` apply it. Collectives
run on the default process group, issued with ``async_op=True``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field

import torch

from zdsl.ir import Op
from zdsl.ir import TaskGraph
from zdsl.ir import parse_buffer_name
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
            for w in op.writes:
                if w.startswith("grad_full["):
                    writer[w] = op.id
                    scattered.pop(w, None)
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
                if w is not None:
                    plan.after_backward.setdefault(w, []).append(parse_buffer_name(name)[1])
            if in_comm[name]:
                plan.in_collective.add(op.id)
    return plan


class Collectives:
    """Issues one rank's collectives on its buffers."""

    def __init__(self, table: BufferTable, world: int, prescale: Prescale):
        self.table, self.world, self.prescale = table, world, prescale

    def start(self, op: Op) -> Collective:
        table = self.table
        if op.kind == "comm.all_reduce":
            name = op.writes[0] if op.writes else op.reads[0]
            slot = table.read(name, op)
            if slot.buf.kind == "norm":
                return Collective(collectives.all_reduce(slot.tensor, async_op=True))
            t = slot.tensor
            if slot.buf.kind != "grad_full":
                raise table.error(op, f"all-reduce of {name} is not defined")
            a, b = table.flats[op.unit].layout.full_range(op.part)
            if op.id in self.prescale.in_collective:
                t[a:b].mul_(1.0 / self.world)
            return Collective(collectives.all_reduce(t[a:b], async_op=True))
        src_name = next(n for n in op.reads if n != "token")
        dst_name = next(n for n in op.writes if n != "token")
        src = table.read(src_name, op).tensor
        fp = table.flats[op.unit]
        if op.kind == "comm.all_gather":
            dst = table.write(dst_name, op)
            return Collective(fp.gather(op.part, dst, src, None, async_op=True))
        if op.kind == "comm.reduce_scatter":
            dst = table.write(dst_name, op)
            if not op.accumulate:
                return Collective(fp.reduce_scatter(op.part, dst, src, None, async_op=True))
            c, d = fp.layout.shard_range(op.part)
            tmp = torch.empty(d - c, dtype=dst.dtype, device=dst.device)
            work = collectives.reduce_scatter(tmp, src[slice(*fp.layout.full_range(op.part))],
                                              async_op=True)
            return Collective(work, lambda: dst[c:d].add_(tmp))
        raise table.error(op, "not a collective")
