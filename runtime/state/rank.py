"""One rank's training state, and the meaning of every op of the task graph.

:class:`RankState` owns every buffer the compiled graph names (parameters,
gradients, optimizer state, activations, staging copies on the host and on
NVMe) and executes single ops on them. It does not decide order: the trio
executor (``runtime/exec/executor.py``) runs ops when their dependencies are done,
and a plain loop over ``graph.ops`` is also a valid execution (graph order
respects every dependency). Entry points, by op kind:

* ``run_compute(op)``: ``compute.forward|backward|recompute|norm|step``;
  synchronous (the executor calls it in a worker thread).
* ``start_collective(op) -> handle``: ``comm.*``, issued with
  ``async_op=True``; the handle's ``is_completed()`` or ``wait()`` finishes
  the op (whichever the caller uses; both are safe to call).
* ``run_copy(op)``: ``copy.h2d|d2h``; ``run_nvme(op)``: ``nvme.read|write``.
* ``free(op)``: ``mem.free``.
* ``run_op(op)``: any op, synchronously (sequential drivers and tests).
* ``step_begin(step, batches)`` / ``step_end() -> dict`` around each step.

Semantics (the IR's, made concrete):

* Units run one at a time. Forward keeps a unit's input (detached, so
  autograd stops at the unit boundary) and its output; backward runs
  autograd for that one unit with the gradient of its output and leaves the
  gradient of its input in ``act_grad[u]``. A recomputed unit's forward runs
  without autograd and keeps only its input and output; ``compute.recompute``
  re-runs it with autograd (``act_inner[u]``), with the random generators as
  the forward found them (the same dropout masks, as torch.utils.checkpoint).
* Backward accumulates into ``grad_full`` (zero when allocated; the
  persistent ones of stages 0-1 are zeroed by ``step_begin``). Gradients are
  averaged as DDP does: multiplied by 1/world just before they are reduced
  (done by the last backward that writes them, so the comm lane only
  communicates), then summed; a gradient all-reduced a second time is
  scaled in the collective (see ``_plan_prescale``). The loss of a micro-batch is divided by
  ``accumulate`` inside the graph, as the DDP reference does.
* A tied parameter's gradient from its user (the head) reaches the owner's
  ``grad_full``; when that buffer already holds gradient (accumulation), the
  contribution waits for the owner's backward and both are added together,
  which is the order autograd uses on the whole model (so DDP's bits).
* ``compute.norm`` writes the global gradient norm: at stage 0 exactly as
  ``clip_grad_norm_`` computes it; when an all-reduce of ``norm`` follows,
  this rank's sum of squares (the step takes the square root).
* ``compute.step`` updates the parameters it writes from the gradient and
  optimizer buffers it reads (see ``runtime/state/optim.py``), after unscaling
  (fp16) and clipping; an fp16 overflow skips every unit's update.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn

from zdsl.ir import Buffer

from zdsl.ir import Op

from zdsl.ir import TaskGraph

from zdsl.ir import parse_buffer_name

from zdsl.runtime.dist import collectives
from zdsl.runtime.state.flat import FlatParam
from zdsl.runtime.state.flat import alloc_storage
from zdsl.runtime.state.flat import free_storage
from zdsl.runtime.state.flat import layout_of
from zdsl.runtime.state.memory import MemoryMeter
from zdsl.runtime.models.protocol import tied_indices
from zdsl.runtime.state.optim import UnitOptimizer
from zdsl.runtime.state.optim import clip_coefficient
from zdsl.runtime.state.precision import LossScaler
from zdsl.runtime.state.precision import compute_dtype
from zdsl.runtime.state.precision import overflowed

ACT_KINDS = ("act", "act_inner", "act_grad")


class StateError(RuntimeError):
    """An op that cannot run on this rank's state; the message names rank, op and cause."""


@dataclass
class ActRecord:
    """What a unit keeps between its forward and its backward."""
    input: torch.Tensor | None          # the unit's input (detached; requires grad when floating)
    output: torch.Tensor | None         # its output (the scaled loss for the last unit)
    micro: int
    nbytes: int = 0
    rng: tuple | None = None            # a recomputed unit's RNG state before its forward


@dataclass
class Slot:
    """One buffer of the graph on this rank."""
    buf: Buffer
    tensor: torch.Tensor | None = None  # flat buffers, act_grad, norm, loss
    record: ActRecord | None = None     # act, act_inner
    live: bool = False
    clean: bool = True                  # grad_full: still all zeros since allocation


@dataclass
class _StepPlan:
    overflow: bool = False
    coef: torch.Tensor | None = None
    inv_scale: float = 1.0
    grad_norm: float | None = None


class _Collective:
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


class RankState:
    """All buffers of one rank and the execution of single ops on them.

    ``model`` must already hold the initial parameters (built with the run's
    seed); its parameters are re-pointed into zdsl's flat buffers, so the
    caller must not use it for anything else afterwards.
    """

    def __init__(self, graph: TaskGraph, model: nn.Module, rank: int, world: int,
                 device: torch.device | str = "cpu"):
        if graph.ranks != world:
            raise StateError(f"rank {rank}: the graph was compiled for {graph.ranks} ranks, "
                             f"this run has {world}")
        self.graph, self.rank, self.world = graph, rank, world
        self.group = None   # the default process group (a subgroup is not supported yet)
        self.device = torch.device(device)
        self.host = torch.device("cpu")
        self.config = graph.config or {}
        self.opt_config = dict(self.config.get("optimizer") or {})
        self.clip = self.opt_config.get("clip")
        self.dtype = compute_dtype(graph.precision)
        self.mixed = graph.precision != "fp32"
        self.stage = graph.stage
        self.accumulate = graph.accumulate
        self.scaler = LossScaler(enabled=graph.precision == "fp16")
        self.meter = MemoryMeter()
        self._swapper = None
        self._lock = threading.Lock()

        self.modules = list(model.units())
        if len(self.modules) != len(graph.units):
            raise StateError(f"rank {rank}: the model has {len(self.modules)} units, the compiled graph "
                             f"{len(graph.units)}")
        self.tied = tied_indices(model, self.modules)
        names = {id(p): n for n, p in model.named_parameters()}
        self.param_names = [[names.get(id(p), f"units.{u}.{n}") for n, p in m.named_parameters()]
                            for u, m in enumerate(self.modules)]
        # The rest of the model's state dict, for an export that loads with strict=True: a tied
        # parameter registered a second time (``lm_head.weight is wte.weight``), and buffers.
        self.aliases = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
                        if names[id(p)] != n}
        self._buffer_homes = [(f"{prefix}.{key}" if prefix else key, sub, key)
                              for prefix, sub in model.named_modules(remove_duplicate=False)
                              for key, value in sub._buffers.items()
                              if value is not None and key not in sub._non_persistent_buffers_set]
        for user, uses in self.tied.items():
            for owner, _ in uses:
                if owner not in graph.units[user].uses:
                    raise StateError(f"rank {rank}: unit {user} reads a parameter of unit {owner} (tied), "
                                     f"but the graph does not list that use")
        grad_dtypes = {}
        for b in graph.buffers.values():
            if b.kind in ("grad_full", "grad_shard") and b.unit is not None:
                grad_dtypes[b.unit] = compute_dtype(b.dtype)
        self.slots: dict[str, Slot] = {name: Slot(b) for name, b in graph.buffers.items() if b.kind != "token"}
        self._check_step_outputs()
        # Unit by unit: flatten its parameters, make its optimizer, fill its persistent buffers,
        # then drop the initial copy, so start-up holds about one model's worth beyond the state;
        # a lazily built model (too large for host memory) gets its values one unit at a time
        # here, so start-up then holds one unit beyond the state.
        lazy = bool(getattr(model, "is_lazy", False))
        self.flats: list[FlatParam] = []
        self.optims: list[UnitOptimizer] = []
        for info, module in zip(graph.units, self.modules):
            if lazy:
                model.materialize_unit(info.index)
            lay = layout_of(info.numel, info.padded_numel, info.parts, world)
            try:
                fp = FlatParam(module, lay, rank, self.dtype, grad_dtypes.get(info.index, self.dtype), self.device)
            except ValueError as exc:
                raise StateError(f"rank {rank}: unit {info.index} ({info.name}): {exc}") from None
            self.flats.append(fp)
            ranges = ([lay.full_range(p) for p in range(lay.parts)] if self.stage == 0   # stage 0: whole unit
                      else [lay.shard_range(p) for p in range(lay.parts)])
            opt = UnitOptimizer(self.opt_config, ranges, master=info.master)
            for p in opt.params:    # placeholders (each step points them at the real slices): a
                p.data = torch.empty(0)   # shard-size fp32 zero per unit would be 4 bytes/param held
            self.optims.append(opt)
            self._init_persistent(info.index)
            fp.initial = None
        self._init_persistent(None)
        self.last = len(self.modules) - 1
        for module in self.modules:   # non-parameter buffers (masks, tables) go where the compute runs
            for sub in module.modules():
                for key, value in list(sub._buffers.items()):
                    if value is not None and value.device != self.device:
                        sub._buffers[key] = value.to(self.device)

        self._norm_reduced = any(op.kind == "comm.all_reduce" and "norm" in op.writes for op in graph.ops)
        self._prescale_after, self._prescale_at_comm = self._plan_prescale()
        self._pending_tied: dict[tuple[int, int], torch.Tensor] = {}
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []
        self._plan: _StepPlan | None = None
        self.step_index = 0

    # ------------------------------------------------------------------ setup
    def _check_step_outputs(self) -> None:
        """Refuse a graph that frees a step's updated parameters before anything reads them
        (the update would be lost silently)."""
        ops = self.graph.ops
        for i, op in enumerate(ops):
            if op.kind != "compute.step":
                continue
            for name in op.writes:
                buf = self.graph.buffers.get(name)
                if buf is None or buf.persistent or buf.kind not in ("param_shard", "param_full"):
                    continue
                for later in ops[i + 1:]:
                    if name in later.reads:
                        break
                    if later.kind == "mem.free" and name in later.writes:
                        raise self._error(op, f"the graph frees {name} (op {later.id}) before anything reads "
                                              f"it: unit {op.unit}'s updated parameters would be lost")
                else:
                    raise self._error(op, f"nothing reads {name} after the step: unit {op.unit}'s "
                                          f"updated parameters would be lost")

    def _plan_prescale(self) -> tuple[dict[int, list[int]], set[int]]:
        """Where each gradient's 1/world factor is applied: after the last backward that writes
        ``grad_full[u]`` before a collective reduces it; in an all-reduce of a gradient no
        backward wrote since its last reduction (the pipeline reduces it twice: averaging
        values every rank already holds leaves them as they are, as DDP's bits need).

        A reduce-scatter has no such case: one with no backward before it since the step
        began reads a stage-1 gradient that is still zero (nothing to scale), and one after
        another reduce-scatter of the same gradient is refused, since a reduce-scatter may
        consume its input (gloo's by all-reduce sums it in place, its own leaves it as it
        was): the second one's result would depend on the algorithm."""
        after: dict[int, list[int]] = {}
        at_comm: set[int] = set()
        if self.world == 1:
            return after, at_comm
        writer: dict[str, int] = {}       # grad_full name -> last backward since its last reduction
        scattered: dict[str, int] = {}    # grad_full name -> its reduce-scatter, if no backward since
        in_comm: dict[str, bool] = {}     # grad_full name -> this reduction scales in the collective
        for op in self.graph.ops:
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
                        raise self._error(op, f"reduce-scatters {name} again with no backward since its "
                                              f"reduce-scatter (op {scattered[name]}), which may have consumed "
                                              f"it; scatter each gradient once, after its last backward")
                    if op.kind == "comm.reduce_scatter":
                        scattered[name] = op.id
                    in_comm[name] = w is None and op.kind == "comm.all_reduce"
                    if w is not None:
                        after.setdefault(w, []).append(parse_buffer_name(name)[1])
                if in_comm[name]:
                    at_comm.add(op.id)
        return after, at_comm

    def _tensor_device(self, tier: str) -> torch.device:
        return self.device if tier == "device" else self.host

    def _numel(self, buf: Buffer) -> int:
        lay = self.flats[buf.unit].layout
        if buf.kind in ("param_full", "grad_full"):
            return lay.padded_numel
        if buf.kind in ("param_shard", "grad_shard"):
            return lay.shard_numel
        return self.optims[buf.unit].flat_numel   # optim

    def _dtype(self, buf: Buffer) -> torch.dtype:
        if buf.kind == "optim" or buf.kind in ("norm", "loss"):
            return torch.float32
        if buf.kind in ("grad_full", "grad_shard"):
            return self.flats[buf.unit].grad.dtype
        return self.dtype

    def _category(self, buf: Buffer) -> str:
        return buf.state if buf.persistent and buf.state else "working"

    def _fill_initial(self, buf: Buffer, t: torch.Tensor) -> None:
        """Write a persistent buffer's step-0 contents into ``t`` in place (no full-size temporaries)."""
        u = buf.unit
        if buf.kind in ("norm", "loss") or buf.kind in ("grad_full", "grad_shard"):
            t.zero_()
            return
        fp = self.flats[u]
        if buf.kind == "param_full":
            t.copy_(fp.initial)
        elif buf.kind == "param_shard":
            for dst, src in zip(fp.shard_parts(t), fp.owned(fp.initial)):
                dst.copy_(src)
        elif buf.kind == "optim":
            t.zero_()
            opt = self.optims[u]
            if opt.master:
                if self.stage == 0:
                    t[:opt.numel].copy_(fp.initial)
                else:
                    for dst, src in zip(fp.shard_parts(t[:opt.numel]), fp.owned(fp.initial)):
                        dst.copy_(src)

    def _init_persistent(self, unit: int | None) -> None:
        """Give the persistent buffers of ``unit`` (None: the unit-less ones) their start values."""
        for name, slot in self.slots.items():
            buf = slot.buf
            if not buf.persistent or buf.unit != unit:
                continue
            if buf.kind in ACT_KINDS:
                raise StateError(f"rank {self.rank}: activations cannot be persistent ({name})")
            if buf.tier == "nvme":
                value = torch.empty(self._numel(buf), dtype=self._dtype(buf))
                self._fill_initial(buf, value)
                self.swapper.write_sync(name, value)
                slot.live = True
                self.meter.hold(name, "nvme", buf.kind, self._category(buf), value.numel() * value.element_size())
                continue
            self._fill_initial(buf, self._alloc(slot))

    @property
    def swapper(self):
        """The NVMe swapper (``runtime/offload/swap.py``), opened on first use from the schedule's placement."""
        if self._swapper is None:
            places = [p for p in (self.config.get("placement") or {}).values() if p.get("tier") == "nvme"]
            if not places or not places[0].get("path"):
                raise StateError(f"rank {self.rank}: the graph uses nvme but no nvme folder is configured")
            try:
                from zdsl.runtime.offload.swap import Swapper
            except ImportError as exc:
                raise StateError(f"rank {self.rank}: the nvme tier is unavailable: {exc}") from None
            p = places[0]
            import os
            folder = os.path.join(p["path"], f"rank{self.rank}")
            self._swapper = Swapper(folder, p.get("block_bytes", 1 << 20), p.get("queue_depth", 8))
        return self._swapper

    @property
    def opened_swapper(self):
        """The NVMe swapper if this rank has opened one, else None (never opens one)."""
        return self._swapper

    def close_swap(self) -> None:
        """Remove this rank's NVMe swap files, if it opened any."""
        if self._swapper is not None:
            self._swapper.close()

    # ------------------------------------------------------------ buffers
    def _slot(self, name: str, op: Op | None = None) -> Slot:
        try:
            return self.slots[name]
        except KeyError:
            raise self._error(op, f"buffer {name} is not in the graph") from None

    def _error(self, op: Op | None, cause: str) -> StateError:
        where = f"op {op.id} {op.kind}" + (f" unit {op.unit}" if op.unit is not None else "") \
            + (f" micro {op.micro}" if op.micro else "") if op is not None else "setup"
        return StateError(f"rank {self.rank}: {where}: {cause}")

    def _alloc(self, slot: Slot) -> torch.Tensor:
        """Give a flat/scalar buffer memory (zeros for gradients and scalars)."""
        buf = slot.buf
        if buf.tier == "nvme":
            raise StateError(f"rank {self.rank}: {buf.name} lives on nvme; only nvme.read/write touch it")
        dev = self._tensor_device(buf.tier)
        if buf.kind in ("norm", "loss"):
            t = torch.zeros((), dtype=torch.float32, device=dev)
        elif buf.kind == "param_full" and buf.tier == "device":
            t = self.flats[buf.unit].full
            alloc_storage(t)
        elif buf.kind == "grad_full" and buf.tier == "device":
            t = self.flats[buf.unit].grad
            alloc_storage(t)
            t.zero_()
        else:
            pin = dev.type == "cpu" and self.device.type == "cuda"
            t = torch.empty(self._numel(buf), dtype=self._dtype(buf), device=dev, pin_memory=pin)
            if buf.kind in ("grad_full", "grad_shard"):
                t.zero_()
        slot.tensor, slot.live, slot.clean = t, True, True
        self.meter.hold(buf.name, buf.tier, buf.kind, self._category(buf), t.numel() * t.element_size())
        return t

    def _release(self, slot: Slot) -> None:
        buf = slot.buf
        if buf.kind in ("param_full", "grad_full") and buf.tier == "device" and slot.tensor is not None:
            free_storage(slot.tensor)   # keep the tensor object: autograd's views see the next gather
        else:
            slot.tensor = None
        slot.record = None
        slot.live = False
        self.meter.release(buf.name)

    def _read(self, name: str, op: Op) -> Slot:
        slot = self._slot(name, op)
        if not slot.live:
            raise self._error(op, f"reads {name}, which holds no data now (never produced, or freed)")
        return slot

    def _write(self, name: str, op: Op) -> torch.Tensor:
        """The tensor an op writes, allocated if the buffer is not live."""
        slot = self._slot(name, op)
        return slot.tensor if slot.live else self._alloc(slot)

    def tensor(self, name: str) -> torch.Tensor:
        """The live tensor of a flat or scalar buffer (tests, checkpoints)."""
        slot = self.slots[name]
        if not slot.live or slot.tensor is None:
            raise StateError(f"rank {self.rank}: {name} holds no data now")
        return slot.tensor

    # ------------------------------------------------------------ step frame
    def step_begin(self, step: int, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start a step: one ``(idx, targets)`` per micro-batch for this rank."""
        if len(batches) != self.accumulate:
            raise StateError(f"rank {self.rank}: step {step} got {len(batches)} micro-batches, "
                             f"the graph accumulates {self.accumulate}")
        self.step_index = step
        self.batches = [(i.to(self.device, non_blocking=True), t.to(self.device, non_blocking=True))
                        for i, t in batches]
        self.losses = []
        self._plan = None
        self._pending_tied.clear()
        for slot in self.slots.values():
            if slot.buf.kind == "grad_full" and slot.buf.persistent and slot.live:
                slot.tensor.zero_()
                slot.clean = True

    def step_end(self) -> dict:
        """Finish a step: ``loss`` (this rank's mean over micro-batches), ``skipped``
        (fp16 overflow), ``grad_norm`` (when computed), ``loss_scale``."""
        plan = self._plan or _StepPlan()
        if self.scaler.enabled:
            self.scaler.update(plan.overflow)
        loss = float(torch.stack(self.losses).mean()) if self.losses else float("nan")
        self.batches = []
        return dict(loss=loss, skipped=plan.overflow, grad_norm=plan.grad_norm,
                    loss_scale=self.scaler.scale if self.scaler.enabled else None)

    def _home(self, kind: str, u: int) -> Slot | None:
        for tier in (None, "host", "nvme"):
            slot = self.slots.get(f"{kind}[{u}]" + (f"@{tier}" if tier else ""))
            if slot is not None and slot.buf.persistent:
                return slot
        return None

    def _truth(self, u: int) -> tuple[torch.Tensor, bool]:
        """Unit ``u``'s current fp32 parameters: (tensor, is_shard), from their home."""
        opt = self.optims[u]
        slot = self._home("optim", u) if opt.master else \
            (self._home("param_full", u) or self._home("param_shard", u))
        if slot is None:
            raise StateError(f"rank {self.rank}: no persistent home for unit {u}'s parameters")
        if slot.buf.tier == "nvme":
            t = torch.empty(self._numel(slot.buf), dtype=self._dtype(slot.buf))
            self.swapper.read_sync(slot.buf.name, t)
        else:
            t = slot.tensor
        if opt.master:
            t = t[:opt.numel]
            return t.float().to(self.device), self.stage > 0
        return t.float().to(self.device), slot.buf.kind == "param_shard"

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers by their state-dict names, on the CPU."""
        return {name: sub._buffers[key].detach().cpu().clone() for name, sub, key in self._buffer_homes}

    def load_buffers(self, values: dict[str, torch.Tensor]) -> None:
        """Put back buffers saved by :meth:`buffers` (a name this model lacks is ignored)."""
        with torch.no_grad():
            for name, sub, key in self._buffer_homes:
                if name in values:
                    sub._buffers[key].copy_(values[name])

    def export_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict: full fp32 parameters by the model's own names, a tied
        parameter under each of its names (as separate tensors), and the buffers. Every rank
        must call it (sharded units are all-gathered). Call between steps."""
        out: dict[str, torch.Tensor] = {}
        for u, fp in enumerate(self.flats):
            t, is_shard = self._truth(u)
            if is_shard:
                full = torch.empty(fp.layout.padded_numel, dtype=torch.float32, device=self.device)
                for part in range(fp.layout.parts):
                    fp.gather(part, full, t.contiguous(), self.group, async_op=False)
                t = full
            for name, p, off in zip(self.param_names[u], fp.params, fp.offsets):
                out[name] = t[off:off + p.numel()].view(p.shape).detach().cpu().clone()
        for alias, owner in self.aliases.items():
            out[alias] = out[owner].clone()
        out.update(self.buffers())
        return out

    def export(self, path) -> None:
        """Write the full fp32 parameters as one safetensors file that the model loads with
        plain torch (``load_state_dict``). Every rank must call it; rank 0 writes."""
        tensors = self.export_state()
        if self.rank == 0:
            from safetensors.torch import save_file
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))

    # -- checkpoint shards ---------------------------------------------------------
    SHARD_NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum_buffer": "momentum"}

    def _optim_flat(self, u: int) -> torch.Tensor:
        slot = self._home("optim", u)
        if slot is None:
            raise StateError(f"rank {self.rank}: no optimizer state for unit {u}")
        if slot.buf.tier == "nvme":
            t = torch.empty(self._numel(slot.buf), dtype=torch.float32)
            self.swapper.read_sync(slot.buf.name, t)
            return t
        return slot.tensor

    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's layout shard of every unit, fp32 on the CPU: ``u{i}.param`` and the
        optimizer's moments (``u{i}.exp_avg``, ``u{i}.exp_avg_sq``, ``u{i}.momentum``). At
        stage 0, where every rank holds everything, the rank's slice of it. Between steps."""
        out: dict[str, torch.Tensor] = {}
        for u, fp in enumerate(self.flats):
            opt = self.optims[u]
            truth, is_shard = self._truth(u)
            out[f"u{u}.param"] = (truth if is_shard else fp.shard_of(truth)).detach().cpu().clone()
            flat = self._optim_flat(u) if opt.flat_numel else None
            first = 1 if opt.master else 0
            for k, name in enumerate(opt.names):
                seg = flat[(first + k) * opt.numel:(first + k + 1) * opt.numel]
                out[f"u{u}.{self.SHARD_NAMES[name]}"] = (seg if self.stage > 0 else fp.shard_of(seg)).cpu().clone()
        return out

    def moment_names(self) -> list[str]:
        """The optimizer state this schedule's optimizer keeps, by checkpoint name (``exp_avg``...)."""
        return [self.SHARD_NAMES[n] for n in (self.optims[0].names if self.optims else ())]

    def optimizer_steps(self) -> int:
        return self.optims[0].steps if self.optims else 0

    def load_shard_state(self, shards: dict[str, torch.Tensor], steps: int, moments: bool = True) -> None:
        """Inverse of :meth:`shard_state` (all ranks call it: stage 0-2 parameters and
        stage-0 moments are rebuilt by all-gathers). Between steps. ``moments=False``: only the
        parameters (and master copy) come from ``shards``; the optimizer's moments start at zero."""
        def full_of(u: int, shard: torch.Tensor) -> torch.Tensor:
            fp = self.flats[u]
            full = torch.empty(fp.layout.padded_numel, dtype=torch.float32, device=self.device)
            for part in range(fp.layout.parts):
                fp.gather(part, full, shard.to(self.device).contiguous(), self.group, async_op=False)
            return full

        with torch.no_grad():
            for u, fp in enumerate(self.flats):
                opt = self.optims[u]
                shard = shards[f"u{u}.param"].float()
                if shard.numel() != fp.layout.shard_numel:
                    raise StateError(f"rank {self.rank}: unit {u}: checkpoint shard has {shard.numel()} "
                                     f"elements, this layout {fp.layout.shard_numel}")
                full = full_of(u, shard) if self.stage < 3 else None
                flat = self._optim_flat(u) if opt.flat_numel else None
                if opt.master:
                    flat[:opt.numel].copy_(full if self.stage == 0 else shard)
                first = 1 if opt.master else 0
                for k, name in enumerate(opt.names):
                    seg = flat[(first + k) * opt.numel:(first + k + 1) * opt.numel]
                    if not moments:
                        seg.zero_()
                        continue
                    m = shards[f"u{u}.{self.SHARD_NAMES[name]}"].float()
                    seg.copy_(full_of(u, m) if self.stage == 0 else m)
                home = self._home("param_full", u) or self._home("param_shard", u)
                value = full if home.buf.kind == "param_full" else shard
                self._store(home, value.to(self.dtype))
                optim_home = self._home("optim", u)
                if flat is not None and optim_home.buf.tier == "nvme":
                    self.swapper.write_sync(optim_home.buf.name, flat)
                opt.restore_steps(steps)

    def _store(self, slot: Slot, value: torch.Tensor) -> None:
        if slot.buf.tier == "nvme":
            self.swapper.write_sync(slot.buf.name, value.cpu())
        else:
            slot.tensor.copy_(value)

    def memory_report(self) -> dict:
        return self.meter.report()

    def live_working(self) -> list[str]:
        """Working buffers still held (after a step: none, unless the graph leaks)."""
        return sorted(n for n, s in self.slots.items() if s.live and not s.buf.persistent)

    # ------------------------------------------------------------ dispatch
    def run_op(self, op: Op) -> None:
        """Run any op to completion (sequential execution)."""
        kind = op.kind
        if kind.startswith("compute."):
            self.run_compute(op)
        elif kind.startswith("comm."):
            self.start_collective(op).wait()
        elif kind.startswith("copy."):
            self.run_copy(op)
        elif kind.startswith("nvme."):
            self.run_nvme(op)
        elif kind == "mem.free":
            self.free(op)
        else:
            raise self._error(op, f"unknown op kind {kind!r}")

    def run_compute(self, op: Op) -> None:
        fn = {"compute.forward": self._forward, "compute.backward": self._backward,
              "compute.recompute": self._recompute, "compute.norm": self._norm,
              "compute.step": self._step}.get(op.kind)
        if fn is None:
            raise self._error(op, "not a compute op")
        fn(op)

    # ------------------------------------------------------------ compute
    def _unit_input(self, op: Op) -> torch.Tensor:
        u = op.unit
        if u == 0:
            if op.micro >= len(self.batches):
                raise self._error(op, "no batch for this micro-batch (step_begin not called?)")
            return self.batches[op.micro][0]
        rec = self._read(f"act[{u - 1}]", op).record
        return rec.output

    def _param_storages(self) -> set[int]:
        return {fp.full.untyped_storage().data_ptr() for fp in self.flats
                if fp.full.untyped_storage().nbytes()}

    def _run_unit(self, u: int, x: torch.Tensor, micro: int, grad: bool) -> tuple[torch.Tensor, int]:
        """Run unit ``u`` on ``x``; returns the output and the bytes autograd saved."""
        module = self.modules[u]
        skip = self._param_storages() | {x.untyped_storage().data_ptr()}
        seen: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in skip:
                seen[ptr] = s.nbytes()
            return t

        with torch.set_grad_enabled(grad), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if u == self.last:
                loss = module(x, self.batches[micro][1])
                self.losses.append(loss.detach().float())
                out = loss / self.accumulate if self.accumulate > 1 else loss
            else:
                out = module(x)
        optr = out.untyped_storage().data_ptr()
        if optr not in seen:
            seen[optr] = out.untyped_storage().nbytes()
        return out, sum(seen.values())

    def _forward(self, op: Op) -> None:
        u = op.unit
        for name in op.reads:
            if name != "token":
                self._read(name, op)
        x = self._unit_input(op)
        recompute = self.graph.units[u].recompute
        x_in = x.detach()
        if x_in.is_floating_point() and not recompute:
            x_in.requires_grad_(True)
        rng = rng_state(self.device) if recompute else None
        out, nbytes = self._run_unit(u, x_in, op.micro, grad=not recompute)
        if u == 0:
            nbytes += x.numel() * x.element_size()
        if recompute:
            nbytes = out.numel() * out.element_size() + (x.numel() * x.element_size() if u == 0 else 0)
        slot = self._slot(f"act[{u}]", op)
        if slot.live:
            self.meter.release(slot.buf.name)
        slot.record, slot.live = ActRecord(x_in, out, op.micro, nbytes, rng), True
        self.meter.hold(slot.buf.name, slot.buf.tier, "act", "working", nbytes)
        if u == self.last and "loss" in self.slots:
            self._write("loss", op).copy_(self.losses[-1])

    def _recompute(self, op: Op) -> None:
        u = op.unit
        rec = self._read(f"act[{u}]", op).record
        x_in = rec.input.detach()
        if x_in.is_floating_point():
            x_in.requires_grad_(True)
        losses = list(self.losses)
        with replayed_rng(rec.rng, self.device):   # the forward's dropout masks, not new ones
            out, nbytes = self._run_unit(u, x_in, op.micro, grad=True)
        self.losses = losses        # the loss was recorded by the forward
        slot = self._slot(f"act_inner[{u}]", op)
        slot.record, slot.live = ActRecord(x_in, out, op.micro, nbytes), True
        self.meter.hold(slot.buf.name, slot.buf.tier, "act_inner", "working", nbytes)

    def _grad_slot(self, u: int, op: Op) -> Slot:
        name = f"grad_full[{u}]"
        slot = self._slot(name, op)
        if not slot.live:
            self._alloc(slot)
        return slot

    def _backward(self, op: Op) -> None:
        u = op.unit
        for name in op.reads:
            if name != "token" and not name.startswith("grad_full["):
                self._read(name, op)
        rec = self._read(f"act_inner[{u}]" if self.graph.units[u].recompute else f"act[{u}]", op).record
        if u < self.last:
            grad_out = self._read(f"act_grad[{u + 1}]", op).tensor
        else:
            grad_out = (torch.tensor(self.scaler.scale, dtype=rec.output.dtype, device=rec.output.device)
                        if self.scaler.enabled else None)
        fp = self.flats[u]
        tied = self.tied.get(u, [])
        wants_input = rec.input is not None and rec.input.requires_grad
        inputs = ([rec.input] if wants_input else []) + fp.params + \
            [self.flats[o].params[i] for o, i in tied]
        grads = torch.autograd.grad(rec.output, inputs, grad_outputs=grad_out, allow_unused=True)
        if wants_input:
            g_in, grads = grads[0], grads[1:]
            if u > 0:
                slot = self._slot(f"act_grad[{u}]", op)
                slot.tensor, slot.live = g_in, True
                self.meter.hold(slot.buf.name, slot.buf.tier, "act_grad", "working",
                                g_in.numel() * g_in.element_size())
        own, from_users = grads[:len(fp.params)], grads[len(fp.params):]
        with torch.no_grad():
            gslot = self._grad_slot(u, op)
            views = fp.grad_views
            for i, g in enumerate(own):
                pending = self._pending_tied.pop((u, i), None)
                if g is None and pending is None:
                    continue
                total = pending if g is None else (g if pending is None else pending + g)
                views[i].add_(total)
            gslot.clean = False
            for (owner, i), g in zip(tied, from_users):
                if g is None:
                    continue
                oslot = self._grad_slot(owner, op)
                if oslot.clean:
                    self.flats[owner].grad_views[i].add_(g)
                    oslot.clean = False
                else:   # the owner's backward adds it together with its own part (autograd's order)
                    prev = self._pending_tied.get((owner, i))
                    self._pending_tied[(owner, i)] = g if prev is None else prev + g
            for unit in self._prescale_after.get(op.id, ()):
                self.flats[unit].grad.mul_(1.0 / self.world)

    def _norm(self, op: Op) -> None:
        grads = [self._read(n, op).tensor for n in op.reads if n != "token"]
        with torch.no_grad():
            if not self._norm_reduced and not self.mixed and self.stage == 0:
                # exactly clip_grad_norm_'s total norm over the parameters' gradients
                views = [v for fp in self.flats for v in fp.grad_views]
                value = _total_norm(views)
            else:
                sq = [torch.linalg.vector_norm(g, 2, dtype=torch.float32) ** 2 for g in grads]
                value = torch.stack(sq).sum() if sq else torch.zeros((), dtype=torch.float32)
                if not self._norm_reduced:
                    value = value.sqrt()
            self._write("norm", op).copy_(value)

    def _finish_norm(self) -> _StepPlan:
        """Overflow, clip coefficient and unscale factor, once per step (all step ops share it)."""
        with self._lock:
            if self._plan is not None:
                return self._plan
            plan = _StepPlan(inv_scale=1.0 / self.scaler.scale)
            slot = self.slots.get("norm")
            if slot is not None and slot.live and (self.clip is not None or self.scaler.enabled):
                total = slot.tensor.sqrt() if self._norm_reduced else slot.tensor.clone()
                plan.overflow = self.scaler.enabled and overflowed(total)
                total = total / self.scaler.scale if self.scaler.enabled else total
                plan.grad_norm = float(total)
                if self.clip is not None and not plan.overflow:
                    plan.coef = clip_coefficient(total, float(self.clip))
            self._plan = plan
            return plan

    def _step(self, op: Op) -> None:
        u = op.unit
        fp, opt = self.flats[u], self.optims[u]
        kinds = {parse_buffer_name(n)[0]: n for n in op.reads if n != "token"}
        wkinds = {parse_buffer_name(n)[0]: n for n in op.writes if n != "token"}
        grad_name = kinds.get("grad_shard") or kinds.get("grad_full")
        optim_name = kinds.get("optim") or wkinds.get("optim")
        dest_name = wkinds.get("param_shard") or wkinds.get("param_full")
        if grad_name is None or optim_name is None or dest_name is None:
            raise self._error(op, "a step reads a gradient and optimizer buffer and writes parameters")
        plan = self._finish_norm()
        grad = self._read(grad_name, op).tensor
        optflat = self._read(optim_name, op).tensor
        dest_slot = self._slot(dest_name, op)
        fresh = not dest_slot.live
        dest = self._write(dest_name, op)
        dest_kind = dest_slot.buf.kind
        lay = fp.layout
        full_parts = [slice(*lay.full_range(p)) for p in range(lay.parts)]
        shard_parts = [slice(*lay.shard_range(p)) for p in range(lay.parts)]
        d_parts = full_parts if dest_kind == "param_full" else shard_parts
        g_parts = full_parts if parse_buffer_name(grad_name)[0] == "grad_full" else shard_parts
        with torch.no_grad():
            if fresh and not opt.master:
                # the values to update come from the parameters the step reads: the gathered
                # ones (stages 1-2) or the shard's home on another tier (stage 3 offload)
                self._load_current(op, u, kinds, dest, d_parts)
            masters = opt.master_parts(optflat) if opt.master else None
            if plan.overflow:
                if masters is not None:
                    for d, m in zip(d_parts, masters):
                        dest[d].copy_(m)
                return
            if opt.master:
                g32 = [grad[s].float() for s in g_parts]
                params = masters
            else:
                g32 = [grad[s] for s in g_parts]
                params = [dest[d] for d in d_parts]
            for g in g32:
                if plan.inv_scale != 1.0:
                    g.mul_(plan.inv_scale)
                if plan.coef is not None:
                    g.mul_(plan.coef)
            opt.step(optflat, params, g32)
            if masters is not None:
                for d, m in zip(d_parts, masters):
                    dest[d].copy_(m)

    def _load_current(self, op: Op, u: int, kinds: dict, dest: torch.Tensor, d_parts: list[slice]) -> None:
        src_name = next((n for n in op.reads if parse_buffer_name(n)[0] in ("param_full", "param_shard")), None)
        if src_name is None:
            raise self._error(op, "an fp32 step without a master copy must read the current parameters")
        slot = self._read(src_name, op)
        if slot.buf.tier == "nvme":
            tmp = torch.empty(self._numel(slot.buf), dtype=self._dtype(slot.buf))
            self.swapper.read_sync(src_name, tmp)
            src = tmp
        else:
            src = slot.tensor
        if slot.buf.kind == "param_full":
            for d, s in zip(d_parts, self.flats[u].owned(src)):
                dest[d].copy_(s)
        else:
            dest.copy_(src)

    # ------------------------------------------------------------ collectives
    def start_collective(self, op: Op) -> _Collective:
        g = self.group
        if op.kind == "comm.all_reduce":
            name = op.writes[0] if op.writes else op.reads[0]
            slot = self._read(name, op)
            if slot.buf.kind == "norm":
                return _Collective(collectives.all_reduce(slot.tensor, group=g, async_op=True))
            t = slot.tensor
            if slot.buf.kind != "grad_full":
                raise self._error(op, f"all-reduce of {name} is not defined")
            a, b = self.flats[op.unit].layout.full_range(op.part)
            if op.id in self._prescale_at_comm:
                t[a:b].mul_(1.0 / self.world)
            return _Collective(collectives.all_reduce(t[a:b], group=g, async_op=True))
        src_name = next(n for n in op.reads if n != "token")
        dst_name = next(n for n in op.writes if n != "token")
        src = self._read(src_name, op).tensor
        fp = self.flats[op.unit]
        if op.kind == "comm.all_gather":
            dst = self._write(dst_name, op)
            return _Collective(fp.gather(op.part, dst, src, g, async_op=True))
        if op.kind == "comm.reduce_scatter":
            dst = self._write(dst_name, op)
            if not op.accumulate:
                return _Collective(fp.reduce_scatter(op.part, dst, src, g, async_op=True))
            c, d = fp.layout.shard_range(op.part)
            tmp = torch.empty(d - c, dtype=dst.dtype, device=dst.device)
            work = collectives.reduce_scatter(tmp, src[slice(*fp.layout.full_range(op.part))],
                                              group=g, async_op=True)
            return _Collective(work, lambda: dst[c:d].add_(tmp))
        raise self._error(op, "not a collective")

    # ------------------------------------------------------------ copies, nvme, free
    def run_copy(self, op: Op) -> None:
        src_name = next(n for n in op.reads if n != "token")
        dst_name = next(n for n in op.writes if n != "token")
        src_slot = self._read(src_name, op)
        if src_slot.buf.kind in ("act", "act_inner"):
            self._move_activation(op, src_slot, self._slot(dst_name, op))
            return
        dst = self._write(dst_name, op)
        with torch.no_grad():
            if op.accumulate:
                dst.add_(src_slot.tensor.to(dst.device, non_blocking=False))
            else:
                dst.copy_(src_slot.tensor, non_blocking=False)

    def _move_activation(self, op: Op, src: Slot, dst: Slot) -> None:
        """Activation offload. On a CPU device the device and the host are the same memory,
        so the move is bookkeeping; on an accelerator it is not supported yet."""
        if self.device.type != "cpu":
            raise self._error(op, "activation offload is not supported on accelerators by this runtime")
        dst.record, dst.live = src.record, True
        self.meter.hold(dst.buf.name, dst.buf.tier, dst.buf.kind, "working", src.record.nbytes)

    def run_nvme(self, op: Op) -> None:
        src_name = next(n for n in op.reads if n != "token")
        dst_name = next(n for n in op.writes if n != "token")
        if op.kind == "nvme.read":
            on_disk = self._read(src_name, op)
            dst = self._write(dst_name, op)
            self.swapper.read_sync(on_disk.buf.name, dst)
        elif op.kind == "nvme.write":
            src = self._read(src_name, op).tensor
            self.swapper.write_sync(dst_name, src)
            slot = self._slot(dst_name, op)
            slot.live = True
            self.meter.hold(dst_name, "nvme", slot.buf.kind, self._category(slot.buf),
                            src.numel() * src.element_size())
        else:
            raise self._error(op, "not an nvme op")

    def free(self, op: Op) -> None:
        for name in dict.fromkeys(op.writes + op.reads):
            if name == "token":
                continue
            slot = self._slot(name, op)
            if slot.buf.persistent:
                raise self._error(op, f"frees {name}, which is model state (persistent)")
            if slot.live:
                self._release(slot)


def rng_state(device: torch.device) -> tuple:
    """The generators a unit's forward draws from: the CPU's, and its CUDA device's (by index,
    so a lane worker thread whose current CUDA device is another one still saves the right one)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@contextlib.contextmanager
def replayed_rng(saved: tuple | None, device: torch.device):
    """Run with the generators as they were at ``saved`` (a recompute redraws the forward's random
    numbers, as torch.utils.checkpoint does), then put back where they are now, so that the
    draws after it are those of a run without recompute."""
    if saved is None:
        yield
        return
    now = rng_state(device)
    _set_rng_state(saved, device)
    try:
        yield
    finally:
        _set_rng_state(now, device)


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """``clip_grad_norm_``'s total 2-norm, by the same calls (so the same bits)."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, 2.0)
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)
