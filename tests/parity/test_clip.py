"""The clip coefficient on both sides of 1, against torch's clip_grad_norm_ (the DDP reference's).

``max_norm / (total + 1e-6)`` clamped at 1: below the norm it scales the gradients down, at or
above it leaves them exactly as they are (multiplied by 1.0). Run parity of both sides is in
tests/parity/test_state_vs_ddp.py (clip 0.5 and clip 1e6) and tests/parity/test_fp16.py.

At stages 1-3 each rank holds a shard of the gradients and its norm is a part of the total: the
parts are summed by an all-reduce before the coefficient. Two ranks train with SGD (whose update
scales with the coefficient) against DDP and ``clip_grad_norm_``; each rank's own part is read
before the all-reduce, to show that clipping by it would give another coefficient.
"""
from __future__ import annotations

import math

import pytest
import torch

from ddp_reference import ddp_train, spawn
from test_state_vs_ddp import BATCH, MODEL, make_schedule

from zdsl.model.units import gpt_units
from zdsl.driver import compile_schedule
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


# -- over shards: the global norm on 2 ranks, against DDP -------------------------------------

CLIP, SHARD_STEPS = 0.1, 3
STAGES = (1, 2, 3)


def sharded_clip_run(rank: int, world: int, stage: int) -> dict:
    """zdsl (ops in graph order) and DDP with clip_grad_norm_, SGD; each step's reported norm, DDP's,
    and this rank's own squared part of the norm as the norm op wrote it, before the all-reduce."""
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.models.batch import Batch
    from zdsl.runtime.models.gpt import GPT
    from zdsl.runtime.state.rank import RankState

    schedule = make_schedule(world, stage, clip=CLIP, kind="sgd")
    schedule.train.steps = SHARD_STEPS
    graph = compile_schedule(schedule, gpt_units(**MODEL))
    state = RankState(graph, GPT(**MODEL, seed=0), rank, world, device="cpu")
    own, norms = [], []
    for step in range(SHARD_STEPS):
        state.step_begin(step, [Batch.of(*make_batch(schedule.data, 0, step, 0, rank, world, BATCH))])
        for op in graph.ops:
            state.run_op(op)
            if op.kind == "compute.norm" and op.unit is None:        # the parts summed, not yet reduced
                own.append(float(state.tensor("norm")))
        norms.append(state.step_end()["grad_norm"])
    ref_norms: list[float] = []
    ref, _ = ddp_train(MODEL, schedule.data, seed=0, steps=SHARD_STEPS, batch=BATCH, accumulate=1,
                       optimizer=schedule.to_config()["optimizer"], rank=rank, world=world, norms=ref_norms)
    return dict(zdsl=state.export_state(), ref=ref, norms=norms, ref_norms=ref_norms, own=own)


def sharded_clip_runs(rank: int, world: int) -> dict:
    return {stage: sharded_clip_run(rank, world, stage) for stage in STAGES}


@pytest.fixture(scope="module")
def sharded():
    return spawn(sharded_clip_runs, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_each_ranks_own_norm_would_clip_differently(sharded, stage):
    """The runs below can tell the global norm from a rank's own: the clip binds, and each rank's
    part alone gives a coefficient far from the global one."""
    for by_stage in sharded:
        r = by_stage[stage]
        assert len(r["own"]) == SHARD_STEPS
        for own_sq, total in zip(r["own"], r["ref_norms"]):
            assert total > 2 * CLIP
            mine, right = float(clip_coefficient(torch.tensor(math.sqrt(own_sq)), CLIP)), CLIP / (total + 1e-6)
            assert abs(mine / right - 1) > 0.05


@pytest.mark.parametrize("stage", STAGES)
def test_sharded_clip_uses_the_global_norm_as_ddp_does(sharded, stage):
    for rank, by_stage in enumerate(sharded):
        r = by_stage[stage]
        worst = max(float((r["zdsl"][k] - r["ref"][k]).abs().max() / r["ref"][k].abs().max()) for k in r["ref"])
        assert worst < 1e-6, f"rank {rank}: parameters differ from DDP's by {worst:.3g} (relative)"
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-6), f"rank {rank}: the reported norm"
