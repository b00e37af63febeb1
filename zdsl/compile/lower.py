"""Policies to pipelines: what a policy file expands to.

A policy schedule (``zero 3``, ``offload optimizer -> cpu``, ``prefetch 2``,
...) is lowered to three pipeline templates, ``forward``, ``backward`` and
``step``, each instantiated for every unit by :mod:`zdsl.compile.instantiate`. The
templates are uniform: statements that do not apply to a unit (a copy for a
unit whose state is not offloaded, a gather of parameters already gathered)
are dropped at instantiation, so partial offload (``ratio``) and persistence
need no special templates. ``zdsl plan --lowered`` prints these templates as
valid .zs.

What each template does, by stage (k = prefetch depth):

forward unit u     read parameters[u+k+1] from nvme      (parameters on nvme)
                   copy parameters[u+k] to device        (parameters off the device)
                   gather parameters[u+k]                (stage 3)
                   compute u
                   free parameters[u]                    (stage 3)
backward unit u    the same reads, copies and gathers, k units ahead in backward order
                   recompute u                           (units chosen by `recompute`)
                   compute u
                   free parameters[u]
                   reduce gradients[u]                   (stage 0: all-reduce, as DDP)
                   scatter gradients[u]                  (stages 1-3: reduce-scatter)
                   copy gradients[u] to host             (optimizer or gradients off the device)
                   free gradients[u+1]                   (stages 2-3; one unit late so the scatter
                                                          of u+1 overlaps the compute of u)
step unit u        read optimizer[u-k] from nvme         (optimizer on nvme, streamed)
                   step u [on cpu]                       (on cpu when the optimizer is offloaded)
                   write optimizer[u] to nvme
                   write parameters[u] to nvme / copy parameters[u] to device|host
                   gather parameters[u]                  (stages 1-2: share the updated shard)

Three mechanisms mean "ahead"; they run in this order, each on what the one before produced:

1. **Template offsets** (here): ``prefetch k`` writes ``parameters[u+k]`` (NVMe reads k+1) in
   the forward and backward and ``optimizer[u-k]`` in the step, so a statement is issued k units
   before the unit that uses it; :func:`zdsl.compile.phases.phase_slots` places each offset in
   the phase's unit order (a prologue for the first units). Fixed before any graph exists; the
   step woven into the last backward keeps ``max(1, k)`` units behind it
   (:func:`zdsl.compile.phases.run_backward_and_step`), so these reads stay ahead of its writes.
2. **Optimizer read-ahead** (:func:`zdsl.compile.phases.run_backward_reading_ahead`): where the
   step must wait for the global norm (clip, fp16) it cannot be woven in, so the step's own
   first ``read optimizer`` statements move into the backward, one per unit. How many is the
   host budget's choice (:meth:`zdsl.compile.host_budget.HostBudget.read_optimizer_ahead`),
   from the simulated host peak of the graph (1) built.
3. **Belady residency** (:mod:`zdsl.compile.residency`): issues nothing earlier; it keeps host
   copies of NVMe state between uses so a read (1 or 2) is not issued at all, chosen by the
   next use on the simulated timeline of the graph (1) and (2) built, in the room the budget
   leaves. It runs last and leaves the optimizer states (2) reads ahead alone (their room is
   taken); a kept copy rests until the read it replaces, so the rebuild issues everything else
   as before.
"""
from __future__ import annotations

from zdsl.model.units import UnitSpec
from zdsl.schedule import Pipeline, PipeStmt, Ref, Schedule, Span


def lower_policies(schedule: Schedule, units: list[UnitSpec]) -> dict[str, Pipeline]:
    """The pipelines a policy schedule stands for (hand-written ones win)."""
    if schedule.pipelines:
        return dict(schedule.pipelines)
    k = schedule.prefetch
    stage = schedule.stage
    params = schedule.placed("parameters").tier
    optim = schedule.placed("optimizer").tier
    grads = schedule.placed("gradients").tier
    sp = schedule.spans

    def at(*keys: str) -> Span | None:
        for key in keys:
            if key in sp:
                return sp[key]
        return None

    def s(verb: str, state: str, offset: int = 0, tier: str | None = None, *keys: str) -> PipeStmt:
        return PipeStmt(verb, Ref(state, offset), tier, at(*keys))

    fetch_keys = ("prefetch", "offload.parameters", "zero", "shard")

    def fetch(sign: int) -> list[PipeStmt]:
        """Bring parameters k units ahead (sign: +1 forward, -1 backward)."""
        out = []
        if stage == 3:
            if params == "nvme":
                out.append(s("read", "parameters", sign * (k + 1), "nvme", *fetch_keys))
            if params != "device":
                out.append(s("copy", "parameters", sign * k, "device", *fetch_keys))
            out.append(s("gather", "parameters", sign * k, None, *fetch_keys))
        return out

    forward = fetch(+1) + [s("compute", "units", 0, None, "model")]
    if stage == 3:
        forward.append(s("free", "parameters", 0, None, "zero", "shard"))

    backward = fetch(-1)
    if schedule.recompute:
        backward.append(s("recompute", "units", 0, None, "recompute"))
    backward.append(s("compute", "units", 0, None, "model"))
    if stage == 3:
        backward.append(s("free", "parameters", 0, None, "zero", "shard"))
    if stage == 0:
        backward.append(s("reduce", "gradients", 0, None, "zero", "shard"))
    else:
        backward.append(s("scatter", "gradients", 0, None, "zero", "shard"))
    if optim != "device" or grads != "device":
        backward.append(s("copy", "gradients", 0, "host", "offload.optimizer", "offload.gradients"))
    if stage >= 2:
        backward.append(s("free", "gradients", +1, None, "zero", "shard"))

    step: list[PipeStmt] = []
    if optim == "nvme":
        step.append(s("read", "optimizer", -k, "nvme", "offload.optimizer", "prefetch"))
    step.append(s("step", "units", 0, "cpu" if optim != "device" else None, "optimizer", "offload.optimizer"))
    if optim == "nvme":
        step.append(s("write", "optimizer", 0, "nvme", "offload.optimizer"))
    if stage == 3:
        if params == "nvme":
            if optim == "device":
                step.append(s("copy", "parameters", 0, "host", "offload.parameters"))
            step.append(s("write", "parameters", 0, "nvme", "offload.parameters"))
        elif params == "cpu" and optim == "device":
            step.append(s("copy", "parameters", 0, "host", "offload.parameters"))
        elif params == "device" and optim != "device":
            step.append(s("copy", "parameters", 0, "device", "offload.optimizer"))
    elif stage in (1, 2):
        if optim != "device":
            step.append(s("copy", "parameters", 0, "device", "offload.optimizer"))
        step.append(s("gather", "parameters", 0, None, "zero", "shard"))

    return {
        "forward": Pipeline("forward", "u", forward),
        "backward": Pipeline("backward", "u", backward),
        "step": Pipeline("step", "u", step),
    }
