"""``freeze``: zdsl against DDP whose model has the same parameters at ``requires_grad=False``.

Same GPT, data and AdamW (weight decay on, so a frozen parameter that reached the optimizer
would move), 2 gloo ranks, fp32: the final parameters and every step's loss are DDP's to the
bit at stages 0-3, and every frozen parameter is still bit for bit its initial value. The
cases freeze a whole unit (the embedding, whose ``wte`` the head reads tied), parts of units
(biases, norms), a unit in the middle and the head itself (whose backward still runs: the
tied ``wte`` it reads trains), with clipping, offload to host and NVMe, the trio executor and
a checkpoint round trip through shards, and weight-decay groups (which fail if the decay
ranges did not follow the layout).
"""
from __future__ import annotations

import os
import tempfile
from fnmatch import fnmatchcase

import pytest
import torch

from zdsl.model.units import gpt_units
from zdsl.driver import compile_schedule
from zdsl.schedule import DataSpec
from zdsl.schedule import ModelSpec
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Placement
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec

from ddp_reference import ddp_train, spawn

pytestmark = pytest.mark.slow     # spawns ranks

MODEL = dict(layers=2, width=32, heads=2, vocab=64, context=16)
STEPS, BATCH = 4, 4
# zdsl's unit names -> the built-in GPT's module names (the reference freezes by those)
PREFIX = {"embedding": "embedding", "block.0": "blocks.0", "block.1": "blocks.1", "head": "head"}


def make_schedule(world: int, stage: int, freeze: tuple[str, ...], clip=None, offload: dict | None = None,
                  accumulate: int = 1, bucket_bytes: int = 0, precision: str = "fp32",
                  no_decay: tuple[str, ...] = ()) -> Schedule:
    s = Schedule(name="freeze", model=ModelSpec("gpt", dict(MODEL)),
                 data=DataSpec("synthetic", None, {"vocab": MODEL["vocab"], "context": MODEL["context"]}),
                 train=TrainSpec(steps=STEPS, batch=BATCH, accumulate=accumulate, precision=precision, seed=0),
                 optimizer=OptimizerSpec(kind="adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, clip=clip,
                                         no_decay=no_decay),
                 ranks=world, stage=stage, freeze=freeze, bucket_bytes=bucket_bytes)
    for state, tier in (offload or {}).items():
        path = os.path.join(tempfile.gettempdir(), "zdsl-freeze-nvme") if tier == "nvme" else None
        s.placement[state] = Placement(tier=tier, paths=(path,) if path else (), block_bytes=1 << 16, queue_depth=4)
    return s


def frozen_names(freeze: tuple[str, ...]) -> set[str]:
    """The model's names of the parameters ``freeze`` matches (as zdsl/model/param_names.py matches)."""
    out = set()
    for spec in gpt_units(**MODEL):
        for name, _ in spec.params:
            if any(fnmatchcase(name, g) or fnmatchcase(f"{spec.name}.{name}", g) for g in freeze):
                out.add(f"{PREFIX[spec.name]}.{name}")
    return out


def zdsl_train(schedule: Schedule, rank: int, world: int, driver: str, resume_at: int | None):
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.models.batch import Batch
    from zdsl.runtime.models.gpt import GPT
    from zdsl.runtime.state.rank import RankState

    graph = compile_schedule(schedule, gpt_units(**MODEL))
    state = RankState(graph, GPT(**MODEL, seed=0), rank, world, device="cpu")
    t, losses = schedule.train, []
    for step in range(t.steps):
        if step == resume_at:   # shards into a fresh state built from another seed
            shards, taken = state.shard_state(), state.optimizer_steps()
            state = RankState(graph, GPT(**MODEL, seed=99), rank, world, device="cpu")
            state.load_shard_state(shards, taken)
        state.step_begin(step, [Batch.of(*make_batch(schedule.data, t.seed, step, m, rank, world, t.batch))
                                for m in range(t.accumulate)])
        if driver == "trio":
            import trio
            from zdsl.runtime.exec.executor import Executor
            trio.run(Executor(graph, state, rank).run_step)
        else:
            for op in graph.ops:
                state.run_op(op)
        losses.append(state.step_end()["loss"])
        assert not state.live_working(), state.live_working()
    requires = {n: p.requires_grad for n, p in zip((n for names in state.param_names for n in names),
                                                   (p for fp in state.flats for p in fp.params))}
    return state.export_state(), losses, requires


def _case(rank: int, world: int, case: dict) -> dict:
    from zdsl.runtime.models.gpt import GPT

    torch.manual_seed(1234)
    driver, resume_at = case.pop("driver", "sequential"), case.pop("resume_at", None)
    sched = make_schedule(world, **case)
    zdsl, losses, requires = zdsl_train(sched, rank, world, driver, resume_at)
    cfg = sched.to_config()
    if sched.optimizer.no_decay:
        ref, ref_losses = grouped_reference(sched, rank, world)
    else:
        ref, ref_losses = ddp_train(MODEL, sched.data, seed=0, steps=STEPS, batch=BATCH,
                                   accumulate=sched.train.accumulate, optimizer=cfg["optimizer"], rank=rank,
                                   world=world, frozen=frozen_names(sched.freeze))
    init = {n: p.detach() for n, p in GPT(**MODEL, seed=0).named_parameters()}
    return dict(zdsl=zdsl, losses=losses, ref=ref, ref_losses=ref_losses, init=init, requires=requires)


def grouped_reference(sched: Schedule, rank: int, world: int):
    """DDP with nanoGPT's two groups (``no_decay=(biases, norms)``: 1-D parameters do not decay)
    over the parameters that train, the frozen ones at ``requires_grad=False``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_reference import _micro_batches
    from zdsl.runtime.models.gpt import GPT
    model = GPT(**MODEL, seed=0)
    frozen = frozen_names(sched.freeze)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    ddp = DDP(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    o = sched.optimizer
    opt = torch.optim.AdamW([{"params": [p for p in trained if p.dim() >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=o.betas, eps=o.eps)
    losses = []
    for step in range(STEPS):
        losses.append(float(_micro_batches(ddp, sched.data, 0, step, rank, world, BATCH, 1)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _run_all(rank: int, world: int, cases: dict) -> dict:
    return {name: _case(rank, world, dict(case)) for name, case in cases.items()}


WHOLE_AND_PART = ("embedding.*", "*.bias", "*.ln_1.weight")   # biases start at zero: the norms move
CASES = {
    "stage0": dict(stage=0, freeze=WHOLE_AND_PART),
    "stage1": dict(stage=1, freeze=WHOLE_AND_PART),
    "stage2": dict(stage=2, freeze=WHOLE_AND_PART),
    "stage3": dict(stage=3, freeze=WHOLE_AND_PART),
    "stage0_clip_norms": dict(stage=0, freeze=("embedding.*", "*ln_?.weight"), clip=0.5),
    "stage1_middle_block_accumulate": dict(stage=1, freeze=("block.0.*",), accumulate=2),
    "stage3_head_frozen_tied_trains": dict(stage=3, freeze=("head.*", "block.1.*"), bucket_bytes=4096),
    "stage3_trio": dict(stage=3, freeze=WHOLE_AND_PART, driver="trio"),
    "stage3_parameters_nvme_optimizer_cpu": dict(stage=3, freeze=WHOLE_AND_PART,
                                                 offload={"parameters": "nvme", "optimizer": "cpu"}),
    "stage1_resume_from_shards": dict(stage=1, freeze=WHOLE_AND_PART, resume_at=2),
    # a master copy: the step's fresh shard carries the frozen parts on from the gathered parameters
    "stage2_optimizer_cpu": dict(stage=2, freeze=WHOLE_AND_PART, offload={"optimizer": "cpu"}),
    "stage2_buckets": dict(stage=2, freeze=WHOLE_AND_PART, bucket_bytes=8192),
    # decay groups placed where a partly frozen unit's layout puts its parameters
    "stage3_no_decay": dict(stage=3, freeze=("embedding.*", "*.ln_1.weight", "*.attn.c_attn.weight"),
                            no_decay=("biases", "norms")),
}


# bf16 compute, fp32 master of the trainable parameters: a frozen one is held in bf16 only
BF16 = {
    "stage1_bf16": dict(stage=1, freeze=WHOLE_AND_PART, precision="bf16"),
    "stage3_bf16": dict(stage=3, freeze=WHOLE_AND_PART, precision="bf16"),
}


@pytest.fixture(scope="module")
def results():
    return spawn(_run_all, 2, {**CASES, **BF16})


@pytest.mark.parametrize("name", sorted(CASES))
def test_freeze_equals_ddp_with_requires_grad_false(results, name):
    frozen = frozen_names(CASES[name]["freeze"])
    assert frozen and len(frozen) < len(results[0][name]["init"])
    for rank, by_case in enumerate(results):
        r = by_case[name]
        assert r["zdsl"].keys() == r["ref"].keys()
        bad = [k for k in r["ref"] if not torch.equal(r["zdsl"][k], r["ref"][k])]
        assert not bad, f"rank {rank} {name}: differs from DDP in {bad[:4]}"
        assert r["losses"] == r["ref_losses"]
        moved = [k for k in frozen if not torch.equal(r["zdsl"][k], r["init"][k])]
        assert not moved, f"rank {rank} {name}: frozen parameters changed: {moved[:4]}"
        trained = [k for k in r["init"] if k not in frozen and not torch.equal(r["zdsl"][k], r["init"][k])]
        assert len(trained) == len(r["init"]) - len(frozen)     # and every other one trained
        assert {k for k, wants in r["requires"].items() if not wants} == frozen


@pytest.mark.parametrize("name", sorted(BF16))
def test_bf16_freeze_keeps_the_rounded_values_and_trains_the_rest(results, name):
    frozen = frozen_names(BF16[name]["freeze"])
    for by_case in results:
        r = by_case[name]
        assert all(torch.equal(r["zdsl"][k], r["init"][k].bfloat16().float()) for k in frozen)
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-2)
        dz = torch.cat([(r["zdsl"][k] - r["init"][k]).flatten() for k in r["init"] if k not in frozen])
        dr = torch.cat([(r["ref"][k] - r["init"][k]).flatten() for k in r["init"] if k not in frozen])
        assert float((dz - dr).norm() / dr.norm()) < 0.1
