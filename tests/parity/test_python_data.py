"""data python(...) at 2 ranks against torch DDP on the same function: programs/classifier.py's MLP on float
features and class labels, trained by zdsl at ZeRO-3 (and at stage 1 with accumulation and unit 0
recomputed), equals DDP fed by the same ``batches(seed, step, micro, rank, world, batch)`` to the bit."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ddp_reference import ddp_train, run_steps, spawn

from zdsl.schedule import DataSpec
from zdsl.schedule import ModelSpec
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

CLASSIFIER = Path(__file__).parents[2] / "programs" / "classifier.py"
MODEL = ModelSpec("user", dict(features=8, hidden=16, classes=3, layers=2), factory=f"{CLASSIFIER}:build")
DATA = DataSpec("python", f"{CLASSIFIER}:batches", {"features": 8, "classes": 3})

# name: (stage, accumulate, recompute)
CASES = {"stage3": (3, 1, ()), "stage1_accumulate_recompute_unit0": (1, 2, (0, 1))}


def make_schedule(world: int, stage: int, accumulate: int, recompute) -> Schedule:
    return Schedule(name="python_data", model=MODEL, data=DATA,
                    train=TrainSpec(steps=4, batch=4, accumulate=accumulate, precision="fp32", seed=3),
                    optimizer=OptimizerSpec(kind="adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
                    ranks=world, stage=stage, recompute=set(recompute))


def run_case(rank: int, world: int, stage: int, accumulate: int, recompute) -> dict:
    from zdsl.driver import compile_schedule
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.sizing import units_for_user_model
    from zdsl.runtime.state.rank import RankState

    sched = make_schedule(world, stage, accumulate, recompute)
    t = sched.train
    graph = compile_schedule(sched, units_for_user_model(MODEL, data=DATA))
    state = RankState(graph, build_model(MODEL, seed=t.seed), rank, world, device="cpu")
    steps = run_steps(graph, state, sched, rank, world)          # make_batch: the function's pairs
    ref, ref_losses = ddp_train({}, DATA, seed=t.seed, steps=t.steps, batch=t.batch, accumulate=t.accumulate,
                                optimizer=sched.to_config()["optimizer"], rank=rank, world=world,
                                build=lambda: build_model(MODEL, seed=t.seed))
    return dict(zdsl=state.export_state(), losses=[s["loss"] for s in steps], ref=ref, ref_losses=ref_losses,
                init={n: p.detach() for n, p in build_model(MODEL, seed=t.seed).named_parameters()})


def run_cases(rank: int, world: int) -> dict:
    return {name: run_case(rank, world, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return spawn(run_cases, 2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_zdsl_on_python_data_equals_ddp_on_the_same_function_to_the_bit(results, name):
    for rank, by_case in enumerate(results):
        r = by_case[name]
        assert set(r["ref"]) == set(r["zdsl"])
        bad = [k for k in r["ref"] if not torch.equal(r["zdsl"][k], r["ref"][k])]
        assert not bad, f"rank {rank} {name}: differs from DDP in {bad[:4]}"
        assert r["losses"] == r["ref_losses"]
        assert all(math.isfinite(x) for x in r["losses"])
        moved = [k for k in r["init"] if not torch.equal(r["init"][k], r["zdsl"][k])]
        assert moved == list(r["init"]), f"rank {rank} {name}: {set(r['init']) - set(moved)} did not train"


def test_the_ranks_saw_different_batches_and_the_same_model(results):
    """Each rank's loss is its own micro-batch's (the function keys rows by rank), the parameters agree."""
    first, second = results
    for name in CASES:
        assert first[name]["losses"] != second[name]["losses"]
        assert all(torch.equal(first[name]["zdsl"][k], second[name]["zdsl"][k]) for k in first[name]["zdsl"])
