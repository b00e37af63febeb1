"""Pipelines to a task graph: instantiate every template for every unit.

Rules (the language reference repeats them for users):

* **Issue order.** Per micro-batch, the forward template runs for units in
  order 0..L-1 and the backward template for L-1..0; the step template runs
  for L-1..0 woven into the last micro-batch's backward, each unit ``lag``
  units behind its backward (see ``run_backward_and_step``), or after it
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
  (``zdsl/compile/layout.py``).
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
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from zdsl.ir import OP_LANES
from zdsl.ir import Buffer
from zdsl.ir import Op
from zdsl.ir import TaskGraph
from zdsl.ir import UnitInfo
from zdsl.ir import buffer_name
from zdsl.ir import optimizer_bytes_per_param
from zdsl.ir import parse_buffer_name
from zdsl.compile.layout import flat_layout
from zdsl.compile.layout import flat_ranges
from zdsl.compile.decay import NoDecayError
from zdsl.compile.decay import decay_groups
from zdsl.compile.freeze import FreezeError
from zdsl.compile.freeze import frozen_params
from zdsl.compile import residency
from zdsl.compile.pinning import host_pinned
from zdsl.schedule import Pipeline
from zdsl.schedule import PHASES
from zdsl.schedule import STATES
from zdsl.schedule import PipeStmt
from zdsl.schedule import Schedule
from zdsl.compile.units import UnitSpec
from zdsl.ir import DTYPE_BYTES

TIER_OF = {"device": "device", "cpu": "host", "host": "host", "nvme": "nvme"}


class LoweringError(Exception):
    """A pipeline statement that cannot be instantiated; carries its span."""

    def __init__(self, message: str, stmt: PipeStmt | None = None, hint: str | None = None):
        super().__init__(message)
        self.span = stmt.span if stmt is not None else None
        self.hint = hint


@dataclass
class _Draft:
    kind: str
    lane: str
    unit: int | None
    reads: list[str]
    writes: list[str]
    phase: str
    micro: int
    bytes: int = 0
    flops: float = 0.0
    kernels: int = 0
    part: int = 0
    parts: int = 1
    accumulate: bool = False
    span: tuple[int, int] | None = None
    fresh: set[str] = field(default_factory=set)   # writes that start a new instance of the buffer


class _Builder:
    def __init__(self, schedule: Schedule, units: list[UnitSpec], keep: frozenset = frozenset(),
                 read_ahead: int = 0, rehome: frozenset = frozenset()):
        self.schedule = schedule
        self.read_ahead = read_ahead             # step optimizer reads woven into the backward (read_optimizer_ahead)
        self.keep = keep                         # (host copy, end): frees left out (zdsl/compile/residency.py)
        self.resting: set[str] = set()           # kept copies between their left-out free and next read
        self.ends: dict[str, int] = {}           # host copy of NVMe state -> frees issued (or left out) so far
        self.free_drafts: list[tuple[_Draft, str, int]] = []
        self.specs = units
        self.n_units = len(units)
        self.ranks = schedule.ranks
        self.precision = schedule.train.precision
        self.elem_bytes = DTYPE_BYTES[self.precision]
        self.batch = schedule.train.batch
        bucket_elems = schedule.bucket_bytes // self.elem_bytes if schedule.bucket_bytes else 0
        self.frozen = self._frozen()
        # a partly frozen unit lays its trainable parameters first (zdsl/compile/layout.py)
        self.layouts = [flat_layout(spec.numel, self.ranks, bucket_elems, [math.prod(s) for _, s in spec.params], row)
                        for spec, row in zip(units, self.frozen)]
        self.tiers = {state: self._unit_tiers(state) for state in STATES}
        self.rehome = rehome             # (state, unit) on NVMe held on the host through the cycle (residency)
        for state, u in rehome:
            self.tiers[state][u] = "host"
        self.drafts: list[_Draft] = []
        self.buffers: dict[str, Buffer] = {}
        self.live: set[str] = set()
        self.stale: set[str] = set()
        self.producer_lane: dict[str, str] = {}
        self.waiting_users: dict[int, set[int]] = {}   # unit -> tied users gathered but not yet computed
        self.clip = schedule.optimizer.clip is not None or self.precision == "fp16"
        self.recompute = set(schedule.recompute)
        self.persist = {i for i, spec in enumerate(units)
                        if schedule.stage == 3 and schedule.persist_below and spec.numel < schedule.persist_below}
        # a unit trains when some parameter of it does: only those have gradients, optimizer state,
        # reductions and a step; a backward is needed by a unit that trains or one before it (it
        # hands back the input gradient), or whose tied parameters train
        self.trains = [not all(row) for row in self.frozen] if schedule.freeze else [True] * self.n_units
        self.needs_backward = [self.trains[u] or any(self.trains[j] for j in spec.uses) for u, spec in enumerate(units)]
        for u in range(1, self.n_units):
            self.needs_backward[u] = self.needs_backward[u] or self.needs_backward[u - 1]

    def _frozen(self) -> list[list[bool]]:
        """Per unit, per parameter: frozen by ``freeze`` (see zdsl/compile/freeze.py)."""
        if not self.schedule.freeze:
            return [[False] * len(spec.params) for spec in self.specs]
        try:
            return frozen_params(self.specs, self.schedule.freeze)
        except FreezeError as exc:
            error = LoweringError(str(exc), hint=exc.hint)
            error.span = self.schedule.spans.get("freeze")
            raise error from None

    # -- placement -------------------------------------------------------------
    def _unit_tiers(self, state: str) -> list[str]:
        """Home tier of ``state`` for each unit; ``ratio`` offloads the last units."""
        placed = self.schedule.placed(state)
        tier = TIER_OF[placed.tier]
        if tier == "device":
            return ["device"] * self.n_units
        offloaded = max(1, round(placed.ratio * self.n_units)) if placed.ratio < 1 else self.n_units
        return ["device" if i < self.n_units - offloaded else tier for i in range(self.n_units)]

    def optim_tier(self, u: int) -> str:
        return self.tiers["optimizer"][u]

    def param_tier(self, u: int) -> str:
        return self.tiers["parameters"][u] if self.schedule.stage == 3 else "device"

    def grad_home(self, u: int) -> str:
        """Where a unit's gradient shard accumulates (stages 2-3)."""
        offloaded = self.tiers["gradients"][u] != "device" or self.optim_tier(u) != "device"
        return "host" if offloaded else "device"

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

    # -- buffers ---------------------------------------------------------------
    def home_param(self, u: int) -> str:
        if self.schedule.stage < 3:
            return buffer_name("param_full", u)
        tier = self.param_tier(u)
        return buffer_name("param_shard", u, None if tier == "device" else tier)

    def home_grad(self, u: int) -> str | None:
        if not self.trains[u]:
            return None
        if self.schedule.stage < 2:
            return buffer_name("grad_full", u)
        tier = self.grad_home(u)
        return buffer_name("grad_shard", u, None if tier == "device" else tier)

    def home_optim(self, u: int) -> str | None:
        if not self.trains[u]:
            return None
        tier = self.optim_tier(u)
        return buffer_name("optim", u, None if tier == "device" else tier)

    def persistent_names(self) -> list[str]:
        out = []
        for u in range(self.n_units):
            out += [name for name in (self.home_param(u), self.home_grad(u), self.home_optim(u)) if name]
        return out + ["loss"] + (["norm"] if self.clip else [])

    def buffer(self, name: str) -> Buffer:
        if name in self.buffers:
            return self.buffers[name]
        kind, u, suffix = parse_buffer_name(name)
        tier = suffix or "device"
        layout = self.layouts[u] if u is not None else None
        spec = self.specs[u] if u is not None else None
        elem_bytes, dtype = self.elem_bytes, self.precision
        if kind == "param_full":
            nbytes = layout.padded_numel * elem_bytes
        elif kind == "param_shard":
            nbytes = layout.shard_numel * elem_bytes
        elif kind == "grad_full":       # gradients and optimizer state: the trainable parts only
            nbytes = layout.trainable_numel * elem_bytes
        elif kind == "grad_shard":
            nbytes = layout.trainable_shard_numel * elem_bytes
        elif kind == "optim":
            numel = layout.trainable_numel if self.schedule.stage == 0 else layout.trainable_shard_numel
            optimizer = self.schedule.optimizer
            nbytes = numel * optimizer_bytes_per_param(optimizer.kind, optimizer.momentum, self.has_master(u))
            dtype = "fp32"
        elif kind == "act":
            keeps = u not in self.recompute and self.needs_backward[u]   # autograd's saved tensors
            elems = spec.input_elems_per_seq + (spec.act_elems(elem_bytes) if keeps else 0)
            nbytes = (self.batch * elems + (self.extras_elems if u == self.extras_holder else 0)) * elem_bytes
        elif kind == "act_inner":
            nbytes = self.batch * spec.act_elems(elem_bytes) * elem_bytes
        elif kind == "act_grad":
            nbytes = self.batch * spec.input_elems_per_seq * elem_bytes
        elif kind in ("norm", "loss"):
            nbytes, dtype = 4, "fp32"
        else:  # token
            nbytes = 0
        buf = Buffer(name, kind, u, tier, nbytes, persistent=name in self._persistent, dtype=dtype,
                     pinned=host_pinned(self.schedule, self.tiers, kind, u, tier))
        self.buffers[name] = buf
        return buf

    # -- emission --------------------------------------------------------------
    def emit(self, draft: _Draft) -> None:
        for name in draft.reads + draft.writes:
            self.buffer(name)
        for name in draft.writes:
            self.resting.discard(name)
            if draft.kind == "mem.free":
                self.live.discard(name)
                continue
            if name not in self.live and not self.buffers[name].persistent:
                self.producer_lane[name] = draft.lane
            self.live.add(name)
            if draft.kind == "comm.all_gather":
                self.stale.discard(name)
        self.drafts.append(draft)

    def is_valid(self, name: str) -> bool:
        """Holds data now: persistent model state, or a live working buffer."""
        return name in self._persistent or (name in self.live and name not in self.resting)

    def draft(self, kind, unit, reads, writes, phase, micro, stmt, lane=None, **kw) -> _Draft:
        span = (stmt.span.line, stmt.span.column) if stmt is not None and stmt.span else None
        return _Draft(kind, lane or OP_LANES[kind], unit, list(reads), list(writes), phase, micro,
                      span=span, **kw)

    def collective(self, kind, u, reads, writes, phase, micro, stmt, accumulate=False, trained=False):
        """One op per part: every part for a gather, the trainable ones for a gradient reduction
        or a gather of what a step updated (``trained``)."""
        layout = self.layouts[u]
        parts = layout.parts if kind == "comm.all_gather" and not trained else layout.trainable_parts
        for part in range(parts):
            self.emit(self.draft(kind, u, reads, writes, phase, micro, stmt,
                                 bytes=layout.part_size(part) * self.elem_bytes,
                                 part=part, parts=parts, accumulate=accumulate))

    def gather(self, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
        full = buffer_name("param_full", u)
        if self.schedule.stage == 0:
            return
        if self.schedule.stage == 3:
            if not (self.is_valid(full) and full not in self.stale):
                src = self.device_shard(u, phase, micro, stmt)
                self.collective("comm.all_gather", u, [src], [full], phase, micro, stmt)
                self.consume(src, phase, micro)
            for j in self.specs[u].uses:
                self.gather(j, phase, micro, stmt)
                self.waiting_users.setdefault(j, set()).add(u)
            return
        src = buffer_name("param_shard", u)   # stages 1-2: the shard a step just updated
        if src in self.live:                  # (its trainable parts: the frozen ones never change)
            self.collective("comm.all_gather", u, [src], [full], phase, micro, stmt, trained=True)
            self.consume(src, phase, micro)

    def device_shard(self, u: int, phase: str, micro: int, stmt: PipeStmt) -> str:
        """The device copy of a unit's parameter shard, fetched now if no statement brought it
        (a tied unit gathered for its user, or a template that omits the read or copy)."""
        dev, host = buffer_name("param_shard", u), buffer_name("param_shard", u, "host")
        tier = self.param_tier(u)
        if tier == "device" or self.is_valid(dev):
            return dev
        if tier == "nvme" and not self.is_valid(host):
            self.read_nvme("param_shard", u, phase, micro, stmt)
        self.emit(self.draft("copy.h2d", u, [host], [dev], phase, micro, stmt,
                             bytes=self.layouts[u].shard_numel * self.elem_bytes, fresh={dev}))
        if tier == "nvme":
            self.consume(host, phase, micro)
        return dev

    def consume(self, name: str, phase: str, micro: int) -> None:
        """A staging copy of a shard is used up by the copy or collective that reads it."""
        self.free(name, phase, micro, None)

    def free(self, name: str, phase: str, micro: int, stmt: PipeStmt) -> None:
        if not self.is_valid(name) or name in self._persistent:
            return
        kind, u, tier = parse_buffer_name(name)
        if kind == "param_full" and self.waiting_users.get(u):
            return   # a tied user gathered it ahead and has not computed yet: its last use frees it
        end = None
        if tier == "host" and self.nvme_home(kind, u):
            end = self.ends.get(name, 0)
            self.ends[name] = end + 1
            if (name, end) in self.keep:
                self.resting.add(name)
                return
        lane = self.producer_lane.get(name, "compute")
        draft = self.draft("mem.free", self.buffers[name].unit, [], [name], phase, micro, stmt, lane=lane)
        self.emit(draft)
        if end is not None:
            self.free_drafts.append((draft, name, end))

    def nvme_home(self, kind: str, u: int | None) -> bool:
        """``kind`` of unit ``u`` lives on NVMe (its host copy is a staging copy)."""
        if u is None:
            return False
        home = {"param_shard": self.param_tier, "optim": self.optim_tier,
                "grad_shard": lambda j: self.tiers["gradients"][j]}.get(kind)
        return home is not None and home(u) == "nvme"

    def read_nvme(self, kind: str, u: int, phase: str, micro: int, stmt: PipeStmt | None) -> None:
        """Bring ``kind`` of unit ``u`` from NVMe to its host copy; a resting (kept) copy is
        already there, and is live again instead."""
        host = buffer_name(kind, u, "host")
        if host in self.resting:
            self.resting.discard(host)
            return
        on_disk = buffer_name(kind, u, "nvme")
        self.emit(self.draft("nvme.read", u, [on_disk], [host], phase, micro, stmt,
                             bytes=self.buffer(on_disk).bytes, fresh={host}))

    def free_positions(self) -> dict[int, tuple[str, int]]:
        """Graph position -> (host copy, end) of every free of a host copy of NVMe state."""
        position = {id(draft): i for i, draft in enumerate(self.drafts)}
        return {position[id(draft)]: (name, end) for draft, name, end in self.free_drafts}

    def frozen_skips(self, verb: str, state: str, u: int, phase: str) -> bool:
        """A statement a frozen unit does not need: anything in a backward it does not need,
        and the reductions, gradient and optimizer moves and step of a unit that does not
        train (frees always run: they drop what is no longer needed)."""
        if verb == "free":
            return False
        if phase == "backward" and not self.needs_backward[u]:
            return True
        return not self.trains[u] and (phase == "step" or verb in ("scatter", "reduce")
                                       or state in ("gradients", "optimizer"))

    def run_stmt(self, stmt: PipeStmt, u: int, phase: str, micro: int) -> None:
        verb, state = stmt.verb, stmt.ref.state
        if self.frozen_skips(verb, state, u, phase):
            return
        last_micro = micro == self.schedule.train.accumulate - 1
        stage = self.schedule.stage
        if verb == "compute":
            self.compute(u, phase, micro, stmt)
        elif verb == "recompute":
            if u in self.recompute and phase == "backward":
                reads = [buffer_name("act", u), *self.param_reads(u)]
                self.emit(self.draft("compute.recompute", u, reads, [buffer_name("act_inner", u)], phase, micro, stmt,
                                     flops=self.specs[u].fwd_flops_per_seq * self.batch,
                                     kernels=self.specs[u].fwd_kernels, fresh={buffer_name("act_inner", u)}))
        elif verb == "step":
            self.step(u, micro, stmt)
        elif verb == "gather":
            self._need(state, "parameters", stmt)
            self.gather(u, phase, micro, stmt)
        elif verb == "free":
            target = {"parameters": "param_full", "gradients": "grad_full",
                      "activations": "act", "optimizer": "optim"}.get(state)
            if target is None:
                raise LoweringError(f"cannot free {state}", stmt)
            if target == "param_full" and phase == "forward" and u in self.persist:
                return   # persistent units stay gathered until their backward
            self.free(buffer_name(target, u), phase, micro, stmt)
        elif verb == "scatter":
            self._need(state, "gradients", stmt)
            if stage == 0:
                raise LoweringError("scatter needs sharded gradients or optimizer state (zero 1 or more)", stmt,
                                    "use `reduce gradients[u]` at zero 0")
            if stage == 1 and not last_micro:
                return
            dst = buffer_name("grad_shard", u)
            accumulate = stage >= 2 and micro > 0 and self.grad_home(u) == "device"
            first = len(self.drafts)
            self.collective("comm.reduce_scatter", u, [buffer_name("grad_full", u)], [dst], phase, micro, stmt,
                            accumulate=accumulate)
            if not accumulate:      # the first part starts the shard's new instance; the others fill it
                self.drafts[first].fresh.add(dst)
        elif verb == "reduce":
            self._need(state, "gradients", stmt)
            if stage != 0:
                raise LoweringError("reduce (all-reduce) keeps full gradients; it is for zero 0", stmt,
                                    "use `scatter gradients[u]` when gradients are sharded")
            if last_micro:
                grad = buffer_name("grad_full", u)
                self.collective("comm.all_reduce", u, [grad], [grad], phase, micro, stmt)
        elif verb == "copy":
            self.copy(state, u, stmt.tier, phase, micro, stmt)
        elif verb in ("read", "write"):
            self.nvme(verb, state, u, phase, micro, stmt)
        else:
            raise LoweringError(f"unknown statement {verb!r}", stmt)

    def _need(self, state: str, want: str, stmt: PipeStmt) -> None:
        if state != want:
            raise LoweringError(f"`{stmt.verb}` acts on {want}, not {state}", stmt, f"write `{stmt.verb} {want}[u]`")

    def param_reads(self, u: int) -> list[str]:
        return [buffer_name("param_full", j) for j in (u, *self.specs[u].uses)]

    def compute(self, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
        spec, last_unit = self.specs[u], self.n_units - 1
        for j in spec.uses:
            self.waiting_users.get(j, set()).discard(u)
        flops = spec.fwd_flops_per_seq * self.batch
        if phase == "forward":
            reads = ([buffer_name("act", u - 1)] if u > 0 else []) + self.param_reads(u)
            writes = [buffer_name("act", u)] + (["loss"] if u == last_unit else [])
            self.emit(self.draft("compute.forward", u, reads, writes, phase, micro, stmt, flops=flops,
                                 kernels=spec.fwd_kernels, fresh={buffer_name("act", u)}))
        elif phase == "backward":
            reads = [buffer_name("act", u)]
            if u in self.recompute:
                reads.append(buffer_name("act_inner", u))
            if u < last_unit:
                reads.append(buffer_name("act_grad", u + 1))
            reads += self.param_reads(u)
            grads = [buffer_name("grad_full", j) for j in (u, *spec.uses) if self.trains[j]]
            hands_back = u > 0 and self.needs_backward[u - 1]   # an earlier unit's backward needs its input gradient
            writes = grads + ([buffer_name("act_grad", u)] if hands_back else [])
            # backward accumulates into full gradients, so it also reads them
            held = [grad for grad in grads if self.is_valid(grad)]
            fresh = {buffer_name("act_grad", u)} | {grad for grad in grads if not self.is_valid(grad)}
            # without gradients of its own, a backward computes only the input gradient
            self.emit(self.draft("compute.backward", u, reads + held, writes, phase, micro, stmt,
                                 flops=(2 if self.trains[u] else 1) * flops, kernels=spec.bwd_kernels, fresh=fresh))
        else:
            raise LoweringError("`compute` belongs in a forward or backward template", stmt,
                                "the step template uses `step u`")

    def step(self, u: int, micro: int, stmt: PipeStmt) -> None:
        if not self.trains[u]:
            return
        stage = self.schedule.stage
        on_host = stmt.tier == "cpu" and self.optim_tier(u) != "device"
        shard_tier = "host" if on_host else None
        grad = buffer_name("grad_full", u) if stage == 0 else buffer_name("grad_shard", u, shard_tier)
        optim = self.home_optim(u)
        if self.optim_tier(u) == "nvme":
            optim = buffer_name("optim", u, "host")
        reads = [grad, optim] + (["norm"] if self.clip else [])
        writes = [optim]
        if stage == 0:
            dest = buffer_name("param_full", u)
            reads.append(dest)
        else:
            dest = buffer_name("param_shard", u, shard_tier)
            # without a master the step updates the current parameters; at stage 3 a partly frozen
            # unit's fresh copy (not the home) also carries the frozen parts on from them
            carries = stage == 3 and self.layouts[u].frozen_parts and dest != self.home_param(u)
            if not self.has_master(u) or carries:
                reads.append(buffer_name("param_full", u) if stage < 3 else self.home_param(u))
            self.stale.add(buffer_name("param_full", u))
        writes.append(dest)
        layout = self.layouts[u]
        numel = layout.trainable_numel if stage == 0 else layout.trainable_shard_numel
        optimizer = self.schedule.optimizer
        per_param = optimizer_bytes_per_param(optimizer.kind, optimizer.momentum, self.has_master(u))
        state_bytes = numel * (per_param + 2 * self.elem_bytes)
        self.emit(self.draft("compute.step", u, reads, writes, "step", micro, stmt,
                             lane="host" if on_host else "compute", bytes=state_bytes, flops=12.0 * numel,
                             fresh={dest} if dest not in self._persistent else set()))

    def copy(self, state: str, u: int, to: str | None, phase: str, micro: int, stmt: PipeStmt) -> None:
        if to not in ("host", "device"):
            raise LoweringError("copy goes `to host` or `to device`", stmt)
        stage, last_micro = self.schedule.stage, micro == self.schedule.train.accumulate - 1
        if state == "parameters":
            dev, host = buffer_name("param_shard", u), buffer_name("param_shard", u, "host")
            if to == "device":
                if stage == 3 and self.param_tier(u) == "device" and phase != "step":
                    return
                if not self.is_valid(host) or (dev in self.live and phase != "step"):
                    return
                self.emit(self.draft("copy.h2d", u, [host], [dev], phase, micro, stmt,
                                     bytes=self.layouts[u].shard_numel * self.elem_bytes, fresh={dev}))
                self.consume(host, phase, micro)
            else:
                if not self.is_valid(dev) or self.param_tier(u) == "device":
                    return
                self.emit(self.draft("copy.d2h", u, [dev], [host], phase, micro, stmt,
                                     bytes=self.layouts[u].shard_numel * self.elem_bytes))
        elif state == "gradients":
            if to != "host" or (self.grad_home(u) == "device" and self.optim_tier(u) == "device"):
                return
            src = buffer_name("grad_full", u) if stage == 0 else buffer_name("grad_shard", u)
            if not self.is_valid(src) or (stage < 2 and not last_micro):
                return
            if stage == 0:
                raise LoweringError("gradients move to the host only when sharded (zero 1 or more)", stmt)
            dst = buffer_name("grad_shard", u, "host")
            accumulate = stage >= 2 and micro > 0
            self.emit(self.draft("copy.d2h", u, [src], [dst], phase, micro, stmt, accumulate=accumulate,
                                 bytes=self.layouts[u].trainable_shard_numel * self.elem_bytes,
                                 fresh=set() if accumulate else {dst}))
        elif state == "activations":
            act, act_host = buffer_name("act", u), buffer_name("act", u, "host")
            kind, src, dst = ("copy.d2h", act, act_host) if to == "host" else ("copy.h2d", act_host, act)
            if self.is_valid(src):
                self.emit(self.draft(kind, u, [src], [dst], phase, micro, stmt,
                                     bytes=self.buffer(act).bytes, fresh={dst}))
                self.free(src, phase, micro, None)
        else:
            raise LoweringError(f"cannot copy {state}", stmt)

    def nvme(self, verb: str, state: str, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
        if stmt.tier not in (None, "nvme"):
            raise LoweringError(f"{verb} moves state {'from' if verb == 'read' else 'to'} nvme", stmt)
        kind = {"parameters": "param_shard", "optimizer": "optim", "gradients": "grad_shard"}.get(state)
        if kind is None:
            raise LoweringError(f"cannot {verb} {state} on nvme", stmt)
        home = {"param_shard": self.param_tier(u), "optim": self.optim_tier(u),
                "grad_shard": self.tiers["gradients"][u]}[kind]
        if home != "nvme":
            return
        on_disk, host = buffer_name(kind, u, "nvme"), buffer_name(kind, u, "host")
        nbytes = self.buffer(on_disk).bytes
        if verb == "read":
            if not self.is_valid(host):
                self.read_nvme(kind, u, phase, micro, stmt)
        else:
            if not self.is_valid(host):
                return
            self.emit(self.draft("nvme.write", u, [host], [on_disk], phase, micro, stmt, bytes=nbytes))

    # -- phases ----------------------------------------------------------------
    def phase_slots(self, pipe: Pipeline, phase: str) -> list[list[tuple[PipeStmt, int]]]:
        """What one phase emits, in order: one slot of (statement, unit) per position in the
        phase's unit order, and a last slot for the statements that lag behind (epilogue)."""
        order = self.order(phase)
        direction = 1 if phase == "forward" else -1
        n_units = self.n_units
        slots: list[list[tuple[PipeStmt, int]]] = [[] for _ in range(n_units + 1)]
        for i in range(n_units):
            for stmt in pipe.body:
                if stmt.ref.absolute is not None:
                    if i == 0:
                        slots[i].append((stmt, self._check_unit(stmt.ref.absolute, stmt)))
                    continue
                ahead = stmt.ref.offset * direction
                targets = range(0, ahead + 1) if (ahead > 0 and i == 0) else [i + ahead]
                for pos in targets:
                    if 0 <= pos < n_units:
                        slots[i].append((stmt, order[pos]))
        for stmt in pipe.body:   # epilogue: statements that lag behind
            if stmt.ref.absolute is None:
                ahead = stmt.ref.offset * direction
                if ahead < 0:
                    for pos in range(n_units + ahead, n_units):
                        if 0 <= pos < n_units:
                            slots[n_units].append((stmt, order[pos]))
        return slots

    def order(self, phase: str) -> list[int]:
        return list(range(self.n_units)) if phase == "forward" else list(range(self.n_units - 1, -1, -1))

    def run_phase(self, pipe: Pipeline, phase: str, micro: int) -> None:
        if phase == "step" and self.clip:
            self.norm(micro)
        for slot in self.phase_slots(pipe, phase):
            for stmt, u in slot:
                self.run_stmt(stmt, u, phase, micro)

    def run_backward_and_step(self, backward: Pipeline, step: Pipeline, micro: int) -> None:
        """The last backward with each unit's step woven in, ``lag`` units behind it.

        Why: a unit's gradient is final once its backward (and reduction) is done, so its
        step need not wait for the whole backward; with offloaded optimizer state the
        reads, the host step and the writes then overlap the rest of the backward instead
        of forming one serial tail (a trace of programs/nvme.zs: the NVMe lane idle for a
        third of the backward, then every read, step and write in a row). The bits are
        those of stepping after the backward: each unit's step reads its own gradient.
        Only without clipping or fp16 loss scaling, whose global norm or overflow check
        needs every gradient first (``self.clip``). A unit whose parameters another unit
        uses (a tied weight) steps only after that unit's backward; ``lag`` keeps the
        backward's own prefetches ahead of the step's writes on a shared lane.
        """
        order = self.order("backward")
        position = {u: i for i, u in enumerate(order)}
        lag = max(1, self.schedule.prefetch)
        backward_slots, step_slots = self.phase_slots(backward, "backward"), self.phase_slots(step, "step")
        last_user = [position[u] for u in range(self.n_units)]   # unit -> backward position of its last user
        for user in range(self.n_units):
            for used in self.specs[user].uses:
                last_user[used] = max(last_user[used], position[user])
        # after which backward slot each step slot may go: its unit's last user, plus lag; kept
        # in order so the step's own offsets (read optimizer[u-k]) stay as written
        after, ready = [], 0
        for i in range(self.n_units):
            ready = max(ready, last_user[order[i]] + lag)
            after.append(min(ready, self.n_units - 1))
        next_step = 0
        for i in range(self.n_units):
            for stmt, u in backward_slots[i]:
                self.run_stmt(stmt, u, "backward", micro)
            while next_step < self.n_units and after[next_step] <= i:
                for stmt, u in step_slots[next_step]:
                    self.run_stmt(stmt, u, "step", micro)
                next_step += 1
        for stmt, u in backward_slots[self.n_units]:
            self.run_stmt(stmt, u, "backward", micro)
        for slot in step_slots[next_step:]:
            for stmt, u in slot:
                self.run_stmt(stmt, u, "step", micro)

    def run_backward_reading_ahead(self, backward: Pipeline, step: Pipeline, micro: int) -> None:
        """The last backward with the step's first ``read_ahead`` NVMe optimizer reads woven in,
        one after each unit's backward statements; the step finds those copies on the host.

        Why: with clipping or fp16 every unit's step waits for the global norm, after the whole
        backward, and the step's reads then queue on the one NVMe lane behind the writes of the
        units stepped before them, while the disk sat idle through the backward (a trace of
        programs/capacity.zs: the step's tail was read, step, write, unit after unit). The host
        budget decides how many copies can wait there (:func:`read_optimizer_ahead`).
        """
        first: dict[int, PipeStmt] = {}
        for slot in self.phase_slots(step, "step"):
            for stmt, u in slot:
                if stmt.verb == "read" and stmt.ref.state == "optimizer" and stmt.tier in (None, "nvme"):
                    first.setdefault(u, stmt)
        early = list(first.items())[: self.read_ahead]
        for i, slot in enumerate(self.phase_slots(backward, "backward")):
            for stmt, u in slot:
                self.run_stmt(stmt, u, "backward", micro)
            if i < len(early):
                u, stmt = early[i]
                self.run_stmt(stmt, u, "step", micro)

    def _check_unit(self, u: int, stmt: PipeStmt) -> int:
        if not 0 <= u < self.n_units:
            raise LoweringError(f"unit {u} does not exist (the model has units 0..{self.n_units - 1})", stmt)
        return u

    def norm(self, micro: int) -> None:
        """The global gradient norm (clip, fp16's overflow check) after the last backward.

        With sharded gradients (stage >= 1) each unit's squared norm is its own op, on the lane
        that holds its gradient, and ``norm`` sums them in unit order: the same values summed
        the same way as one op over every gradient, but each part runs as soon as its gradient
        is final, during the rest of the backward, instead of all of them after it (on
        programs/capacity.zs the one op took 2.5 s with the disk and compute idle)."""
        stage = self.schedule.stage
        training = [u for u in range(self.n_units) if self.trains[u]]
        all_host = all(self.optim_tier(u) != "device" for u in training)
        lane = "host" if all_host else "compute"
        shard_numel = sum(self.layouts[u].trainable_shard_numel for u in training)
        if stage == 0:
            reads = [buffer_name("grad_full", u) for u in training]
            self.emit(self.draft("compute.norm", None, reads, ["norm"], "step", micro, None, lane=lane,
                                 flops=2.0 * shard_numel))
            return
        parts = {}
        for u in self.order("backward"):
            if not self.trains[u]:
                continue
            on_host = self.optim_tier(u) != "device"
            parts[u] = buffer_name("norm", u, "host" if on_host else None)
            self.emit(self.draft("compute.norm", u, [buffer_name("grad_shard", u, "host" if on_host else None)],
                                 [parts[u]], "step", micro, None, lane="host" if on_host else "compute",
                                 flops=2.0 * self.layouts[u].trainable_shard_numel))
        self.emit(self.draft("compute.norm", None, [parts[u] for u in training], ["norm"], "step", micro, None,
                             lane=lane, flops=float(len(training))))
        self.emit(self.draft("comm.all_reduce", None, ["norm"], ["norm"], "step", micro, None, bytes=4))

    def build(self, pipelines: dict[str, Pipeline]) -> TaskGraph:
        self._persistent = set(self.persistent_names())
        for name in self._persistent:
            self.buffer(name)
        last = self.schedule.train.accumulate - 1
        for micro in range(last + 1):
            self.run_phase(pipelines["forward"], "forward", micro)
            if micro == last and not self.clip and self.n_units > 1:
                self.run_backward_and_step(pipelines["backward"], pipelines["step"], micro)
            elif micro == last and self.read_ahead:
                self.run_backward_reading_ahead(pipelines["backward"], pipelines["step"], micro)
            else:
                self.run_phase(pipelines["backward"], "backward", micro)
        if self.clip or self.n_units <= 1:
            self.run_phase(pipelines["step"], "step", last)
        self.apply_overlap_policy()
        self.auto_free()
        ops = self.finish()
        config = self.schedule.to_config()
        if self.read_ahead:
            config["read_ahead"] = self.read_ahead
        return TaskGraph(
            schedule=self.schedule.name, ranks=self.ranks, stage=self.schedule.stage, precision=self.precision,
            accumulate=self.schedule.train.accumulate, units=self.unit_infos(), buffers=self.buffers, ops=ops,
            config=config)

    def apply_overlap_policy(self) -> None:
        verbs = {"comm.all_gather": "gather", "comm.reduce_scatter": "scatter", "comm.all_reduce": "reduce",
                 "nvme.read": "read", "nvme.write": "write", "copy.h2d": "copy", "copy.d2h": "copy"}
        forbidden = {(verb, phase) for verb in set(verbs.values()) for phase in PHASES
                     if f"{verb}/{phase}" not in self.schedule.overlap}
        if not forbidden:
            return
        phases = {phase for _, phase in forbidden}
        self.buffer("token")
        for draft in self.drafts:
            chained = (verbs.get(draft.kind), draft.phase) in forbidden or (
                draft.kind.startswith("compute.") and draft.phase in phases)
            if chained:
                draft.reads.append("token")
                draft.writes.append("token")

    def auto_free(self) -> None:
        """Free each working buffer instance that no statement frees, right after its last use."""
        out: list[_Draft] = []
        last_use: dict[str, int] = {}       # buffer -> index in `out` of its current instance's last use
        pending: dict[int, list[str]] = {}  # index in self.drafts -> buffers to free after it
        live: dict[str, None] = {}          # insertion-ordered: the graph must not depend on hashing
        # pass 1: find, for every instance, its last use
        for i, draft in enumerate(self.drafts):
            for name in draft.writes:
                if self.buffers[name].persistent or name == "token":
                    continue
                if draft.kind == "mem.free":
                    live.pop(name, None)
                    last_use.pop(name, None)
                    continue
                if name in live and name in draft.fresh and name not in draft.reads:
                    # a fresh write over an instance nobody freed: free it after its last use
                    j = last_use[name]
                    pending.setdefault(j, []).append(name)
                live[name] = None
                last_use[name] = i
            for name in draft.reads:
                if name in live:
                    last_use[name] = i
        for name in live:
            pending.setdefault(last_use[name], []).append(name)
        for i, draft in enumerate(self.drafts):
            out.append(draft)
            for name in pending.get(i, []):
                out.append(_Draft("mem.free", draft.lane, self.buffers[name].unit, [], [name], draft.phase,
                                  draft.micro))
        self.drafts = out

    def finish(self) -> list[Op]:
        ops: list[Op] = []
        last_write: dict[str, int] = {}
        readers: dict[str, list[int]] = {}
        for i, draft in enumerate(self.drafts):
            deps: set[int] = set()
            for name in draft.reads:
                if name in last_write:
                    deps.add(last_write[name])
            for name in draft.writes:
                if name in last_write:
                    deps.add(last_write[name])
                deps.update(readers.get(name, ()))
            for name in draft.reads:
                readers.setdefault(name, []).append(i)
            for name in draft.writes:
                last_write[name] = i
                readers[name] = []
            deps.discard(i)
            ops.append(Op(id=i, kind=draft.kind, lane=draft.lane, unit=draft.unit, reads=draft.reads,
                          writes=draft.writes, bytes=draft.bytes, flops=draft.flops, kernels=draft.kernels,
                          deps=sorted(deps), micro=draft.micro, phase=draft.phase, part=draft.part,
                          parts=draft.parts, accumulate=draft.accumulate, span=draft.span))
        return ops

    def decay_ranges(self) -> list[list[tuple[int, int]] | None]:
        """Per unit, the ranges weight decay applies to (None: all; see zdsl/compile/decay.py)."""
        o = self.schedule.optimizer
        if not (o.no_decay or o.no_decay_names):
            return [None] * self.n_units
        try:       # the groups' ranges are in registration order: placed where the layout puts them
            return [flat_ranges(layout, ranges) for layout, ranges in
                    zip(self.layouts, decay_groups(self.specs, o.no_decay, o.no_decay_names).ranges)]
        except NoDecayError as exc:
            error = LoweringError(str(exc), hint=exc.hint)
            error.span = self.schedule.spans.get("optimizer.no_decay")
            raise error from None

    def unit_infos(self) -> list[UnitInfo]:
        infos = []
        decay = self.decay_ranges()
        for i, (spec, layout) in enumerate(zip(self.specs, self.layouts)):
            infos.append(UnitInfo(
                index=i, name=spec.name, numel=spec.numel, padded_numel=layout.padded_numel,
                shard_numel=layout.shard_numel, parts=layout.parts, uses=list(spec.uses),
                recompute=i in self.recompute, persistent=i in self.persist,
                act_bytes=self.batch * spec.act_elems(self.elem_bytes) * self.elem_bytes,
                input_bytes=self.batch * spec.input_elems_per_seq * self.elem_bytes,
                fwd_flops=spec.fwd_flops_per_seq * self.batch, master=self.has_master(i), decay=decay[i],
                frozen=[k for k, f in enumerate(self.frozen[i]) if f] or None, trains=self.trains[i],
                frozen_parts=layout.frozen_parts, frozen_part_numel=layout.frozen_part_numel,
                runs=[list(r) for r in layout.runs] or None))
        return infos


def instantiate(schedule: Schedule, units: list[UnitSpec], pipelines: dict[str, Pipeline]) -> TaskGraph:
    """A checked schedule, its model's units and its lowered pipelines to the task graph of one
    step (``zdsl.driver.compile_schedule`` lowers first)."""
    builder = _Builder(schedule, units)
    graph = builder.build(pipelines)
    budget = (schedule.memory or {}).get("host")
    if not budget:
        return graph
    host = _HostBudget(schedule, units, pipelines, budget)
    built = host.read_optimizer_ahead(_Built(builder, graph, schedule.machine))
    lru = host.lru_of_the_whole_room(built)
    built, held = host.hold_through_cycle(built)
    if built.builder.free_drafts:
        graph, chosen = host.keep_resident(built, held)
    else:
        graph, chosen = built.graph, residency.Residency(budget=budget, held=held) if held else None
    if chosen is not None:
        graph.config["residency"] = chosen.to_json() | {"lru_saved_bytes": lru}
    return graph


@dataclass
class _Built:
    """A builder, the graph it built and that graph's simulated step, simulated once when first asked."""
    builder: _Builder
    graph: TaskGraph
    machine: object
    _sim: object = None

    @property
    def sim(self):
        if self._sim is None:
            from zdsl.planner.simulate import simulate
            self._sim = simulate(self.graph, self.machine)
        return self._sim

    @property
    def host_peak(self) -> int:
        return self.sim.memory.peak("host")


class _HostBudget:
    """The passes that fill ``memory host`` over NVMe-homed state, in the order ``instantiate``
    runs them: each rebuilds the graph with a choice and keeps it only where the rebuilt graph's
    simulated host peak stays within the budget (the verifier checks the same)."""

    def __init__(self, schedule: Schedule, units: list[UnitSpec], pipelines: dict[str, Pipeline], budget: int):
        self.schedule, self.units, self.pipelines, self.budget = schedule, units, pipelines, budget

    def build(self, **choices) -> _Built:
        builder = _Builder(self.schedule, self.units, **choices)
        return _Built(builder, builder.build(self.pipelines), self.schedule.machine)

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

    def read_optimizer_ahead(self, built: _Built) -> _Built:
        """With the step after the whole backward (clip, fp16) and optimizer state on NVMe: the
        graph rebuilt with as many of the step's optimizer reads woven into the backward as the
        budget holds until their steps (build() records the count in its config); else ``built``."""
        builder = built.builder
        on_nvme = [b.bytes for b in built.graph.buffers.values() if b.kind == "optim" and b.tier == "nvme"]
        if not (builder.clip and builder.n_units > 1 and on_nvme):
            return built
        room = self.budget - built.host_peak
        ahead = min(len(on_nvme), builder.n_units, max(0, room) // max(on_nvme))
        # each try reads at least one unit fewer ahead, so ``ahead`` tries reach none
        fitted = self.fit(ahead, lambda n: (n, self.build(read_ahead=n)) if n > 0 else None,
                          lambda n, excess: n - max(1, n // 4), tries=ahead)
        return fitted[1] if fitted else built

    def lru_of_the_whole_room(self, built: _Built) -> int:
        """What an LRU cache of the host room would save on ``built``, for the plan's comparison."""
        if not built.builder.free_drafts:
            return 0
        sim = built.sim
        host = sim.memory.tiers.get("host")
        if host is None:
            return 0
        return residency.lru_saved(built.graph, sim.start, sim.end, sim.step_s, host, self.budget,
                                   built.builder.free_positions())

    def hold_through_cycle(self, built: _Built) -> tuple[_Built, list]:
        """``built`` rebuilt with the NVMe state :func:`residency.hold_through_cycle` holds on the
        host in the room the budget leaves free all step (shrunk by any excess over the budget,
        choosing again), with what they were; else ``built`` and nothing held."""
        read_ahead = built.builder.read_ahead
        # the optimizer states the backward reads ahead already have their room (read_optimizer_ahead)
        ahead = read_ahead_units(built.graph) if read_ahead else set()
        candidates = [h for h in residency.cycle_candidates(built.graph, built.sim.start)
                      if not (h.state == "optimizer" and h.unit in ahead)]

        def rebuild(room: int):
            held = residency.hold_through_cycle(candidates, room)
            if not held:
                return None
            return held, self.build(read_ahead=read_ahead, rehome=frozenset((h.state, h.unit) for h in held))

        fitted = self.fit(self.budget - built.host_peak, rebuild, lambda room, excess: room - excess,
                          tries=residency.MAX_TRIES)
        return (fitted[1], fitted[0]) if fitted else (built, [])

    def keep_resident(self, built: _Built, cycle: list) -> tuple[TaskGraph, residency.Residency | None]:
        """``built``'s graph rebuilt with the host copies Belady's rule keeps under the budget
        (zdsl/compile/residency.py), or ``built``'s graph itself when none fits; either way with
        what the choice saves and the states ``cycle`` holds (None: nothing kept, nothing held).
        Where moving reads changed the timeline enough to go over the budget, the room shrinks
        by the excess and the choice is made again."""
        graph, sim, builder = built.graph, built.sim, built.builder
        gaps = residency.find_gaps(graph, sim.start, sim.end, sim.step_s, builder.free_positions())
        host = sim.memory.tiers.get("host")
        if host is None or not any(gap.reread for gap in gaps):
            return graph, residency.Residency(budget=self.budget, held=cycle) if cycle else None
        room = residency.Room(host.times, host.working, self.budget, host.model_states, gaps)

        def rebuild(margin: int):
            held = residency.belady(gaps, room, margin)
            if not held:
                return None
            return held, self.build(keep=frozenset((g.buffer, g.end) for g in held),
                                    read_ahead=builder.read_ahead, rehome=builder.rehome)

        fitted = self.fit(0, rebuild, lambda margin, excess: margin + excess, tries=residency.MAX_TRIES)
        held, kept = fitted if fitted else ([], built)
        return kept.graph, residency.summarize(gaps, held, room, self.budget, cycle)


def read_ahead_units(graph: TaskGraph) -> set[int]:
    """Units whose optimizer state the graph reads from NVMe before its first step."""
    out = set()
    for op in graph.ops:
        if op.kind == "compute.step":
            break
        if op.kind == "nvme.read" and any(name.startswith("optim[") for name in op.reads):
            out.add(op.unit)
    return out


def parameter_count(units: list[UnitSpec]) -> int:
    return sum(spec.numel for spec in units)

