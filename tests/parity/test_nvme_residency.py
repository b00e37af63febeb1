"""Host residency of NVMe state at run time: a budgeted program trains to the same bits.

With ``memory host`` the compiler keeps some host copies of the parameter shards between their
forward and backward use and drops the re-reads (zdsl/compile/residency.py). The values must be
those of the unbudgeted run, and of DDP: 2 gloo ranks, ZeRO-3 with parameters and optimizer
state on NVMe, the trio executor (lanes concurrent) and the sequential driver (which also checks
that no kept copy outlives the step), a budget that keeps every shard, one that keeps some,
gradient accumulation, and a checkpoint round trip in the middle of a budgeted run.
"""
from __future__ import annotations

import pytest
import torch

from ddp_reference import ddp_train, spawn
from test_state_vs_ddp import BATCH, MODEL, STEPS, make_schedule, zdsl_train

from zdsl.compile.units import gpt_units
from zdsl.driver import compile_schedule
from zdsl.planner.simulate import simulate

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

NVME = {"parameters": "nvme", "optimizer": "nvme"}
PARAMS_NVME = {"parameters": "nvme", "optimizer": "cpu"}
ALL = 1 << 40


def host_peak(offload: dict) -> int:
    """The unbudgeted host peak: with the optimizer on the host, a budget of exactly that leaves
    room for some of the parameter shards around the turn-around, not all."""
    s = make_schedule(2, 3, offload=offload)
    return simulate(compile_schedule(s, gpt_units(**MODEL)), s.machine).memory.peak("host")


# name: (offload, host budget or None, accumulate, driver, resume_at)
CASES = {
    "unbudgeted": (NVME, None, 1, "trio", None),
    "every_shard": (NVME, ALL, 1, "trio", None),
    "some_shards": (PARAMS_NVME, "peak", 1, "trio", None),
    "every_shard_sequential": (NVME, ALL, 1, "sequential", None),
    "unbudgeted_accumulate": (NVME, None, 2, "trio", None),
    "every_shard_accumulate": (NVME, ALL, 2, "trio", None),
    "every_shard_resumed": (NVME, ALL, 1, "trio", 2),
}


def budgeted(name: str):
    offload, budget, accumulate, _, _ = CASES[name]
    s = make_schedule(2, 3, accumulate=accumulate, offload=offload)
    if budget is not None:
        s.memory = {"host": host_peak(offload) if budget == "peak" else budget}
    return s


def _run(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        *_, driver, resume_at = CASES[name]
        torch.manual_seed(1234)
        s = budgeted(name)
        mine, steps, _, _ = zdsl_train(s, rank, world, driver=driver, resume_at=resume_at)
        out[name] = (mine, [row["loss"] for row in steps])
    ref_schedule = make_schedule(world, 3)
    out["ddp"] = ddp_train(MODEL, ref_schedule.data, seed=0, steps=STEPS, batch=BATCH, accumulate=1,
                           optimizer=ref_schedule.to_config()["optimizer"], rank=rank, world=world)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_run, 2, sorted(CASES))


def test_the_budgets_keep_what_they_say():
    kept = {}
    for name in CASES:
        graph = compile_schedule(budgeted(name), gpt_units(**MODEL))
        kept[name] = graph.config.get("residency", {}).get("kept", 0), graph.config.get("residency", {}).get("candidates")
    assert kept["unbudgeted"] == (0, None)
    assert kept["every_shard"][0] == kept["every_shard"][1] > 0
    assert 0 < kept["some_shards"][0] < kept["some_shards"][1]


@pytest.mark.parametrize("name", sorted(n for n in CASES if "accumulate" not in n))
def test_budgeted_runs_equal_ddp_to_the_bit(results, name):
    for rank, by_case in enumerate(results):
        mine, losses = by_case[name]
        ref, ref_losses = by_case["ddp"]
        bad = [k for k in ref if not torch.equal(mine[k], ref[k])]
        assert not bad, f"rank {rank} {name}: differs from DDP in {bad[:4]}"
        assert losses == ref_losses


def test_budgeted_accumulation_equals_the_unbudgeted_run_to_the_bit(results):
    for by_case in results:
        mine, losses = by_case["every_shard_accumulate"]
        base, base_losses = by_case["unbudgeted_accumulate"]
        assert mine.keys() == base.keys()
        assert all(torch.equal(mine[k], base[k]) for k in base)
        assert losses == base_losses
