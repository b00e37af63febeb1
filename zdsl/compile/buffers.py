"""Every buffer a step graph names, sized from its name when first named.

Contract: ``BufferTable.get(name)`` gives the one ``Buffer`` of that name (``kind[unit]@tier``,
:func:`zdsl.ir.buffer_name`), its bytes on one rank from the unit's flat layout and the
schedule's precision: parameters padded for the ranks, gradients and optimizer state for the
trainable parts only, an activation with what autograd saves for the backward. The buffers
named at construction are the model states (persistent: live the whole step, never freed).
Shards are of the unit's shard group (``UnitHomes.shard_ranks``), the secondary shard of hpZ's node.
``forward_only`` (the eval graph) sizes an activation as the unit's input alone, nothing saved.
"""
from __future__ import annotations

from zdsl.compile.homes import UnitHomes
from zdsl.compile.pinning import host_pinned
from zdsl.ir import Buffer, optimizer_bytes_per_param, parse_buffer_name


class BufferTable:
    def __init__(self, homes: UnitHomes, persistent: list[str], forward_only: bool = False):
        self.homes = homes
        self.forward_only = forward_only
        self.persistent = set(persistent)
        self.by_name: dict[str, Buffer] = {}
        for name in self.persistent:
            self.get(name)

    def get(self, name: str) -> Buffer:
        if name in self.by_name:
            return self.by_name[name]
        kind, u, suffix = parse_buffer_name(name)
        tier = suffix or "device"
        nbytes, dtype = self._size(kind, u)
        homes = self.homes
        buf = Buffer(name, kind, u, tier, nbytes, persistent=name in self.persistent, dtype=dtype,
                     pinned=host_pinned(homes.schedule, homes.tiers, kind, u, tier))
        self.by_name[name] = buf
        return buf

    def _size(self, kind: str, u: int | None) -> tuple[int, str]:
        """Bytes on one rank and dtype of a buffer of ``kind`` for unit ``u``."""
        if kind in ("norm", "loss"):
            return 4, "fp32"
        if u is None:
            if kind != "token":
                raise ValueError(f"a {kind} buffer belongs to a unit; got one without")
            return 0, self.homes.precision
        return self._unit_size(kind, u)

    def _unit_size(self, kind: str, u: int) -> tuple[int, str]:
        homes = self.homes
        layout, spec = homes.layouts[u], homes.specs[u]
        elem_bytes, batch = homes.elem_bytes, homes.batch
        if kind == "param_full":
            return layout.padded_numel * elem_bytes, homes.precision
        if kind == "param_shard":
            return layout.shard_numel * elem_bytes, homes.precision
        if kind == "param_sec":       # hpZ: this rank's slice of the unit within its node
            return layout.padded_numel // homes.secondary_ranks * elem_bytes, homes.precision
        if kind == "grad_full":       # gradients and optimizer state: the trainable parts only
            return layout.trainable_numel * elem_bytes, homes.precision
        if kind == "grad_shard":
            return layout.trainable_shard_numel * elem_bytes, homes.precision
        if kind == "optim":
            numel = layout.trainable_numel if homes.stage == 0 else layout.trainable_shard_numel
            optimizer = homes.schedule.optimizer
            return numel * optimizer_bytes_per_param(optimizer.kind, optimizer.momentum, homes.has_master(u)), "fp32"
        if kind == "act":
            if self.forward_only:      # forward only: a unit's input, nothing saved for a backward
                return batch * spec.input_elems_per_seq * elem_bytes, homes.precision
            keeps = u not in homes.recompute and homes.needs_backward[u]   # autograd's saved tensors
            elems = spec.input_elems_per_seq + (spec.act_elems(elem_bytes) if keeps else 0)
            extras = homes.extras_elems if u == homes.extras_holder else 0
            return (batch * elems + extras) * elem_bytes, homes.precision
        if kind == "act_inner":
            return batch * spec.act_elems(elem_bytes) * elem_bytes, homes.precision
        if kind == "act_grad":
            return batch * spec.input_elems_per_seq * elem_bytes, homes.precision
        return 0, homes.precision
