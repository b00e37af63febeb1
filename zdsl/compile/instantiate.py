"""Pipelines to a task graph: instantiate every template for every unit.

Rules (the language reference repeats them for users):

* **Issue order.** Per micro-batch, the forward template runs for units in
  order 0..L-1 and the backward template for L-1..0; the step template runs
  for L-1..0 woven into the last micro-batch's backward, each unit ``lag``
  units behind its backward (see ``phases.run_backward_and_step``), or after it
  where clipping or fp16 needs every gradient first. Statement order inside
  a template is issue order.
* **Index arithmetic is clipped at the model's ends.** A statement whose
  unit lies ``e`` positions *ahead* in phase order also covers the units it
  would never reach, at the first iteration (a prologue); one that lies
  behind covers the rest after the last iteration (an epilogue).
* **A statement that does not apply is dropped**: a copy or nvme access for
  a unit whose state does not live there (partial offload), a gather of
  parameters already gathered and not since updated, a free of model state,
  a reduction of full gradients before the last micro-batch at stages 0-1
  (where full gradients accumulate locally, as under DDP's ``no_sync``).
* **Dependencies are derived** from the buffers each op reads and writes
  (read after write, write after read, write after write); ``free`` counts
  as a write.
* **Frees.** An explicit ``free`` runs on the lane that produced the buffer,
  so that lane cannot run ahead of its consumers (this is what bounds
  prefetch memory, like a buffer pool). A working buffer that no statement
  frees is freed right after its last use, on that use's lane.
* **Frozen parameters** (``freeze``). A unit with nothing to train drops its
  reductions, gradient and optimizer moves and step, and its backward when no
  unit before it trains; a partly frozen unit's gradients, reductions, optimizer
  state and stage 1-2 gather after the step cover its trainable parts only
  (``zdsl/model/layout.py``).
* **Overlap policy.** A ``verb/phase`` pair missing from ``overlap`` puts
  those ops and the phase's compute in one chain (through a zero-byte
  ``token`` buffer), so they never run at the same time.
* **Host residency** (``memory host`` with state on NVMe). The graph is built
  once as above; then :mod:`zdsl.compile.residency` picks, by Belady's rule
  under the host budget, the NVMe state held on the host through the whole
  step (its home moves there for that unit: no read or write of it) and the
  host copies that stay live until their next read within the step, and the
  graph is built again with those frees and reads left out. A kept copy is
  *resting*: held, but to every statement as absent as if freed, until the
  read it replaces revives it, so the second build makes the same decisions
  as the first.

Where each part lives (each module's docstring states its contract):

* :mod:`~zdsl.compile.homes`: each unit's layout, home tiers, what it trains;
  :mod:`~zdsl.compile.buffers`: every buffer's size from its name;
* :mod:`~zdsl.compile.emission`: the op stream, buffer liveness, frees and kept copies;
* :mod:`~zdsl.compile.verbs` (dispatch, collectives), :mod:`~zdsl.compile.compute_ops`
  (compute, step, norm), :mod:`~zdsl.compile.transfers` (copies, NVMe): one statement to ops;
* :mod:`~zdsl.compile.phases`: the templates per unit, in issue order, woven;
* :mod:`~zdsl.compile.finish`: overlap policy, auto-free, dependencies;
* :mod:`~zdsl.compile.step_graph`: one build; :mod:`~zdsl.compile.host_budget`: the
  rebuilds that fill ``memory host``. What "ahead" means in each: :mod:`zdsl.compile.lower`.
"""
from __future__ import annotations

from zdsl.compile.host_budget import fit_host_budget
from zdsl.compile.lowering_error import LoweringError
from zdsl.compile.step_graph import build_step
from zdsl.ir import TaskGraph
from zdsl.model.units import UnitSpec
from zdsl.schedule import Pipeline, Schedule

__all__ = ["LoweringError", "instantiate"]


def instantiate(schedule: Schedule, units: list[UnitSpec], pipelines: dict[str, Pipeline]) -> TaskGraph:
    """A checked schedule, its model's units and its lowered pipelines to the task graph of one
    step (``zdsl.driver.compile_schedule`` lowers first)."""
    first = build_step(schedule, units, pipelines)
    budget = (schedule.memory or {}).get("host")
    if not budget:
        return first.graph
    return fit_host_budget(schedule, units, pipelines, budget, first)
