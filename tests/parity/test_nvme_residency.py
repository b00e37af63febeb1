"""Host residency of NVMe state at run time: a budgeted program trains to the same bits.

With ``memory host`` the compiler holds some NVMe state on the host through the whole step and
keeps some host copies of the parameter shards between their forward and backward use, dropping
those reads and writes (zdsl/compile/residency.py). The values must be those of the unbudgeted
run, and of DDP: 2 gloo ranks, ZeRO-3 with parameters and optimizer state on NVMe, the trio
executor (lanes concurrent) and the sequential driver (which also checks that no kept copy
outlives the step); budgets that hold everything, some state, or only re-reads within the step;
gradient accumulation; and checkpoints taken from a budgeted run, resumed by the same graph and
by the unbudgeted one.
"""
from __future__ import annotations

import pytest
import torch

from ddp_reference import ddp_train, spawn
from test_state_vs_ddp import BATCH, MODEL, STEPS, make_schedule, zdsl_train

from zdsl.model.units import gpt_units
from zdsl.driver import compile_schedule
from zdsl.sim.simulate import simulate

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

NVME = {"parameters": "nvme", "optimizer": "nvme"}
PARAMS_NVME = {"parameters": "nvme", "optimizer": "cpu"}


def budget_for(offload: dict, accumulate: int, room: str) -> int | None:
    """``all``: room for every state; ``peak``: the unbudgeted host peak (no room at every moment,
    so nothing is held through the step, only re-reads kept between the peaks); ``third``: the
    peak and a third of the parameter shards (some held, some re-reads kept)."""
    if room is None:
        return None
    if room == "all":
        return 1 << 40
    s = make_schedule(2, 3, accumulate=accumulate, offload=offload)
    graph = compile_schedule(s, gpt_units(**MODEL))
    peak = simulate(graph, s.machine).memory.peak("host")
    params = sum(b.bytes for b in graph.buffers.values() if b.kind == "param_shard" and b.tier == "nvme")
    return peak if room == "peak" else peak + params // 3


# name: (offload, room, accumulate, driver, resume_at)
CASES = {
    "unbudgeted": (NVME, None, 1, "trio", None),
    "all_held": (NVME, "all", 1, "trio", None),
    "some_held": (NVME, "third", 1, "trio", None),
    "rereads_only": (NVME, "peak", 1, "trio", None),
    "rereads_only_sequential": (NVME, "peak", 1, "sequential", None),
    "optimizer_on_host": (PARAMS_NVME, "peak", 1, "trio", None),
    "some_held_resumed": (NVME, "third", 1, "trio", 2),
    "unbudgeted_accumulate": (NVME, None, 2, "trio", None),
    "some_held_accumulate": (NVME, "third", 2, "trio", None),
}


def budgeted(name: str):
    offload, room, accumulate, _, _ = CASES[name]
    s = make_schedule(2, 3, accumulate=accumulate, offload=offload)
    budget = budget_for(offload, accumulate, room)
    if budget is not None:
        s.memory = {"host": budget}
    return s


def resumed_by_the_unbudgeted_graph(rank: int, world: int, at: int) -> tuple[dict, list]:
    """Train the ``some_held`` schedule to step ``at``, then resume its checkpoint shards in a state
    built from the unbudgeted graph (another seed) and train the rest there."""
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.models.batch import Batch
    from zdsl.runtime.models.gpt import GPT
    from zdsl.runtime.state.rank import RankState

    budgeted_graph = compile_schedule(budgeted("some_held"), gpt_units(**MODEL))
    plain = budgeted("unbudgeted")
    plain_graph = compile_schedule(plain, gpt_units(**MODEL))
    graph, state = budgeted_graph, RankState(budgeted_graph, GPT(**MODEL, seed=0), rank, world, device="cpu")
    t, losses = plain.train, []
    for step in range(t.steps):
        if step == at:
            shards, taken = state.shard_state(), state.optimizer_steps()
            graph, state = plain_graph, RankState(plain_graph, GPT(**MODEL, seed=99), rank, world, device="cpu")
            state.load_shard_state(shards, taken)
        state.step_begin(step, [Batch.of(*make_batch(plain.data, t.seed, step, 0, rank, world, t.batch))])
        for op in graph.ops:
            state.run_op(op)
        losses.append(state.step_end()["loss"])
    return state.export_state(), losses


def _run(rank: int, world: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        *_, driver, resume_at = CASES[name]
        torch.manual_seed(1234)
        mine, steps, _, _ = zdsl_train(budgeted(name), rank, world, driver=driver, resume_at=resume_at)
        out[name] = (mine, [row["loss"] for row in steps])
    out["resumed_by_the_unbudgeted_graph"] = resumed_by_the_unbudgeted_graph(rank, world, 2)
    ref_schedule = make_schedule(world, 3)
    out["ddp"] = ddp_train(MODEL, ref_schedule.data, seed=0, steps=STEPS, batch=BATCH, accumulate=1,
                           optimizer=ref_schedule.to_config()["optimizer"], rank=rank, world=world)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_run, 2, sorted(CASES))


def test_the_budgets_do_what_they_say():
    report = {name: compile_schedule(budgeted(name), gpt_units(**MODEL)).config.get("residency") for name in CASES}
    assert report["unbudgeted"] is None
    everything = compile_schedule(budgeted("all_held"), gpt_units(**MODEL))
    assert not [op for op in everything.ops if op.kind.startswith("nvme.")]
    for name in ("some_held", "some_held_accumulate"):
        assert report[name]["held"] and report[name]["kept"] > 0
    for name in ("rereads_only", "optimizer_on_host"):
        assert not report[name]["held"] and report[name]["kept"] > 0


@pytest.mark.parametrize("name", sorted(n for n in CASES if "accumulate" not in n) + ["resumed_by_the_unbudgeted_graph"])
def test_budgeted_runs_equal_ddp_to_the_bit(results, name):
    for rank, by_case in enumerate(results):
        mine, losses = by_case[name]
        ref, ref_losses = by_case["ddp"]
        bad = [k for k in ref if not torch.equal(mine[k], ref[k])]
        assert not bad, f"rank {rank} {name}: differs from DDP in {bad[:4]}"
        assert losses == ref_losses


def test_budgeted_accumulation_equals_the_unbudgeted_run_to_the_bit(results):
    for by_case in results:
        mine, losses = by_case["some_held_accumulate"]
        base, base_losses = by_case["unbudgeted_accumulate"]
        assert mine.keys() == base.keys()
        assert all(torch.equal(mine[k], base[k]) for k in base)
        assert losses == base_losses
