"""Recompute with dropout: the recomputed forward draws the forward's random numbers again.

A user's model with dropout 0.1 (HF GPT-2's default; tests/user_models.py) trains at 2 ranks
with the real executor (compute ops in a lane's worker thread), once without recompute and once
recomputing every block. A recompute that drew fresh dropout masks would give gradients of
other masks than the loss it reported (same first loss, another gradient norm); both runs must
end at the same bits, and at DDP's (one forward, each mask drawn once).
"""
from __future__ import annotations

import pytest
import torch

from ddp_reference import ddp_train, run_steps, spawn
from user_models import FACTORY

from zdsl.schedule import DataSpec

from zdsl.schedule import ModelSpec

from zdsl.schedule import OptimizerSpec

from zdsl.schedule import Schedule

from zdsl.schedule import TrainSpec

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

MODEL = dict(vocab=64, context=16, hidden=32, layers=2, dropout=0.1)
BLOCKS = (1, 2)


def make_schedule(world: int, stage: int, accumulate: int, clip, recompute) -> Schedule:
    return Schedule(name="dropout", model=ModelSpec("user", dict(MODEL), factory=FACTORY),
                    data=DataSpec("synthetic", None, {"vocab": MODEL["vocab"], "context": MODEL["context"]}),
                    train=TrainSpec(steps=4, batch=4, accumulate=accumulate, precision="fp32", seed=0),
                    optimizer=OptimizerSpec(kind="adamw", lr=1e-2, weight_decay=0.1, clip=clip),
                    ranks=world, stage=stage, recompute=set(recompute))


def train(schedule: Schedule, rank: int, world: int):
    """As `zdsl run` trains: the model built from the seed, the trio executor, step after step."""
    from zdsl.driver import compile_schedule
    from zdsl.compile.models import units_for
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState

    graph = compile_schedule(schedule, units_for(schedule.model))
    assert [u.recompute for u in graph.units][1:3] == [bool(schedule.recompute)] * 2
    state = RankState(graph, build_model(schedule.model, seed=schedule.train.seed), rank, world, device="cpu")
    steps = run_steps(graph, state, schedule, rank, world)
    return state.export_state(), [s["loss"] for s in steps], [s["grad_norm"] for s in steps]


def run_case(rank: int, world: int, stage: int, accumulate: int, clip) -> dict:
    from zdsl.runtime.models.protocol import build_model

    plain = train(make_schedule(world, stage, accumulate, clip, ()), rank, world)
    recomputed = train(make_schedule(world, stage, accumulate, clip, BLOCKS), rank, world)
    sched = make_schedule(world, stage, accumulate, clip, ())
    t = sched.train
    norms: list[float] = []
    ref, ref_losses = ddp_train({}, sched.data, seed=t.seed, steps=t.steps, batch=t.batch, accumulate=t.accumulate,
                                optimizer=sched.to_config()["optimizer"], rank=rank, world=world,
                                build=lambda: build_model(sched.model, seed=t.seed), norms=norms)
    return dict(plain=plain, recomputed=recomputed, ref=(ref, ref_losses, norms))


def run_cases(rank: int, world: int, cases: dict) -> dict:
    return {name: run_case(rank, world, *args) for name, args in cases.items()}


# name: (stage, accumulate, clip); a clip far above the norm reports the norm without changing a bit
CASES = {"stage0_norm": (0, 1, 1e6), "stage1_accumulate": (1, 2, None), "stage3": (3, 1, None)}


@pytest.fixture(scope="module")
def results():
    return spawn(run_cases, 2, CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_recompute_with_dropout_gives_the_same_bits(results, name):
    for rank, by_case in enumerate(results):
        (p, losses, norms), (q, r_losses, r_norms) = by_case[name]["plain"], by_case[name]["recomputed"]
        assert losses == r_losses
        assert norms == r_norms, f"rank {rank}: gradient norms {norms} without recompute, {r_norms} with"
        bad = [k for k in p if not torch.equal(p[k], q[k])]
        assert not bad, f"rank {rank}: recompute changed {bad[:3]}"


def test_the_model_draws_dropout_masks():
    """Otherwise the same bits above would prove nothing."""
    from user_models import build
    torch.manual_seed(0)
    model, idx = build(**MODEL), torch.randint(0, MODEL["vocab"], (2, MODEL["context"]))
    assert model(idx, idx) != model(idx, idx)
    model.eval()
    assert model(idx, idx) == model(idx, idx)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dropout_run_equals_ddp(results, name):
    for rank, by_case in enumerate(results):
        (mine, losses, norms), (ref, ref_losses, ref_norms) = by_case[name]["recomputed"], by_case[name]["ref"]
        bad = [k for k in ref if not torch.equal(mine[k], ref[k])]
        assert not bad, f"rank {rank}: {bad[:3]} differ from DDP"
        assert losses == ref_losses
        if ref_norms:
            assert norms == ref_norms
