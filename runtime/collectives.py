"""Collectives on flat buffers, across torch versions and backends.

torch 2.13 names the flat collectives ``all_gather_single`` and
``reduce_scatter_single``; 2.11 has ``all_gather_into_tensor`` and
``reduce_scatter_tensor``. We use the new names where they exist and the old
ones otherwise, so callers never see a deprecation warning or a missing name.

Backends: NCCL and recent gloo implement all of these (gloo also for bf16).
Where a backend refuses a flat reduce-scatter, the fallback is explicit: an
all-reduce of the whole input followed by a copy of this rank's slice. It
moves twice the data, is logged once, and counted in ``FALLBACKS`` so the
measured communication volume can be held against the plan.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Collectives the backend lacked, served by a fallback: name -> times used.
FALLBACKS: dict[str, int] = {}
_no_native_reduce_scatter: set[str] = set()
_lock = threading.Lock()


class Done:
    """A completed collective (fallbacks run synchronously): the Work interface."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


def _count(name: str) -> None:
    with _lock:
        FALLBACKS[name] = FALLBACKS.get(name, 0) + 1


def _backend(group) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # not initialised: let the collective itself raise the clear error
        return "?"


def all_gather(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``inp`` into ``out`` (rank-major, one flat tensor)."""
    return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``inp`` over ranks and leave this rank's slice in ``out``."""
    backend = _backend(group)
    if backend not in _no_native_reduce_scatter:
        try:
            return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError) as exc:
            if "support" not in str(exc).lower() and "implement" not in str(exc).lower():
                raise
            _no_native_reduce_scatter.add(backend)
    # Explicit fallback: all-reduce everything, keep our slice (2x the traffic).
    _count("reduce_scatter->all_reduce")
    whole = inp.clone()
    dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=group)
    rank, n = dist.get_rank(group), out.numel()
    out.copy_(whole[rank * n:(rank + 1) * n])
    return Done() if async_op else None


def all_reduce(tensor: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``tensor`` over ranks in place."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
