"""The clip coefficient on both sides of 1, against torch's clip_grad_norm_ (the DDP reference's).

``max_norm / (total + 1e-6)`` clamped at 1: below the norm it scales the gradients down, at or
above it leaves them exactly as they are (multiplied by 1.0). Run parity of both sides is in
tests/parity/test_state_vs_ddp.py (clip 0.5 and clip 1e6) and tests/parity/test_fp16.py.
"""
from __future__ import annotations

import pytest
import torch

from zdsl.runtime.state.optim import clip_coefficient

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'


def grads(seed: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=g) * scale, torch.randn(11, generator=g) * scale]


def clipped_by_torch(gs: list[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
    for p, g in zip(params, gs):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return total, [p.grad for p in params]


@pytest.mark.parametrize("max_norm, binds", [(0.5, True), (1e6, False), (3.0, True), (30.0, False)])
def test_coefficient_gives_clip_grad_norm_s_gradients(max_norm, binds):
    gs = grads(0, 1.0)                                   # a total norm of about 8
    total, expected = clipped_by_torch(gs, max_norm)
    coef = clip_coefficient(total, max_norm)
    assert (float(coef) < 1.0) is binds
    got = [g * coef for g in gs]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_below_the_norm_the_coefficient_brings_it_to_max_norm():
    total = torch.tensor(10.0)
    coef = clip_coefficient(total, 2.0)
    assert float(coef) == pytest.approx(0.2, rel=1e-6)
    assert float(total * coef) == pytest.approx(2.0, rel=1e-6)


def test_above_the_norm_the_coefficient_is_exactly_one():
    for total in (torch.tensor(0.0), torch.tensor(1e-3), torch.tensor(1.9999)):
        assert float(clip_coefficient(total, 2.0)) == 1.0
    gs = grads(1, 1e-3)
    assert all(torch.equal(g * clip_coefficient(torch.tensor(0.01), 1.0), g) for g in gs)


def test_at_the_norm_the_epsilon_makes_it_bind_slightly():
    """As torch: max_norm / (max_norm + 1e-6), just under 1."""
    assert 1.0 - 1e-5 < float(clip_coefficient(torch.tensor(1.0), 1.0)) < 1.0
