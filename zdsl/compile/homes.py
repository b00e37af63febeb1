"""Where each unit's state lives and what it trains: the facts every op of a step graph rests on.

Contract: computed once from a checked schedule and its model's units, never changed while ops
are issued. A state's home tier is ``device``, ``host`` or ``nvme``; ``ratio`` offloads the last
units; ``rehome`` (the host budget's choice, :mod:`zdsl.compile.host_budget`) moves NVMe state
of a unit to the host for the whole step. A unit *trains* when some parameter of it does: only
those have gradients, optimizer state, reductions and a step. A unit *needs a backward* when it
trains, uses tied parameters that train, or some unit before it needs one (it hands back the
input gradient). The home buffers (``param_shard[u]@host`` ...) are named here; their sizes are
:mod:`zdsl.compile.buffers`'.
"""
from __future__ import annotations

import functools
import math

from zdsl.compile.lowering_error import LoweringError
from zdsl.ir import ALL, DTYPE_BYTES, across, buffer_name, group_size
from zdsl.model.freeze import FreezeError, frozen_params
from zdsl.model.layout import flat_layout
from zdsl.model.units import UnitSpec
from zdsl.schedule import STATES, Schedule

TIER_OF = {"device": "device", "cpu": "host", "host": "host", "nvme": "nvme"}


class UnitHomes:
    """Per unit: its flat layout, each state's home tier, whether it trains, and its home buffers."""

    def __init__(self, schedule: Schedule, units: list[UnitSpec], rehome: frozenset = frozenset()):
        self.schedule = schedule
        self.specs = units
        self.n_units = len(units)
        self.ranks = schedule.ranks
        # the group every sharded state's shards span ("all" flat; HSDP, MiCS: within a node, a group)
        # and, with zero 3's hpZ, the node the backward gathers the parameters within (else None)
        self.shard_group = schedule.shard_group()
        self.shard_ranks = group_size(self.shard_group, self.ranks)
        self.secondary = schedule.secondary_group() if schedule.stage == 3 else None
        self.stage = schedule.stage
        self.precision = schedule.train.precision
        self.elem_bytes = DTYPE_BYTES[self.precision]
        self.batch = schedule.train.batch
        self.last_micro = schedule.train.accumulate - 1
        bucket_elems = schedule.bucket_bytes // self.elem_bytes if schedule.bucket_bytes else 0
        self.frozen = frozen_of(schedule, units)
        # a partly frozen unit lays its trainable parameters first (zdsl/model/layout.py)
        self.layouts = [flat_layout(spec.numel, self.shard_ranks, bucket_elems,
                                    [math.prod(s) for _, s in spec.params], row)
                        for spec, row in zip(units, self.frozen)]
        self.tiers = {state: self._unit_tiers(state) for state in STATES}
        self.rehome = rehome             # (state, unit) on NVMe held on the host through the cycle (residency)
        for state, u in rehome:
            self.tiers[state][u] = "host"
        self.clip = schedule.optimizer.clip is not None or self.precision == "fp16"
        self.recompute = set(schedule.recompute)
        self.persist = {i for i, spec in enumerate(units)
                        if schedule.stage == 3 and schedule.persist_below and spec.numel < schedule.persist_below}
        self.trains = [not all(row) for row in self.frozen] if schedule.freeze else [True] * self.n_units
        self.needs_backward = [self.trains[u] or any(self.trains[j] for j in spec.uses) for u, spec in enumerate(units)]
        for u in range(1, self.n_units):
            self.needs_backward[u] = self.needs_backward[u] or self.needs_backward[u - 1]

    def _unit_tiers(self, state: str) -> list[str]:
        """Home tier of ``state`` for each unit; ``ratio`` offloads the last units."""
        placed = self.schedule.placed(state)
        tier = TIER_OF[placed.tier]
        if tier == "device":
            return ["device"] * self.n_units
        offloaded = max(1, round(placed.ratio * self.n_units)) if placed.ratio < 1 else self.n_units
        return ["device" if i < self.n_units - offloaded else tier for i in range(self.n_units)]

    @property
    def replicas(self) -> str | None:
        """The group that all-reduces a gradient shard across the replicas of its shard group, or
        None where the shards span every rank (nothing to all-reduce)."""
        return None if self.shard_group == ALL else across(self.shard_ranks)

    @property
    def secondary_ranks(self) -> int:
        """Ranks of the secondary shard's group (hpZ's node)."""
        assert self.secondary is not None, "only hpZ has a secondary shard (param_sec)"
        return group_size(self.secondary, self.ranks)

    def optim_tier(self, u: int) -> str:
        return self.tiers["optimizer"][u]

    def param_tier(self, u: int) -> str:
        return self.tiers["parameters"][u] if self.stage == 3 else "device"

    def grad_home(self, u: int) -> str:
        """Where a unit's gradient shard accumulates (stages 2-3)."""
        offloaded = self.tiers["gradients"][u] != "device" or self.optim_tier(u) != "device"
        return "host" if offloaded else "device"

    def state_tier(self, kind: str, u: int) -> str | None:
        """Home tier of the sharded state a buffer kind holds (None: not a sharded state's kind)."""
        if kind == "param_shard":
            return self.param_tier(u)
        if kind == "optim":
            return self.optim_tier(u)
        if kind == "grad_shard":
            return self.tiers["gradients"][u]
        return None

    def nvme_home(self, kind: str, u: int | None) -> bool:
        """``kind`` of unit ``u`` lives on NVMe (its host copy is a staging copy)."""
        return u is not None and self.state_tier(kind, u) == "nvme"

    def order(self, phase: str) -> list[int]:
        """The units in a phase's issue order: 0..L-1 forward, L-1..0 otherwise."""
        return list(range(self.n_units)) if phase == "forward" else list(range(self.n_units - 1, -1, -1))

    @functools.cached_property
    def extras_elems(self) -> int:
        """Elements of one micro-batch's extras (masks, rotary tables; on unit 0's spec)."""
        first = self.specs[0]
        return self.batch * first.extras_elems_per_seq + first.extras_elems_per_batch

    @functools.cached_property
    def extras_holder(self) -> int:
        """The unit whose ``act`` counts the micro-batch's extras: the runtime holds them from the
        micro-batch's first forward to its last backward, the first trained unit's, whose ``act``
        lives until then (unit 0's when it trains; a frozen embedding's is freed after the next
        forward)."""
        return next((u for u, needs in enumerate(self.needs_backward) if needs), 0)

    def has_master(self, u: int) -> bool:
        """An fp32 master copy lives with the optimizer state: in mixed precision, and whenever the
        optimizer or the parameters are off the device (the step then never reads the shard).
        Never for a unit that does not train: its parameters are their own truth."""
        if not self.trains[u]:
            return False
        return self.precision != "fp32" or self.optim_tier(u) != "device" or self.param_tier(u) != "device"

    def home_param(self, u: int) -> str:
        if self.stage < 3:
            return buffer_name("param_full", u)
        return home_name("param_shard", u, self.param_tier(u))

    def home_grad(self, u: int) -> str | None:
        if not self.trains[u]:
            return None
        if self.stage < 2:
            return buffer_name("grad_full", u)
        return home_name("grad_shard", u, self.grad_home(u))

    def home_optim(self, u: int) -> str | None:
        return home_name("optim", u, self.optim_tier(u)) if self.trains[u] else None

    def model_state_names(self) -> list[str]:
        """The buffers a training step holds throughout: each unit's homes, the loss, the norm."""
        out = []
        for u in range(self.n_units):
            out += [name for name in (self.home_param(u), self.home_grad(u), self.home_optim(u)) if name]
        return out + ["loss"] + (["norm"] if self.clip else [])


def home_name(kind: str, u: int, tier: str) -> str:
    """The buffer of a unit's state at home on ``tier`` (a device buffer's name has no tier)."""
    return buffer_name(kind, u, None if tier == "device" else tier)


def frozen_of(schedule: Schedule, units: list[UnitSpec]) -> list[list[bool]]:
    """Per unit, per parameter: frozen by ``freeze`` (see zdsl/model/freeze.py)."""
    if not schedule.freeze:
        return [[False] * len(spec.params) for spec in units]
    try:
        return frozen_params(units, schedule.freeze)
    except FreezeError as exc:
        error = LoweringError(str(exc), hint=exc.hint)
        error.span = schedule.spans.get("freeze")
        raise error from None
