"""What ``zdsl plan`` says of a schedule's ``freeze``: the parameters it keeps frozen and what that saves.

The saving is measured, not estimated: the same schedule is compiled once more without
``freeze`` and its model states and collectives are set against the frozen graph's, so it
covers whatever the graph leaves out (gradient buffers, optimizer state with its master copy
on every tier, reduce-scatters and all-reduces, steps).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from zdsl.driver import compile_schedule
from zdsl.ir import TIERS, TaskGraph
from zdsl.lang.sizes import human_bytes
from zdsl.planner.comm import comm_plan
from zdsl.sim.memory import model_states


@dataclass
class FreezePlan:
    frozen: int                          # parameters frozen
    parameters: int                      # parameters of the model
    units_frozen: int                    # units with nothing to train (no gradients, optimizer, step)
    not_held: dict[str, dict[str, int]]  # tier -> {"gradients", "optimizer"} -> bytes per rank not held
    not_sent: int                        # collective payload bytes per step per rank not sent

    def to_json(self) -> dict:
        return {"frozen_parameters": self.frozen, "parameters": self.parameters, "units_frozen": self.units_frozen,
                "bytes_not_held": self.not_held, "comm_bytes_not_sent": self.not_sent}

    def line(self) -> str:
        held = ", ".join(f"{tier} {human_bytes(row['gradients'])} gradients + {human_bytes(row['optimizer'])} "
                         f"optimizer" for tier, row in self.not_held.items() if any(row.values()))
        share = self.frozen / self.parameters if self.parameters else 0.0
        return (f"freeze: {self.frozen:,} of {self.parameters:,} parameters frozen ({share:.0%}; "
                f"{self.units_frozen} unit{'s' if self.units_frozen != 1 else ''} with nothing to train); "
                f"against no freeze, per rank: not held {held or 'nothing'}; "
                f"not sent {human_bytes(self.not_sent)} a step")


def freeze_plan(graph: TaskGraph, schedule, units) -> FreezePlan | None:
    """The saving of ``schedule.freeze`` (None without one); ``units``: the model's UnitSpecs."""
    if not schedule.freeze:
        return None
    unfrozen = compile_schedule(dataclasses.replace(schedule, freeze=()), units)
    frozen = sum(math.prod(units[u.index].params[k][1]) for u in graph.units for k in (u.frozen or ()))
    now, before = model_states(graph), model_states(unfrozen)
    not_held = {tier: {state: before.get(tier, {}).get(state, 0) - now.get(tier, {}).get(state, 0)
                       for state in ("gradients", "optimizer")} for tier in TIERS}
    return FreezePlan(frozen=frozen, parameters=sum(u.numel for u in graph.units),
                      units_frozen=sum(not u.trains for u in graph.units), not_held=not_held,
                      not_sent=comm_plan(unfrozen).payload_bytes - comm_plan(graph).payload_bytes)
