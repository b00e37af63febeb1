"""Which host buffers are page-locked: the ``pinned`` option of the placement that put them there.

``offload optimizer -> cpu(pinned=false)`` keeps that state's host buffers pageable (DeepSpeed's
``offload_optimizer.pin_memory: false``), as does ``pinned=false`` on a parameter or gradient
placement for its own buffers. A host buffer of a unit belongs to its own state's placement when
that state of the unit is off the device, else to the optimizer's: the host step's staging copies
(gradient shards brought to the host, parameters it updated) exist because of where the optimizer
lives. Buffers on other tiers, and those of no unit, keep the default (pinned); the runtime pins
only where the device is CUDA.
"""
from __future__ import annotations

from zdsl.ir import BUFFER_KINDS
from zdsl.schedule import Schedule


def host_pinned(schedule: Schedule, tiers: dict[str, list[str]], kind: str, unit: int | None, tier: str) -> bool:
    """``tiers``: each state's home tier per unit (instantiate's placement)."""
    if tier != "host" or unit is None:
        return True
    state = BUFFER_KINDS.get(kind)
    for owner in ([state] if state else []) + ["optimizer"]:
        if tiers[owner][unit] != "device":
            return schedule.placed(owner).pinned
    return True
