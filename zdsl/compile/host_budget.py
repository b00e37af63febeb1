"""Fitting ``memory host`` over NVMe-homed state: the passes that rebuild the step graph with choices.

Contract: :func:`fit_host_budget` takes the graph built without choices and returns the graph
rebuilt with what the budget holds, its ``config["residency"]`` saying what was chosen and what
an LRU cache of the same room would have saved. Each pass rebuilds with a choice and keeps it
only where the rebuilt graph's simulated host peak stays within the budget (the verifier checks
the same), shrinking the choice by the excess and trying again at most a few times. The passes,
in order (why this order: :mod:`zdsl.compile.lower`'s docstring on the three meanings of "ahead"):

1. :meth:`HostBudget.read_optimizer_ahead`: with the step after the whole backward (clip, fp16),
   the step's NVMe optimizer reads woven into the backward;
2. :meth:`HostBudget.hold_through_cycle`: NVMe state held on the host through the whole step
   (its home moves there for that unit);
3. :meth:`HostBudget.keep_resident`: the host copies Belady's rule keeps between their uses
   within the step (:mod:`zdsl.compile.residency`).
"""
from __future__ import annotations

from dataclasses import dataclass

from zdsl.compile import residency
from zdsl.compile.step_graph import HostChoices, StepBuild, build_step
from zdsl.ir import TaskGraph
from zdsl.machine_profile import MachineProfile
from zdsl.model.units import UnitSpec
from zdsl.schedule import Pipeline, Schedule
from zdsl.sim.simulate import Simulation, simulate


def fit_host_budget(schedule: Schedule, units: list[UnitSpec], pipelines: dict[str, Pipeline], budget: int,
                    first: StepBuild) -> TaskGraph:
    """``first`` (built without choices) rebuilt with what ``budget`` bytes of host memory hold."""
    host = HostBudget(schedule, units, pipelines, budget)
    built = host.read_optimizer_ahead(Built(first, schedule.machine))
    lru = host.lru_of_the_whole_room(built)
    built, held = host.hold_through_cycle(built)
    if built.step.stream.free_drafts:
        graph, chosen = host.keep_resident(built, held)
    else:
        graph, chosen = built.graph, residency.Residency(budget=budget, held=held) if held else None
    if chosen is not None:
        graph.config["residency"] = chosen.to_json() | {"lru_saved_bytes": lru}
    return graph


@dataclass
class Built:
    """A step build and its simulated step, simulated once when first asked."""
    step: StepBuild
    machine: MachineProfile
    _sim: Simulation | None = None

    @property
    def graph(self) -> TaskGraph:
        return self.step.graph

    @property
    def sim(self) -> Simulation:
        if self._sim is None:
            self._sim = simulate(self.graph, self.machine)
        return self._sim

    @property
    def host_peak(self) -> int:
        return self.sim.memory.peak("host")


class HostBudget:
    """The passes that fill the budget, each a rebuild of the same pipelines with a choice."""

    def __init__(self, schedule: Schedule, units: list[UnitSpec], pipelines: dict[str, Pipeline], budget: int):
        self.schedule, self.units, self.pipelines, self.budget = schedule, units, pipelines, budget

    def build(self, choices: HostChoices) -> Built:
        return Built(build_step(self.schedule, self.units, self.pipelines, choices), self.schedule.machine)

    def fit(self, knob, rebuild, shrink, tries: int):
        """Rebuild at ``knob`` and keep the result if its host peak is within the budget; else
        ``shrink(knob, excess)`` and try again, at most ``tries`` times. ``rebuild(knob)`` gives
        (choice, built), or None when the knob leaves nothing to try. Returns (choice, built) or None."""
        for _ in range(tries):
            tried = rebuild(knob)
            if tried is None:
                return None
            excess = tried[1].host_peak - self.budget
            if excess <= 0:
                return tried
            knob = shrink(knob, excess)
        return None

    def read_optimizer_ahead(self, built: Built) -> Built:
        """With the step after the whole backward (clip, fp16) and optimizer state on NVMe: the
        graph rebuilt with as many of the step's optimizer reads woven into the backward as the
        budget holds until their steps (the build records the count in its config); else ``built``."""
        homes = built.step.stream.homes
        on_nvme = [b.bytes for b in built.graph.buffers.values() if b.kind == "optim" and b.tier == "nvme"]
        if not (homes.clip and homes.n_units > 1 and on_nvme):
            return built
        room = self.budget - built.host_peak
        ahead = min(len(on_nvme), homes.n_units, max(0, room) // max(on_nvme))
        # each try reads at least one unit fewer ahead, so ``ahead`` tries reach none
        fitted = self.fit(ahead, lambda n: (n, self.build(HostChoices(read_ahead=n))) if n > 0 else None,
                          lambda n, excess: n - max(1, n // 4), tries=ahead)
        return fitted[1] if fitted else built

    def lru_of_the_whole_room(self, built: Built) -> int:
        """What an LRU cache of the host room would save on ``built``, for the plan's comparison."""
        stream = built.step.stream
        if not stream.free_drafts:
            return 0
        sim = built.sim
        host = sim.memory.tiers.get("host")
        if host is None:
            return 0
        return residency.lru_saved(built.graph, sim.start, sim.end, sim.step_s, host, self.budget,
                                   stream.free_positions())

    def hold_through_cycle(self, built: Built) -> tuple[Built, list]:
        """``built`` rebuilt with the NVMe state :func:`residency.hold_through_cycle` holds on the
        host in the room the budget leaves free all step (shrunk by any excess over the budget,
        choosing again), with what they were; else ``built`` and nothing held."""
        read_ahead = built.step.choices.read_ahead
        # the optimizer states the backward reads ahead already have their room (read_optimizer_ahead)
        ahead = read_ahead_units(built.graph) if read_ahead else set()
        candidates = [h for h in residency.cycle_candidates(built.graph, built.sim.start)
                      if not (h.state == "optimizer" and h.unit in ahead)]

        def rebuild(room: int):
            held = residency.hold_through_cycle(candidates, room)
            if not held:
                return None
            rehome = frozenset((h.state, h.unit) for h in held)
            return held, self.build(HostChoices(read_ahead=read_ahead, rehome=rehome))

        fitted = self.fit(self.budget - built.host_peak, rebuild, lambda room, excess: room - excess,
                          tries=residency.MAX_TRIES)
        return (fitted[1], fitted[0]) if fitted else (built, [])

    def keep_resident(self, built: Built, cycle: list) -> tuple[TaskGraph, residency.Residency | None]:
        """``built``'s graph rebuilt with the host copies Belady's rule keeps under the budget
        (zdsl/compile/residency.py), or ``built``'s graph itself when none fits; either way with
        what the choice saves and the states ``cycle`` holds (None: nothing kept, nothing held).
        Where moving reads changed the timeline enough to go over the budget, the room shrinks
        by the excess and the choice is made again."""
        graph, sim, step = built.graph, built.sim, built.step
        gaps = residency.find_gaps(graph, sim.start, sim.end, sim.step_s, step.stream.free_positions())
        host = sim.memory.tiers.get("host")
        if host is None or not any(gap.reread for gap in gaps):
            return graph, residency.Residency(budget=self.budget, held=cycle) if cycle else None
        room = residency.Room(host.times, host.working, self.budget, host.model_states, gaps)

        def rebuild(margin: int):
            held = residency.belady(gaps, room, margin)
            if not held:
                return None
            keep = frozenset((g.buffer, g.end) for g in held)
            return held, self.build(HostChoices(keep=keep, read_ahead=step.choices.read_ahead,
                                                rehome=step.choices.rehome))

        fitted = self.fit(0, rebuild, lambda margin, excess: margin + excess, tries=residency.MAX_TRIES)
        held, kept = fitted if fitted else ([], built)
        return kept.graph, residency.summarize(gaps, held, room, self.budget, cycle)


def read_ahead_units(graph: TaskGraph) -> set[int]:
    """Units whose optimizer state the graph reads from NVMe before its first step."""
    out: set[int] = set()
    for op in graph.ops:
        if op.kind == "compute.step":
            break
        if op.kind == "nvme.read" and op.unit is not None and any(name.startswith("optim[") for name in op.reads):
            out.add(op.unit)
    return out
