"""The state as checkpoints and exports see it: the model's state dict, and this rank's shards.

Everything here runs between steps. The current fp32 parameters are read from their persistent
home: the optimizer's master copy where the graph keeps one, else the parameters themselves.
Sharded units are all-gathered, so every rank calls :meth:`StateViews.export_state` and
:meth:`StateViews.load_shard_state`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from safetensors.torch import save_file

from zdsl.runtime.state.buffers import BufferTable
from zdsl.runtime.state.errors import StateError
from zdsl.runtime.state.optim import UnitOptimizer
from zdsl.runtime.state.transfers import Transfers

# optimizer state names (torch's) -> checkpoint names
SHARD_NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum_buffer": "momentum"}


class StateViews:
    """Reads and writes one rank's model state in the shapes checkpoints and exports use."""

    def __init__(self, table: BufferTable, transfers: Transfers, stage: int, model: nn.Module,
                 modules: list[nn.Module]):
        self.table, self.transfers, self.stage = table, transfers, stage
        self.rank, self.device, self.dtype = table.rank, table.device, table.dtype
        names = {id(p): n for n, p in model.named_parameters()}
        self.param_names = [[names.get(id(p), f"units.{u}.{n}") for n, p in m.named_parameters()]
                            for u, m in enumerate(modules)]
        # The rest of the model's state dict, for an export that loads with strict=True: a tied
        # parameter registered a second time (``lm_head.weight is wte.weight``), and buffers.
        self.aliases = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
                        if names[id(p)] != n}
        self._buffer_homes = [(f"{prefix}.{key}" if prefix else key, sub, key)
                              for prefix, sub in model.named_modules(remove_duplicate=False)
                              for key, value in sub._buffers.items()
                              if value is not None and key not in sub._non_persistent_buffers_set]

    # -- the model's buffers ---------------------------------------------------------
    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers by their state-dict names, on the CPU."""
        return {name: sub._buffers[key].detach().cpu().clone() for name, sub, key in self._buffer_homes}

    def load_buffers(self, values: dict[str, torch.Tensor]) -> None:
        """Put back buffers saved by :meth:`buffers` (a name this model lacks is ignored)."""
        with torch.no_grad():
            for name, sub, key in self._buffer_homes:
                if name in values:
                    sub._buffers[key].copy_(values[name])

    # -- full parameters ------------------------------------------------------------------
    def _truth(self, u: int) -> tuple[torch.Tensor, bool]:
        """Unit ``u``'s current fp32 parameters: (tensor, is_shard), from their home."""
        table = self.table
        opt = table.optims[u]
        slot = table.home("optim", u) if opt.master else \
            (table.home("param_full", u) or table.home("param_shard", u))
        if slot is None:
            raise StateError(f"rank {self.rank}: no persistent home for unit {u}'s parameters")
        t = self.transfers.load(slot)
        if opt.master:
            master = t[:opt.numel].float().to(self.device)
            if not table.flats[u].layout.frozen_parts:
                return master, self.stage > 0
            # a partly frozen unit: the master holds the trainable parts, the parameters the rest
            home = table.home("param_full", u) or table.home("param_shard", u)
            if home is None:
                raise StateError(f"rank {self.rank}: no persistent home for unit {u}'s parameters")
            rest = self.transfers.load(home).float().to(self.device)
            if self.stage > 0 and home.buf.kind == "param_full":
                rest = table.flats[u].shard_of(rest)
            rest[:opt.numel] = master
            return rest, self.stage > 0
        return t.float().to(self.device), slot.buf.kind == "param_shard"

    def _gathered(self, u: int, shard: torch.Tensor) -> torch.Tensor:
        """Unit ``u``'s full fp32 flat from every rank's ``shard`` (all ranks call it)."""
        fp = self.table.flats[u]
        full = torch.empty(fp.layout.padded_numel, dtype=torch.float32, device=self.device)
        for part in range(fp.layout.parts):
            fp.gather(part, full, shard.to(self.device).contiguous(), None, async_op=False)
        return full

    def export_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict: full fp32 parameters by the model's own names, a tied
        parameter under each of its names (as separate tensors), and the buffers. Every rank
        must call it (sharded units are all-gathered). Call between steps."""
        out: dict[str, torch.Tensor] = {}
        for u, fp in enumerate(self.table.flats):
            t, is_shard = self._truth(u)
            if is_shard:
                t = self._gathered(u, t)
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
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))

    # -- checkpoint shards ------------------------------------------------------------------
    def _optim_flat(self, u: int) -> torch.Tensor:
        slot = self.table.home("optim", u)
        if slot is None:
            raise StateError(f"rank {self.rank}: no optimizer state for unit {u}")
        return self.transfers.load(slot)

    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's layout shard of every unit, fp32 on the CPU: ``u{i}.param`` and the
        optimizer's moments (``u{i}.exp_avg``, ``u{i}.exp_avg_sq``, ``u{i}.momentum``), none for
        a unit that does not train (``freeze``). At stage 0, where every rank holds everything,
        the rank's slice of it. Between steps."""
        out: dict[str, torch.Tensor] = {}
        for u, fp in enumerate(self.table.flats):
            opt = self.table.optims[u]
            truth, is_shard = self._truth(u)
            out[f"u{u}.param"] = (truth if is_shard else fp.shard_of(truth)).detach().cpu().clone()
            if not opt.flat_numel:
                continue
            flat = self._optim_flat(u)
            first = 1 if opt.master else 0
            for k, name in enumerate(opt.names):
                seg = self._param_sized(fp, flat[(first + k) * opt.numel:(first + k + 1) * opt.numel])
                out[f"u{u}.{SHARD_NAMES[name]}"] = (seg if self.stage > 0 else fp.shard_of(seg)).cpu().clone()
        return out

    def _param_sized(self, fp, seg: torch.Tensor) -> torch.Tensor:
        """Optimizer state (the trainable parts) in the parameters' layout, zero where frozen, so
        a checkpoint's shards all have the layout its index records (and re-cut as parameters do)."""
        size = fp.layout.padded_numel if self.stage == 0 else fp.layout.shard_numel
        if seg.numel() == size:
            return seg
        out = torch.zeros(size, dtype=seg.dtype, device=seg.device)
        out[:seg.numel()] = seg
        return out

    def moment_names(self) -> list[str]:
        """The optimizer state this schedule's optimizer keeps, by checkpoint name (``exp_avg``...)."""
        optims = self.table.optims
        return [SHARD_NAMES[n] for n in (optims[0].names if optims else ())]

    def optimizer_steps(self) -> int:
        """Steps taken, by the first unit that trains (a frozen one keeps no count)."""
        optims = [opt for opt in self.table.optims if opt.trains] or self.table.optims
        return optims[0].steps if optims else 0

    def _fill_optim(self, u: int, opt: UnitOptimizer, flat: torch.Tensor, segment: torch.Tensor,
                    shards: dict[str, torch.Tensor], moments: bool) -> None:
        """Unit ``u``'s optimizer state ``flat`` from ``shards``: the master copy from ``segment`` (the
        parameters the optimizer covers), then each moment, zero where ``moments`` is False or the
        checkpoint holds none."""
        if opt.master:
            flat[:opt.numel].copy_(segment[:opt.numel])
        first = 1 if opt.master else 0
        for k, name in enumerate(opt.names):
            seg = flat[(first + k) * opt.numel:(first + k + 1) * opt.numel]
            key = f"u{u}.{SHARD_NAMES[name]}"
            if not moments or key not in shards:
                seg.zero_()
                continue
            m = shards[key].float()
            seg.copy_((self._gathered(u, m) if self.stage == 0 else m)[:opt.numel])

    def load_shard_state(self, shards: dict[str, torch.Tensor], steps: int, moments: bool = True) -> None:
        """Inverse of :meth:`shard_state` (all ranks call it: stage 0-2 parameters and
        stage-0 moments are rebuilt by all-gathers). Between steps. ``moments=False``: only the
        parameters (and master copy) come from ``shards``; the optimizer's moments start at zero,
        as they do for a unit the checkpoint holds none for (it was frozen when saved)."""
        table = self.table
        with torch.no_grad():
            for u, fp in enumerate(table.flats):
                opt = table.optims[u]
                shard = shards[f"u{u}.param"].float()
                if shard.numel() != fp.layout.shard_numel:
                    raise StateError(f"rank {self.rank}: unit {u}: checkpoint shard has {shard.numel()} "
                                     f"elements, this layout {fp.layout.shard_numel}")
                full = self._gathered(u, shard) if self.stage < 3 else None
                segment = full if full is not None and self.stage == 0 else shard   # what the optimizer covers
                flat = self._optim_flat(u) if opt.flat_numel else None
                if flat is not None:
                    self._fill_optim(u, opt, flat, segment, shards, moments)
                home = table.home("param_full", u) or table.home("param_shard", u)
                if home is None:
                    raise StateError(f"rank {self.rank}: unit {u} has no parameter buffer to load into")
                value = full if full is not None and home.buf.kind == "param_full" else shard
                self.transfers.store(home, value.to(self.dtype))
                optim_home = table.home("optim", u)
                if flat is not None and optim_home is not None and optim_home.buf.tier == "nvme":
                    self.transfers.swapper_of(optim_home.buf.name).write_sync(optim_home.buf.name, flat)
                opt.restore_steps(steps)
