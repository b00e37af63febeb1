"""Counting the kernels a unit's forward and backward launch, for the planner's per-kernel cost.

Eager PyTorch pays a roughly fixed cost for every aten op it dispatches
(argument parsing, autograd recording, allocation, a kernel launch): on a
2-core CPU VM about 10 us, against a GPT block's 0.1 ms of arithmetic at
width 64. A unit's time is therefore ``flops / rate + kernels x cost``, and
two models of equal flops can differ by half their step when one launches
twice the kernels (a GPT block: 32 forward, 68 backward; an MLP block: 11
and 29). The planner charges ``machine.kernel_overhead`` per kernel of a
compute op; ``zdsl calibrate`` measures it; this module counts the kernels.

A kernel is one op seen by a ``TorchDispatchMode``: below autograd, after
composite ops have decomposed, as the runtime's thread dispatches them.
The backward is counted as the runtime runs it (``runtime/state/compute.py``):
``unit_grads`` (``torch.autograd.grad``) of the unit's output with respect to its input (when
floating point) and its parameters, own and tied, then one ``add_`` per
parameter gradient into the unit's flat gradient buffer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.protocol import call_unit, prepare_batch, tied_indices, unit_grads


class KernelCount(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active (``n``)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class FusedAttentionOnMeta(TorchFunctionMode):
    """On the meta device ``scaled_dot_product_attention`` takes its math decomposition (a GPT
    block: 54 kernels forward, 87 backward, against 32 and 68 on CPU), where a real device runs
    one fused kernel each way: route it to the CPU's fused kernel, which the meta device also
    implements, so that a user's model sized on meta counts what a run dispatches. A boolean
    mask becomes an additive one first, by the CPU's own three kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            q, k, v = args[:3]
            rest = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]), **kwargs)
            if not rest.get("enable_gqa") and q.shape[-3] == k.shape[-3]:
                mask = rest.get("attn_mask")
                if mask is not None and mask.dtype == torch.bool:
                    mask = torch.where(mask, torch.scalar_tensor(0.0, dtype=q.dtype, device=q.device),
                                       torch.scalar_tensor(float("-inf"), dtype=q.dtype, device=q.device))
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, rest.get("dropout_p", 0.0), rest.get("is_causal", False), attn_mask=mask,
                    scale=rest.get("scale"))[0]
        return func(*args, **kwargs)


def unit_kernels(unit, x: torch.Tensor, batch: Batch, last: bool, tied: list) -> tuple[int, int, torch.Tensor]:
    """(forward kernels, backward kernels, output) of one ``unit`` on input ``x`` of ``batch``
    (called as zdsl calls it; ``last``: it returns the loss); ``tied``: the parameters of other
    units it reads. Works on the meta device (nothing computed) as on a real one."""
    x_in = x.detach().requires_grad_(x.is_floating_point() and x is not batch.input_ids)   # data: no gradient
    with KernelCount() as forward:
        out = call_unit(unit, x_in, batch, last)
    params = [p for p in unit.parameters() if p.requires_grad] + list(tied)
    inputs = ([x_in] if x_in.requires_grad else []) + params
    grad_out = torch.ones_like(out) if out.dim() else None
    with KernelCount() as backward:
        if inputs and out.requires_grad:
            unit_grads(out, inputs, grad_out)
    return forward.n, backward.n + len(params), out.detach()


def model_kernels(model, units: list, x: torch.Tensor, targets: torch.Tensor) -> list[tuple[int, int]]:
    """Each unit's (forward, backward) kernels for one pass of token ids ``x`` with labels
    ``targets`` through ``units`` (the model's ``prepare`` runs first, not counted: it is no
    unit's)."""
    batch = prepare_batch(model, Batch.of(x, targets))
    tied = tied_indices(model, units)
    owned = [list(u.parameters()) for u in units]
    counts = []
    with FusedAttentionOnMeta():
        for i, unit in enumerate(units):
            fwd, bwd, x = unit_kernels(unit, x, batch, i == len(units) - 1,
                                       [owned[o][j] for o, j in tied.get(i, [])])
            counts.append((fwd, bwd))
    return counts
