"""One rank's training state: the composition the executor drives, one op at a time.

:class:`RankState` owns every buffer the compiled graph names on this rank and runs single ops on
them. It does not decide order: the trio executor (``runtime/exec/executor.py``) runs ops when
their dependencies are done, and a plain loop over ``graph.ops`` is also a valid execution (graph
order respects every dependency). It satisfies the executor's ``OpState`` protocol
(``runtime/exec/contract.py``). Each concept has its own file:

* ``buffers.py``: the buffer table (slots, allocation, release, ``mem.free``);
* ``compute.py``: ``compute.forward|backward|recompute|norm|step`` and the step frame;
* ``comm.py``: ``comm.*`` collectives, and where gradients get their 1/world factor;
* ``transfers.py``: ``copy.h2d|d2h`` and ``nvme.read|write`` (the NVMe swapper);
* ``views.py``: the state dict, export and checkpoint shards;
* ``flat.py``, ``optim.py``, ``precision.py``, ``memory.py``: flat parameters, the optimizer of a
  unit, loss scaling, the memory meter.

Entry points: ``run_compute(op)`` (synchronous; the executor calls it in a worker thread),
``start_collective(op) -> handle`` (``is_completed()`` or ``wait()`` finishes the op, both safe),
``run_copy(op)``, ``run_nvme(op)``, ``free(op)``, ``run_op(op)`` (any op, synchronously: sequential
drivers and tests), and ``step_begin(step, batches)`` / ``step_end() -> dict`` around each step;
``evaluation()``, with ``eval_begin(batch)`` / ``eval_end() -> loss`` around each pass of a
forward-only graph (``zdsl/compile/eval_graph.py``) run on these same buffers.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from zdsl.ir import Buffer, Op, TaskGraph, group_size
from zdsl.runtime.dist.group import CollectiveGroups
from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.lazy import LazyUnits
from zdsl.runtime.models.protocol import tied_indices, unit_modules
from zdsl.runtime.state.buffers import ACT_KINDS, BufferTable
from zdsl.runtime.state.comm import Collective, Collectives, plan_prescale
from zdsl.runtime.state.compute import Compute
from zdsl.runtime.state.errors import StateError
from zdsl.runtime.state.flat import FlatParam, layout_of
from zdsl.runtime.state.memory import MemoryMeter
from zdsl.runtime.state.optim import UnitOptimizer, segment_decay
from zdsl.runtime.state.precision import compute_dtype
from zdsl.runtime.state.transfers import Transfers
from zdsl.runtime.state.views import StateViews


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
        self.device = torch.device(device)
        self.config = graph.config or {}
        self.opt_config = dict(self.config.get("optimizer") or {})
        self.stage = graph.stage
        self.dtype = compute_dtype(graph.precision)
        self.meter = MemoryMeter(self.device)

        modules = unit_modules(model)
        if len(modules) != len(graph.units):
            raise StateError(f"rank {rank}: the model has {len(modules)} units, the compiled graph "
                             f"{len(graph.units)}")
        tied = tied_indices(model, modules)
        self.table = BufferTable(graph, rank, self.device, self.dtype, self.meter)
        self.transfers = Transfers(self.table, self.config)
        self.views = StateViews(self.table, self.transfers, self.stage, model, modules)
        for user, uses in tied.items():
            for owner, _ in uses:
                if owner not in graph.units[user].uses:
                    raise StateError(f"rank {rank}: unit {user} reads a parameter of unit {owner} (tied), "
                                     f"but the graph does not list that use")
        check_step_outputs(graph, self.table.error)
        self.groups = CollectiveGroups.of_graph(graph, rank, world)     # before any unit gathers
        self._build_units(model, modules)
        for module in (model, *modules):   # non-parameter buffers (masks, tables) go where the compute runs
            for sub in module.modules():
                for key, value in list(sub._buffers.items()):
                    if value is not None and value.device != self.device:
                        sub._buffers[key] = value.to(self.device)

        self.prescale = plan_prescale(graph, world, self.table.error)
        self.collectives = Collectives(self.table, world, self.prescale, self.groups)
        self.compute = Compute(graph, self.table, self.transfers, modules, tied, world, self.prescale,
                               self.opt_config.get("clip"), prepare=getattr(model, "prepare", None))

    # -- start-up ------------------------------------------------------------------
    def _build_units(self, model: nn.Module, modules: list[nn.Module]) -> None:
        """Unit by unit: flatten its parameters, make its optimizer, fill its persistent buffers,
        then drop the initial copy, so start-up holds about one model's worth beyond the state;
        a lazily built model (too large for host memory) gets its values one unit at a time
        here, so start-up then holds one unit beyond the state."""
        graph, rank, world = self.graph, self.rank, self.world
        # a unit has a shard per rank of its shard group (HSDP's node, MiCS's group, else every rank)
        shards, secondary = graph.shard_ranks(), graph.secondary_group()
        shard, group = rank % shards, self.groups.of(graph.shard_group())
        grad_dtypes = {}
        for b in graph.buffers.values():
            if b.kind in ("grad_full", "grad_shard") and b.unit is not None:
                grad_dtypes[b.unit] = compute_dtype(b.dtype)
        lazy = model if isinstance(model, LazyUnits) and model.is_lazy else None
        for info, module in zip(graph.units, modules):
            if lazy is not None:
                lazy.materialize_unit(info.index)
            lay = layout_of(info.numel, info.padded_numel, info.parts, shards, info)
            try:
                fp = FlatParam(module, lay, shard, self.dtype, grad_dtypes.get(info.index, self.dtype), self.device,
                               frozen=info.frozen, group=group)
            except ValueError as exc:
                raise StateError(f"rank {rank}: unit {info.index} ({info.name}): {exc}") from None
            if secondary is not None:
                fp.set_secondary(group_size(secondary, world), rank % group_size(secondary, world))
            self.table.flats.append(fp)
            trainable = range(lay.trainable_parts if info.trains else 0)       # frozen: no optimizer state
            ranges = ([lay.full_range(p) for p in trainable] if self.stage == 0   # stage 0: whole unit
                      else [lay.shard_range(p) for p in trainable])
            whole = self.stage == 0
            opt = UnitOptimizer(self.opt_config, ranges, master=info.master,
                                decay=segment_decay(info.decay, lay, shard, whole),
                                frozen=segment_decay(fp.frozen_ranges(), lay, shard, whole) if info.frozen else None)
            for p in opt.params:    # placeholders (each step points them at the real slices): a
                p.data = torch.empty(0)   # shard-size fp32 zero per unit would be 4 bytes/param held
            self.table.optims.append(opt)
            self._init_persistent(info.index)
            fp.initial = None
        self._init_persistent(None)

    def _fill_initial(self, buf: Buffer, t: torch.Tensor) -> None:
        """Write a persistent buffer's step-0 contents into ``t`` in place (no full-size temporaries)."""
        if buf.kind in ("norm", "loss") or buf.kind in ("grad_full", "grad_shard"):
            t.zero_()
            return
        u = self.table.unit_of(buf)
        fp = self.table.flats[u]
        assert fp.initial is not None       # dropped only after its unit's buffers are filled
        if buf.kind == "param_full":
            t.copy_(fp.initial)
        elif buf.kind == "param_shard":
            for dst, src in zip(fp.shard_parts(t), fp.owned(fp.initial)):
                dst.copy_(src)
        elif buf.kind == "optim":
            t.zero_()
            opt = self.table.optims[u]
            if opt.master:      # of the trainable parts, the first ones
                if self.stage == 0:
                    t[:opt.numel].copy_(fp.initial[:opt.numel])
                else:
                    initial = fp.owned(fp.initial)[:fp.layout.trainable_parts]
                    for dst, src in zip(fp.shard_parts(t[:opt.numel]), initial):
                        dst.copy_(src)

    def _init_persistent(self, unit: int | None) -> None:
        """Give the persistent buffers of ``unit`` (None: the unit-less ones) their start values."""
        table = self.table
        for name, slot in table.slots.items():
            buf = slot.buf
            if not buf.persistent or buf.unit != unit:
                continue
            if buf.kind in ACT_KINDS:
                raise StateError(f"rank {self.rank}: activations cannot be persistent ({name})")
            if buf.tier == "nvme":
                value = torch.empty(table.numel(buf), dtype=table.dtype_of(buf))
                self._fill_initial(buf, value)
                self.transfers.swapper_of(name).write_sync(name, value)
                slot.live = True
                self.meter.hold(name, "nvme", buf.kind, table.category(buf), value.numel() * value.element_size())
                continue
            self._fill_initial(buf, table.alloc(slot))

    # -- what the executor calls (runtime/exec/contract.py) ---------------------------------
    def run_compute(self, op: Op) -> None:
        self.compute.run(op)

    def start_collective(self, op: Op) -> Collective:
        return self.collectives.start(op)

    def run_copy(self, op: Op) -> None:
        self.transfers.run_copy(op)

    def run_nvme(self, op: Op) -> None:
        self.transfers.run_nvme(op)

    def free(self, op: Op) -> None:
        self.table.free(op)

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
            raise self.table.error(op, f"unknown op kind {kind!r}")

    # -- the step frame (the training loop) ------------------------------------------------
    def step_begin(self, step: int, batches: list[Batch]) -> None:
        """Start a step: one ``Batch`` per micro-batch for this rank."""
        self.compute.step_begin(step, batches)

    def step_end(self) -> dict:
        """Finish a step: ``loss`` (this rank's mean over micro-batches), ``skipped``
        (fp16 overflow), ``grad_norm`` (when computed), ``loss_scale``."""
        return self.compute.step_end()

    def evaluation(self, eval_mode: bool = True):
        """A context for forward-only passes (an evaluation graph's ops) that leave the training
        exactly as it was: see ``Compute.evaluation`` (``eval_mode=False``: units keep their modes)."""
        return self.compute.evaluation(eval_mode)

    def eval_begin(self, batch: Batch) -> None:
        """Start one forward-only pass over ``batch``, inside :meth:`evaluation`."""
        self.compute.eval_begin(batch)

    def eval_end(self) -> torch.Tensor:
        """The pass's loss (fp32 scalar tensor): this rank's mean over the batch's counted labels."""
        return self.compute.eval_end()

    @property
    def scaler(self):
        """The fp16 loss scaler (disabled in other precisions); checkpoints save and restore it."""
        return self.compute.scaler

    # -- buffers and memory -----------------------------------------------------------------
    @property
    def slots(self):
        return self.table.slots

    @property
    def flats(self) -> list[FlatParam]:
        return self.table.flats

    @property
    def optims(self) -> list[UnitOptimizer]:
        return self.table.optims

    def tensor(self, name: str) -> torch.Tensor:
        """The live tensor of a flat or scalar buffer (tests, checkpoints)."""
        return self.table.tensor(name)

    def live_working(self) -> list[str]:
        """Working buffers still held (after a step: none, unless the graph leaks)."""
        return self.table.live_working()

    def memory_report(self) -> dict:
        return self.meter.report()

    # -- NVMe ---------------------------------------------------------------------------------
    @property
    def opened_swappers(self) -> list:
        """The NVMe swappers this rank has opened, one per distinct placement (never opens one)."""
        return self.transfers.opened_swappers

    def close_swap(self) -> None:
        """Remove this rank's NVMe swap files, if it opened any."""
        self.transfers.close_swap()

    # -- checkpoints and export (runtime/state/views.py) --------------------------------------
    @property
    def param_names(self) -> list[list[str]]:
        """Per unit, its parameters' names in the model's state dict."""
        return self.views.param_names

    @property
    def aliases(self) -> dict[str, str]:
        """A tied parameter's other state-dict names -> its own name."""
        return self.views.aliases

    def export_state(self) -> dict[str, torch.Tensor]:
        return self.views.export_state()

    def export(self, path) -> None:
        self.views.export(path)

    def shard_state(self) -> dict[str, torch.Tensor]:
        return self.views.shard_state()

    def load_shard_state(self, shards: dict[str, torch.Tensor], steps: int, moments: bool = True) -> None:
        self.views.load_shard_state(shards, steps, moments)

    def moment_names(self) -> list[str]:
        return self.views.moment_names()

    def optimizer_steps(self) -> int:
        return self.views.optimizer_steps()

    def buffers(self) -> dict[str, torch.Tensor]:
        return self.views.buffers()

    def load_buffers(self, values: dict[str, torch.Tensor]) -> None:
        self.views.load_buffers(values)


def check_step_outputs(graph: TaskGraph, error: Callable[[Op, str], StateError]) -> None:
    """Refuse a graph that frees a step's updated parameters before anything reads them
    (the update would be lost silently)."""
    ops = graph.ops
    for i, op in enumerate(ops):
        if op.kind != "compute.step":
            continue
        for name in op.writes:
            buf = graph.buffers.get(name)
            if buf is None or buf.persistent or buf.kind not in ("param_shard", "param_full"):
                continue
            for later in ops[i + 1:]:
                if name in later.reads:
                    break
                if later.kind == "mem.free" and name in later.writes:
                    raise error(op, f"the graph frees {name} (op {later.id}) before anything reads "
                                    f"it: unit {op.unit}'s updated parameters would be lost")
            else:
                raise error(op, f"nothing reads {name} after the step: unit {op.unit}'s "
                                f"updated parameters would be lost")
