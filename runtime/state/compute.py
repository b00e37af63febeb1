"""What the compute ops do: ``compute.forward|backward|recompute|norm|step``, and the step frame.

* Units run one at a time, called as the unit protocol says (``runtime/models/protocol.py``):
  each micro-batch is a ``Batch`` the model's ``prepare`` sees once, at its first forward; every
  unit of that micro-batch, recomputed ones included, gets that same object. What ``prepare``
  and the units put in its ``extras`` (masks, rotary tables) is held from then to the
  micro-batch's last compute op, one micro-batch's at a time when they run one after another
  (as the plan counts them: with the micro-batch's input, ``act[0]``), metered as ``extras[m]``.
  Forward keeps a unit's input (detached, so autograd stops at the unit
  boundary) and its output; backward runs autograd for that one unit with the gradient of its
  output and leaves the gradient of its input in ``act_grad[u]``. A recomputed unit's forward runs
  without autograd and keeps only its input and output; ``compute.recompute`` re-runs it with
  autograd (``act_inner[u]``), with the random generators as the forward found them (the same
  dropout masks, as torch.utils.checkpoint).
* Backward accumulates into ``grad_full`` (zero when allocated; the persistent ones of stages 0-1
  are zeroed by ``step_begin``), and applies the 1/world factors the prescale plan puts after it
  (``runtime/state/comm.py``). The loss of a micro-batch is divided by ``accumulate`` inside the
  graph, as the DDP reference does.
* A tied parameter's gradient from its user (the head) reaches the owner's ``grad_full``; when
  that buffer already holds gradient (accumulation), the contribution waits for the owner's
  backward and both are added together, which is the order autograd uses on the whole model (so
  DDP's bits).
* Frozen parameters (``freeze``) do not require grad: a backward asks autograd only for the
  gradients the graph has buffers for. A unit whose backward the graph drops (nothing before it
  trains) runs its forward without autograd; one whose input gradient no backward reads is not
  asked for it (``act_grad[u]`` is not in the graph).
* ``compute.norm`` writes the global gradient norm: at stage 0 exactly as ``clip_grad_norm_``
  computes it; when an all-reduce of ``norm`` follows, this rank's sum of squares (the step takes
  the square root).
* ``compute.step`` updates the parameters it writes from the gradient and optimizer buffers it
  reads (see ``runtime/state/optim.py``), after unscaling (fp16) and clipping; an fp16 overflow
  skips every unit's update. The fp32 master copy is there when the graph says so
  (``UnitInfo.master``).
* In a user's own loop (``user_loop``, the Python API: ``runtime/api/``) the last unit's output
  is no loss of zdsl's: its forward leaves the output in ``outputs[micro]`` (detached, for the
  user's loss) and divides nothing, and its backward starts from ``grad_outs[micro]``, the
  gradient the API computed from the user's loss (scaled for accumulation and the loss scale
  there, so the units see what ``zdsl run`` gives them); the micro-batches come one at a time
  (:meth:`Compute.feed`); the losses are the user's, kept by the API (``step_end``'s is nan).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn

from zdsl.ir import Op, TaskGraph, parse_buffer_name
from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.protocol import call_unit, unit_grads
from zdsl.runtime.state.buffers import ActRecord, BufferTable, Slot
from zdsl.runtime.state.comm import Prescale
from zdsl.runtime.state.errors import StateError
from zdsl.runtime.state.host_pool import typed
from zdsl.runtime.state.optim import clip_coefficient
from zdsl.runtime.state.precision import LossScaler, overflowed
from zdsl.runtime.state.transfers import Transfers

MICRO_BATCH_OPS = ("compute.forward", "compute.recompute", "compute.backward")


@dataclass
class StepPlan:
    """What every step op of one step shares: overflow, clip coefficient, unscale factor.

    ``coef`` lives where the norm was computed; ``coef_host`` is its CPU copy for steps whose
    gradients are on the host (a 0-dim CUDA tensor cannot multiply a CPU one). Both are complete
    when the plan is published (the copy to the host waits for the kernel that computed ``coef``),
    so a step on any lane or thread may read them without further ordering."""
    overflow: bool = False
    coef: torch.Tensor | None = None
    coef_host: torch.Tensor | None = None
    inv_scale: float = 1.0
    grad_norm: float | None = None

    def coef_for(self, g: torch.Tensor) -> torch.Tensor | None:
        """The clip coefficient on ``g``'s device (None: no clipping this step). On CUDA the
        reading stream is recorded on it, so the allocator keeps its block until that stream is
        done with it (torch.Tensor.record_stream)."""
        if self.coef is None or g.device == self.coef.device:
            if self.coef is not None and self.coef.is_cuda:
                self.coef.record_stream(torch.cuda.current_stream(self.coef.device))
            return self.coef
        if g.device.type == "cpu":
            return self.coef_host
        return self.coef.to(g.device)


class Compute:
    """Runs one rank's compute ops on its units, step by step."""

    def __init__(self, graph: TaskGraph, table: BufferTable, transfers: Transfers, modules: list[nn.Module],
                 tied: dict, world: int, prescale: Prescale, clip, prepare=None):
        """``prepare``: the model's ``prepare(batch)``, or None."""
        self.graph, self.table, self.transfers = graph, table, transfers
        self.prepare = prepare
        self.modules, self.tied, self.world, self.prescale, self.clip = modules, tied, world, prescale, clip
        self.device = table.device
        self.mixed = graph.precision != "fp32"
        self.stage = graph.stage
        self.accumulate = graph.accumulate
        self.scaler = LossScaler(enabled=graph.precision == "fp16")
        self.last = len(modules) - 1
        self.norm_reduced = any(op.kind == "comm.all_reduce" and "norm" in op.writes for op in graph.ops)
        self.has_backward = {op.unit for op in graph.ops if op.kind == "compute.backward"}
        # micro-batch -> the id of its last forward, recompute or backward: its extras go after it
        self.last_use = {op.micro: op.id for op in graph.ops if op.kind in MICRO_BATCH_OPS}
        self._lock = threading.Lock()
        self._pending_tied: dict[tuple[int, int], torch.Tensor] = {}
        self.batches: list[Batch | None] = []    # None: a user loop's micro-batch not fed yet
        self.prepared: set[int] = set()     # micro-batches whose prepare ran this step
        self.losses: list[torch.Tensor] = []
        self._plan: StepPlan | None = None
        self.step_index = 0
        self.evaluating = False             # inside evaluation(): forward passes without autograd
        self.user_loop = False              # the Python API drives the steps (see the module docstring)
        self.outputs: dict[int, torch.Tensor] = {}      # user loop: micro-batch -> the last unit's output
        self.grad_outs: dict[int, torch.Tensor] = {}    # user loop: micro-batch -> its gradient

    # -- step frame ----------------------------------------------------------------
    def step_begin(self, step: int, batches: list[Batch] | None) -> None:
        """Start a step: one ``Batch`` per micro-batch for this rank (moved to the device here, then
        given to the model's ``prepare``; the caller's objects are left as they are). None, in a
        user loop: the micro-batches come one at a time through :meth:`feed`."""
        if batches is None and self.user_loop:
            given: list[Batch | None] = [None] * self.accumulate    # feed fills each
        else:
            given = list(batches or ())
        if len(given) != self.accumulate:
            raise StateError(f"rank {self.table.rank}: step {step} got {len(given)} micro-batches, "
                             f"the graph accumulates {self.accumulate}")
        wrong = next((type(b).__name__ for b in given if not isinstance(b, Batch)
                      and not (b is None and self.user_loop)), None)
        if wrong is not None:
            raise StateError(f"rank {self.table.rank}: step {step} got a {wrong} for a micro-batch; "
                             f"step_begin takes Batch objects (Batch.of(idx, targets) wraps a pair)")
        self.step_index = step
        self.drop_extras()
        self.batches = [b if b is None else b.to(self.device, non_blocking=True) for b in given]
        self.losses = []
        self.outputs.clear()
        self.grad_outs.clear()
        self._plan = None
        self._pending_tied.clear()
        for slot in self.table.slots.values():
            if slot.buf.kind == "grad_full" and slot.buf.persistent and slot.live:
                self.table.tensor(slot.buf.name).zero_()
                slot.clean = True

    def feed(self, micro: int, batch: Batch) -> None:
        """User loop: micro-batch ``micro`` of the step (before its first forward may start)."""
        self.batches[micro] = batch.to(self.device, non_blocking=True)

    def step_end(self) -> dict:
        """Finish a step: ``loss`` (this rank's mean over micro-batches), ``skipped``
        (fp16 overflow), ``grad_norm`` (when computed), ``loss_scale``."""
        plan = self._plan or StepPlan()
        if self.scaler.enabled:
            self.scaler.update(plan.overflow)
        loss = float(torch.stack(self.losses).mean()) if self.losses else float("nan")
        self.drop_extras()
        self.batches = []
        return dict(loss=loss, skipped=plan.overflow, grad_norm=plan.grad_norm,
                    loss_scale=self.scaler.scale if self.scaler.enabled else None)

    # -- evaluation frame (runtime/run/evaluate.py runs a forward-only graph inside it) -----------
    @contextlib.contextmanager
    def evaluation(self, eval_mode: bool = True):
        """Forward passes that leave training as it was: units in eval mode (no dropout draw, no
        running statistics updated; ``eval_mode=False`` keeps their modes: a user's forward under
        ``torch.no_grad()`` in train mode), no autograd, the random generators put back afterwards,
        so the next step has the bits it would have had without evaluating."""
        modes = [(m, m.training) for unit in self.modules for m in unit.modules()]
        rng = rng_state(self.device)
        for m, _ in modes:
            m.training = m.training and not eval_mode
        self.evaluating = True
        try:
            yield
        finally:
            for m, mode in modes:
                m.training = mode
            _set_rng_state(rng, self.device)
            self.evaluating = False
            self.drop_extras()
            self.batches, self.losses = [], []
            self.outputs.clear()

    def eval_begin(self, batch: Batch) -> None:
        """Start one forward-only pass over ``batch`` (inside :meth:`evaluation`)."""
        if not self.evaluating:
            raise StateError(f"rank {self.table.rank}: eval_begin outside evaluation()")
        self.drop_extras()
        self.batches = [batch.to(self.device, non_blocking=True)]
        self.losses = []

    def eval_end(self) -> torch.Tensor:
        """The pass's loss: the last unit's output (a mean over the batch's counted labels), fp32;
        in a user loop, the last unit's output as it is."""
        if self.user_loop and 0 in self.outputs:
            out = self.outputs.pop(0)
            self.drop_extras()
            self.batches, self.losses = [], []
            return out
        if not self.losses:
            raise StateError(f"rank {self.table.rank}: an evaluation pass ended without a loss "
                             f"(the graph never ran the last unit's forward)")
        loss = self.losses[-1]
        self.drop_extras()          # the pass is over: its masks go, in the meter too
        self.batches, self.losses = [], []
        return loss

    def run(self, op: Op) -> None:
        fn = {"compute.forward": self._forward, "compute.backward": self._backward,
              "compute.recompute": self._recompute, "compute.norm": self._norm,
              "compute.step": self._step}.get(op.kind)
        if fn is None:
            raise self.table.error(op, "not a compute op")
        fn(op)
        if op.kind in MICRO_BATCH_OPS and not self.evaluating and self.last_use.get(op.micro) == op.id:
            self.drop_extras(op.micro)

    # -- a micro-batch's extras ------------------------------------------------------------
    def _batch(self, micro: int) -> Batch:
        """Micro-batch ``micro``, given to the model's ``prepare`` the first time a unit runs it."""
        batch = self._fed(micro)
        if micro not in self.prepared:
            self.prepared.add(micro)
            if self.prepare is not None:
                with torch.no_grad():
                    self.prepare(batch)
        return batch

    def _fed(self, micro: int) -> Batch:
        batch = self.batches[micro]
        if batch is None:
            raise StateError(f"rank {self.table.rank}: micro-batch {micro} runs before it was fed")
        return batch

    def _meter_extras(self, micro: int) -> None:
        nbytes = self._fed(micro).extras_bytes()
        if nbytes:
            self.table.meter.hold(f"extras[{micro}]", "device", "extras", "working", nbytes)

    def drop_extras(self, micro: int | None = None) -> None:
        """Let go of micro-batch ``micro``'s extras (None: every micro-batch's): its units are done."""
        for m in range(len(self.batches)) if micro is None else (micro,):
            batch = self.batches[m]
            if batch is None:
                continue
            batch.extras.clear()
            self.table.meter.release(f"extras[{m}]")
        if micro is None:
            self.prepared.clear()

    # -- forward, recompute, backward --------------------------------------------------
    def _unit(self, op: Op) -> int:
        """The unit a forward, recompute, backward or step runs."""
        return self.table.unit_of_op(op)

    def _unit_input(self, op: Op) -> torch.Tensor:
        u = self._unit(op)
        if u == 0:
            if op.micro >= len(self.batches):
                raise self.table.error(op, "no batch for this micro-batch (step_begin not called?)")
            return self._fed(op.micro).input_ids
        return self.table.read_record(f"act[{u - 1}]", op).output

    def _param_storages(self) -> set[int]:
        return {fp.full.untyped_storage().data_ptr() for fp in self.table.flats
                if fp.full.untyped_storage().nbytes()}

    def _run_unit(self, u: int, x: torch.Tensor, micro: int, grad: bool) -> tuple[torch.Tensor, int]:
        """Run unit ``u`` on ``x``; returns the output and the bytes autograd saved (not counting
        the batch's extras, made before or by this unit: the micro-batch holds them once, whichever
        units save them; they are metered apart)."""
        module = self.modules[u]
        batch = self._batch(micro)
        skip = self._param_storages() | {x.untyped_storage().data_ptr()}
        seen: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in skip:
                seen[ptr] = s.nbytes()
            return t

        with torch.set_grad_enabled(grad and not self.evaluating), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call_unit(module, x, batch, last=u == self.last)
            if u == self.last and not self.user_loop:
                self.losses.append(out.detach().float())
                out = out / self.accumulate if self.accumulate > 1 else out
        optr = out.untyped_storage().data_ptr()
        if optr not in seen:
            seen[optr] = out.untyped_storage().nbytes()
        for t in batch.extra_tensors():
            seen.pop(t.untyped_storage().data_ptr(), None)
        self._meter_extras(micro)
        return out, sum(seen.values())

    def _forward(self, op: Op) -> None:
        table = self.table
        u = self._unit(op)
        for name in op.reads:
            if name != "token":
                table.read(name, op)
        x = self._unit_input(op)
        recompute = self.graph.units[u].recompute
        x_in = x.detach()
        if x_in.is_floating_point() and not recompute and self._wants_input_grad(u):
            x_in.requires_grad_(True)
        rng = rng_state(self.device) if recompute else None
        out, nbytes = self._run_unit(u, x_in, op.micro, grad=not recompute and u in self.has_backward)
        if u == 0:
            nbytes += x.numel() * x.element_size()
        if recompute:
            nbytes = out.numel() * out.element_size() + (x.numel() * x.element_size() if u == 0 else 0)
        slot = table.slot(f"act[{u}]", op)
        if slot.live:
            table.meter.release(slot.buf.name)
        slot.record, slot.live = ActRecord(x_in, out, op.micro, nbytes, rng), True
        table.meter.hold(slot.buf.name, slot.buf.tier, "act", "working", nbytes)
        if u == self.last and self.user_loop:
            self.outputs[op.micro] = user_output(out, trains=not self.evaluating and u in self.has_backward)
            if "loss" in table.slots and out.numel() == 1:
                table.write("loss", op).copy_(out.detach().reshape(()))
        elif u == self.last and "loss" in table.slots:
            table.write("loss", op).copy_(self.losses[-1])

    def _recompute(self, op: Op) -> None:
        table = self.table
        u = self._unit(op)
        rec = table.read_record(f"act[{u}]", op)
        x_in = rec.input.detach()
        if x_in.is_floating_point() and self._wants_input_grad(u):
            x_in.requires_grad_(True)
        losses = list(self.losses)
        with replayed_rng(rec.rng, self.device):   # the forward's dropout masks, not new ones
            out, nbytes = self._run_unit(u, x_in, op.micro, grad=True)
        self.losses = losses        # the loss was recorded by the forward
        slot = table.slot(f"act_inner[{u}]", op)
        slot.record, slot.live = ActRecord(x_in, out, op.micro, nbytes), True
        table.meter.hold(slot.buf.name, slot.buf.tier, "act_inner", "working", nbytes)

    def _wants_input_grad(self, u: int) -> bool:
        """An earlier unit's backward reads this unit's input gradient (unit 0's input is data)."""
        return u > 0 and f"act_grad[{u}]" in self.table.slots

    def _grad_slot(self, u: int, op: Op) -> Slot:
        slot = self.table.slot(f"grad_full[{u}]", op)
        if not slot.live:
            self.table.alloc(slot)
        return slot

    def _backward(self, op: Op) -> None:
        table, flats = self.table, self.table.flats
        u = self._unit(op)
        for name in op.reads:
            if name != "token" and not name.startswith("grad_full["):
                table.read(name, op)
        rec = table.read_record(f"act_inner[{u}]" if self.graph.units[u].recompute else f"act[{u}]", op)
        grad_out: torch.Tensor | None
        if u < self.last:
            grad_out = table.read_tensor(f"act_grad[{u + 1}]", op)
        elif self.user_loop:
            grad_out = self.grad_outs.pop(op.micro, None)
            if grad_out is None:
                raise table.error(op, f"no gradient for micro-batch {op.micro}'s output (engine.backward not called)")
        else:
            # a fill on the device, not a pageable host-to-device copy per micro-batch
            grad_out = (torch.full((), self.scaler.scale, dtype=rec.output.dtype, device=rec.output.device)
                        if self.scaler.enabled else None)
        fp = flats[u]
        own_idx = fp.trainable
        tied = [(o, i) for o, i in self.tied.get(u, []) if flats[o].params[i].requires_grad]
        wants_input = rec.input is not None and rec.input.requires_grad
        inputs = ([rec.input] if wants_input else []) + [fp.params[i] for i in own_idx] + \
            [flats[o].params[i] for o, i in tied]
        grads = unit_grads(rec.output, inputs, grad_out)
        if wants_input:
            g_in, grads = grads[0], grads[1:]
            if u > 0:
                slot = table.slot(f"act_grad[{u}]", op)
                slot.tensor, slot.live = g_in, True
                table.meter.hold(slot.buf.name, slot.buf.tier, "act_grad", "working",
                                 g_in.numel() * g_in.element_size())
        own, from_users = grads[:len(own_idx)], grads[len(own_idx):]
        with torch.no_grad():
            if own_idx:
                gslot = self._grad_slot(u, op)
                for i, g in zip(own_idx, own):
                    pending = self._pending_tied.pop((u, i), None)
                    total = g if pending is None else (pending if g is None else pending + g)
                    if total is not None:
                        fp.grad_view(i).add_(total)
                gslot.clean = False
            for (owner, i), g in zip(tied, from_users):
                if g is None:
                    continue
                oslot = self._grad_slot(owner, op)
                if oslot.clean:
                    flats[owner].grad_views[i].add_(g)
                    oslot.clean = False
                else:   # the owner's backward adds it together with its own part (autograd's order)
                    prev = self._pending_tied.get((owner, i))
                    self._pending_tied[(owner, i)] = g if prev is None else prev + g
            for unit in self.prescale.after_backward.get(op.id, ()):
                flats[unit].grad.mul_(1.0 / self.world)

    # -- norm and step ------------------------------------------------------------------
    def _norm(self, op: Op) -> None:
        """One unit's squared gradient norm (``op.unit`` set), or the norm of every gradient, or
        the sum of the units' parts: ``sum(stack([||g_u||^2 for u in units]))`` either way."""
        table = self.table
        reads = [n for n in op.reads if n != "token"]
        out = next(n for n in op.writes if n != "token")
        with torch.no_grad():
            if op.unit is not None:
                (grad,) = (table.read_tensor(n, op) for n in reads)
                blocks: list[torch.Tensor] = []
                g = upcast_on_host(table.pool, grad, blocks)
                table.write(out, op).copy_(torch.linalg.vector_norm(g, 2, dtype=torch.float32) ** 2)
                del g    # the pool keeps a block only once no view of it is left
                give_back(table.pool, blocks)
                return
            if not self.norm_reduced and not self.mixed and self.stage == 0:
                # exactly clip_grad_norm_'s total norm over the parameters' gradients
                views = [fp.grad_view(i) for fp in table.flats for i in fp.trainable]
                value = _total_norm(views)
            else:
                parts = [table.read_tensor(n, op) for n in reads]
                if all(table.slot(n).buf.kind == "norm" for n in reads):
                    sq = parts
                else:
                    sq = [torch.linalg.vector_norm(t, 2, dtype=torch.float32) ** 2 for t in parts]
                value = torch.stack(sq).sum() if sq else torch.zeros((), dtype=torch.float32)
                if not self.norm_reduced:
                    value = value.sqrt()
            table.write(out, op).copy_(value)

    def _finish_norm(self) -> StepPlan:
        """Overflow, clip coefficient and unscale factor, once per step (all step ops share it)."""
        with self._lock:
            if self._plan is not None:
                return self._plan
            plan = StepPlan(inv_scale=1.0 / self.scaler.scale)
            slot = self.table.slots.get("norm")
            if slot is not None and slot.live and (self.clip is not None or self.scaler.enabled):
                norm = self.table.tensor("norm")
                total = norm.sqrt() if self.norm_reduced else norm.clone()
                plan.overflow = self.scaler.enabled and overflowed(total)
                total = total / self.scaler.scale if self.scaler.enabled else total
                plan.grad_norm = float(total)
                if self.clip is not None and not plan.overflow:
                    plan.coef = clip_coefficient(total, float(self.clip))
                    # blocking: the coefficient's kernel is done before any lane reads the plan
                    plan.coef_host = plan.coef if plan.coef.device.type == "cpu" else plan.coef.to("cpu")
            self._plan = plan
            return plan

    def _step(self, op: Op) -> None:
        table = self.table
        u = self._unit(op)
        fp, opt = table.flats[u], table.optims[u]
        kinds = {parse_buffer_name(n)[0]: n for n in op.reads if n != "token"}
        wkinds = {parse_buffer_name(n)[0]: n for n in op.writes if n != "token"}
        grad_name = kinds.get("grad_shard") or kinds.get("grad_full")
        optim_name = kinds.get("optim") or wkinds.get("optim")
        dest_name = wkinds.get("param_shard") or wkinds.get("param_full")
        if grad_name is None or optim_name is None or dest_name is None:
            raise table.error(op, "a step reads a gradient and optimizer buffer and writes parameters")
        plan = self._finish_norm()
        grad = table.read_tensor(grad_name, op)
        optflat = table.read_tensor(optim_name, op)
        dest_slot = table.slot(dest_name, op)
        fresh = not dest_slot.live
        dest = table.write(dest_name, op)
        dest_kind = dest_slot.buf.kind
        lay = fp.layout
        # the trainable parts: a prefix of the parameters, all of the gradient and optimizer state
        full_parts = [slice(*lay.full_range(p)) for p in range(lay.trainable_parts)]
        shard_parts = [slice(*lay.shard_range(p)) for p in range(lay.trainable_parts)]
        d_parts = full_parts if dest_kind == "param_full" else shard_parts
        g_parts = full_parts if parse_buffer_name(grad_name)[0] == "grad_full" else shard_parts
        with torch.no_grad():
            if fresh and (not opt.master or "param_full" in kinds or "param_shard" in kinds):
                # the values to update come from the parameters the step reads: the gathered
                # ones (stages 1-2) or the shard's home on another tier (stage 3 offload); a
                # partly frozen unit's fresh copy also carries its frozen parts on
                every = range(lay.parts)
                self._load_current(op, u, dest, [slice(*(lay.full_range(p) if dest_kind == "param_full"
                                                         else lay.shard_range(p))) for p in every])
            masters = opt.master_parts(optflat) if opt.master else None
            if plan.overflow:
                if masters is not None:
                    for d, m in zip(d_parts, masters):
                        dest[d].copy_(m)
                return
            blocks: list[torch.Tensor] = []
            if masters is not None:
                g32 = [upcast_on_host(table.pool, grad[s], blocks).float() for s in g_parts]
                params = masters
            else:
                g32 = [grad[s] for s in g_parts]
                params = [dest[d] for d in d_parts]
            _unscale_and_clip(g32, plan)
            opt.step(optflat, params, g32)
            if masters is not None:
                for d, m in zip(d_parts, masters):
                    dest[d].copy_(m)
            del g32    # the pool keeps a block only once no view of it is left
            give_back(table.pool, blocks)

    def _load_current(self, op: Op, u: int, dest: torch.Tensor, d_parts: list[slice]) -> None:
        src_name = next((n for n in op.reads if parse_buffer_name(n)[0] in ("param_full", "param_shard")), None)
        if src_name is None:
            raise self.table.error(op, "an fp32 step without a master copy must read the current parameters")
        slot = self.table.read(src_name, op)
        src = self.transfers.load(slot)
        if slot.buf.kind == "param_full":
            for d, s in zip(d_parts, self.table.flats[u].owned(src)):
                dest[d].copy_(s)
        else:
            dest.copy_(src)


def user_output(out: torch.Tensor, trains: bool) -> torch.Tensor:
    """The last unit's output as the user's loop gets it: detached from the units' graph (their
    backward is zdsl's), a leaf that requires grad when a backward follows (``trains``; a
    recomputed unit's forward ran without autograd), so the user's loss can be differentiated
    with respect to it."""
    leaf = out.detach()
    return leaf.requires_grad_(True) if trains and leaf.is_floating_point() else leaf


def upcast_on_host(pool, t: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
    """``t`` in fp32 where the host would upcast it: a CPU tensor of another dtype is copied into
    a block of the host ``pool`` (appended to ``blocks``), since a fresh tensor of that size is newly
    mapped, page-faulted memory every step (hundreds of MB at capacity.zs sizes). Any other
    tensor comes back as it is. The caller drops every view of the result, then :func:`give_back`."""
    if t.device.type != "cpu" or t.dtype == torch.float32:
        return t
    block = pool.take(t.numel() * 4)
    blocks.append(block)
    return typed(block, t.numel(), torch.float32).copy_(t)


def _unscale_and_clip(grads: list[torch.Tensor], plan: StepPlan) -> None:
    """The fp32 gradients of a step, in place: unscaled (loss scaling), then clipped."""
    for g in grads:
        if plan.inv_scale != 1.0:
            g.mul_(plan.inv_scale)
        coef = plan.coef_for(g)
        if coef is not None:
            g.mul_(coef)


def give_back(pool, blocks: list[torch.Tensor]) -> None:
    """Return :func:`upcast_on_host`'s blocks; the pool keeps a block only once no view of it is left."""
    for block in blocks:
        pool.give(block)
    blocks.clear()


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
