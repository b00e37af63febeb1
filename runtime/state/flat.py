"""Flat, padded, sharded storage of one unit's parameters and gradients.

A unit's parameters are laid end to end in one flat buffer of ``padded_numel``
elements, in registration order (a partly frozen unit: trainable ones first),
cut into ``parts`` parts (one collective each, the bucket split of
``zdsl.model.layout``); each part splits evenly over the ranks and rank r's
shard is the concatenation of its slice of every part. Every parameter's
``.data`` is a view into the full buffer, and every trainable parameter's
gradient a view into the flat gradient buffer (the trainable parts only), so:

* a gather is one all-gather per part straight into the full buffer's
  storage, after which the module computes with the gathered values;
* freeing releases the storage (``untyped_storage().resize_(0)``) but keeps
  the tensor objects, as FSDP does: the views autograd saved in forward see
  the data again once backward re-gathers into the same storage (on the CPU
  the memory is lent by the host pool and handed back, ``lend_storage``);
* gradients leave through one reduce-scatter per part from the flat
  gradient buffer into the rank's gradient shard.

Frozen parameters (``freeze``, ``UnitInfo.frozen``) stay in the flat buffer (gathered like
the rest) but do not require grad, so autograd never computes their gradient, and have no
gradient view.

Shards are of the unit's shard group (``TaskGraph.shard_group``: every rank, or HSDP's node,
MiCS's group): ``rank`` is this rank's index in it and ``group`` its process group. hpZ's
secondary shard is the same parts cut over the node (:meth:`FlatParam.set_secondary`).

Tied parameters (a unit reading another unit's parameter) need nothing here:
the user's module reads the owner's parameter object, whose view points into
the owner's buffer; the state routes the user's gradient to the owner.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zdsl.model.layout import FlatLayout, to_flat, unit_layout
from zdsl.runtime.dist import collectives


def layout_of(numel: int, padded_numel: int, parts: int, ranks: int, info=None) -> FlatLayout:
    """The layout the compiler chose (``UnitInfo``: its fields, or ``info`` itself for a partly
    frozen unit's two regions), checked for consistency."""
    if info is not None and info.frozen_parts:
        lay = unit_layout(info, ranks)
        sizes: tuple[int, ...] = (lay.part_numel, lay.frozen_part_numel)
    else:
        lay = FlatLayout(numel, ranks, parts, padded_numel // parts)
        sizes = (lay.part_numel,)
    if lay.padded_numel != padded_numel or padded_numel < numel or any(n % ranks for n in sizes):
        raise ValueError(f"inconsistent layout: numel {numel}, padded {padded_numel}, "
                         f"parts {parts}, ranks {ranks}")
    return lay


def is_freed(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory, keeping the tensor object (and every view of it)."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` (and its views) memory again; contents are undefined."""
    need = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != need:
        t.untyped_storage().resize_(need)


def can_lend() -> bool:
    """This torch can move memory between two storages (``lend_storage``)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def lend_storage(t: torch.Tensor, block: torch.Tensor) -> None:
    """Give freed ``t`` (and its views) ``block``'s memory, at least ``t``'s bytes and left
    empty meanwhile; contents are undefined. The storage object stays ``t``'s, so autograd's
    saved views see this memory as they see :func:`alloc_storage`'s."""
    mine, lent = t.untyped_storage(), block.untyped_storage()
    if mine.nbytes() != 0 or lent.nbytes() < t.numel() * t.element_size():
        raise ValueError(f"lend_storage: {mine.nbytes()} bytes held, block of {lent.nbytes()} "
                         f"for {t.numel() * t.element_size()}")
    mine._swap_data_ptr_(lent)  # type: ignore[attr-defined]  # torch's stubs omit it; can_lend() checks it


def reclaim_storage(t: torch.Tensor, block: torch.Tensor) -> None:
    """Hand the memory :func:`lend_storage` gave ``t`` back to ``block``, leaving ``t`` freed."""
    if block.untyped_storage().nbytes() != 0:
        raise ValueError("reclaim_storage: the block was not lent")
    t.untyped_storage()._swap_data_ptr_(block.untyped_storage())  # type: ignore[attr-defined]  # as above


class FlatParam:
    """One unit's flat parameter buffer and flat gradient buffer, with views.

    ``full`` (``padded_numel`` elements in the compute dtype) and ``grad``
    (same size, gradient dtype) start freed; :meth:`alloc` gives them memory.
    """

    def __init__(self, module: nn.Module, layout: FlatLayout, rank: int, dtype: torch.dtype,
                 grad_dtype: torch.dtype, device: torch.device, frozen: list[int] | None = None, group=None):
        self.names = [n for n, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        numel = sum(p.numel() for p in self.params)
        if numel != layout.numel:
            raise ValueError(f"the module has {numel} parameters, the compiled graph expects {layout.numel}")
        self.layout, self.rank, self.dtype = layout, rank, dtype     # rank: this rank's shard, in its group
        self.group = group                  # the shard group's process group (None: every rank)
        self.secondary: FlatLayout | None = None                    # hpZ: the layout over the node
        self.secondary_rank = 0
        self.offsets, logical = [], 0
        for p in self.params:
            self.offsets.append(to_flat(layout, logical, p.numel()))
            logical += p.numel()
        # The initial values in fp32 (the master copy's start), before any rebinding; None once
        # the rank state has filled its unit's persistent buffers from them.
        self.initial: torch.Tensor | None = torch.zeros(layout.padded_numel, dtype=torch.float32)
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                self.initial[o:o + p.numel()].copy_(p.detach().reshape(-1).float().cpu())
        self.full = torch.empty(layout.padded_numel, dtype=dtype, device=device)
        self.grad = torch.empty(layout.trainable_numel, dtype=grad_dtype, device=device)
        self.frozen = set(frozen or ())
        with torch.no_grad():
            for i, (p, o) in enumerate(zip(self.params, self.offsets)):
                p.data = self.full[o:o + p.numel()].view(p.shape)
                p.requires_grad_(i not in self.frozen)
        self.grad_views = [None if i in self.frozen else self.grad[o:o + p.numel()].view(p.shape)
                           for i, (p, o) in enumerate(zip(self.params, self.offsets))]
        free_storage(self.full)
        free_storage(self.grad)

    def grad_view(self, i: int) -> torch.Tensor:
        """Trainable parameter ``i``'s gradient: a view into the flat gradient buffer."""
        view = self.grad_views[i]
        if view is None:
            raise ValueError(f"parameter {i} is frozen, so it has no gradient")
        return view

    @property
    def trainable(self) -> list[int]:
        """Indices of the parameters that train (registration order)."""
        return [i for i in range(len(self.params)) if i not in self.frozen]

    def frozen_ranges(self) -> list[tuple[int, int]]:
        """Elements of the full buffer held by frozen parameters."""
        return [(self.offsets[i], self.offsets[i] + self.params[i].numel()) for i in sorted(self.frozen)]

    # -- views and shards ----------------------------------------------------------
    def view(self, param: torch.Tensor) -> tuple[int, int]:
        """(offset, numel) of one of this unit's parameters in the flat buffer."""
        for p, o in zip(self.params, self.offsets):
            if p is param:
                return o, p.numel()
        raise KeyError("not a parameter of this unit")

    def owned(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's slices (one per part) of a full-size flat buffer."""
        return [flat[a:b] for a, b in self.layout.owned_full_ranges(self.rank)]

    def shard_parts(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """A shard-size buffer cut into its per-part slices."""
        return [shard[slice(*self.layout.shard_range(p))] for p in range(self.layout.parts)]

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full-size flat buffer, as a new contiguous tensor."""
        return torch.cat(self.owned(flat))

    def set_secondary(self, ranks: int, rank: int) -> None:
        """hpZ: the secondary shard is the same parts cut over ``ranks`` (the node); ``rank`` is this
        rank's index there."""
        self.secondary = FlatLayout(self.layout.numel, ranks, self.layout.parts, self.layout.part_numel,
                                    self.layout.frozen_parts, self.layout.frozen_part_numel, self.layout.runs)
        self.secondary_rank = rank

    def secondary_layout(self) -> FlatLayout:
        """hpZ: the secondary shard's layout over the node."""
        # RankState sets it on every unit of a graph with a secondary group, the only graphs
        # whose buffers and ops name a secondary shard
        assert self.secondary is not None, "a secondary shard asked of a unit without set_secondary"
        return self.secondary

    def keep_secondary(self, part: int, full: torch.Tensor, secondary: torch.Tensor) -> None:
        """Copy this rank's node-local slice of one gathered part of ``full`` into ``secondary``."""
        lay = self.secondary_layout()
        a, b = lay.full_range(part)
        n = (b - a) // lay.ranks
        c, _ = lay.shard_range(part)
        secondary[c:c + n].copy_(full[a + self.secondary_rank * n:a + (self.secondary_rank + 1) * n])

    # -- collectives ---------------------------------------------------------------
    # ``group`` None is the unit's shard group (``self.group``): what every gather and reduce-scatter
    # of its primary shard runs over.
    def gather(self, part: int, out: torch.Tensor, shard: torch.Tensor, group, async_op: bool):
        """All-gather one part of ``shard`` (every rank's of the group) into ``out`` (full size)."""
        a, b = self.layout.full_range(part)
        c, d = self.layout.shard_range(part)
        return collectives.all_gather(out[a:b], shard[c:d], group=group or self.group, async_op=async_op)

    def gather_secondary(self, part: int, out: torch.Tensor, secondary: torch.Tensor, group, async_op: bool):
        """hpZ: all-gather one part of the node's secondary shards into ``out`` (full size)."""
        lay = self.secondary_layout()
        a, b = lay.full_range(part)
        c, d = lay.shard_range(part)
        return collectives.all_gather(out[a:b], secondary[c:d], group=group, async_op=async_op)

    def reduce_scatter(self, part: int, out_shard: torch.Tensor, grad: torch.Tensor, group, async_op: bool):
        """Reduce-scatter one part of the full gradient ``grad`` into ``out_shard``'s part."""
        a, b = self.layout.full_range(part)
        c, d = self.layout.shard_range(part)
        return collectives.reduce_scatter(out_shard[c:d], grad[a:b], group=group or self.group, async_op=async_op)
