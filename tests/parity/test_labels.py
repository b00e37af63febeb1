"""The unit protocol's batch and -100 labels at 2 ranks, against torch DDP on the same batches.

* A user's model whose units take the batch (learned positions and rotary tables from per-row
  positions, a causal and padding mask, both made by ``prepare`` from a buffer outside every unit;
  padding labelled -100) trained at ZeRO-3 equals DDP running the model's own ``forward(batch)``.
* The built-in GPT with the first half of every row's labels -100, at stages 0 and 3, equals DDP
  to the bit, and its first loss is the masked mean computed by hand.
* A micro-batch whose labels are all -100 adds 0 to the step's loss and nothing to its gradient:
  no NaN, and DDP's bits.
* A model in the first form of the protocol (units take the hidden state alone) still trains as
  DDP does.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ddp_reference import default_batch, ddp_train, run_steps, spawn
from user_models import BATCHED_FACTORY, FACTORY

from zdsl.runtime.models.batch import IGNORE_INDEX
from zdsl.runtime.models.batch import Batch
from zdsl.schedule import DataSpec
from zdsl.schedule import ModelSpec
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

VOCAB, CONTEXT = 64, 16
GPT = ModelSpec("gpt", dict(layers=2, width=32, heads=2, vocab=VOCAB, context=CONTEXT))
BATCHED = ModelSpec("user", dict(vocab=VOCAB, context=CONTEXT, hidden=32, layers=2, heads=2),
                    factory=BATCHED_FACTORY)
LEGACY = ModelSpec("user", dict(vocab=VOCAB, context=CONTEXT, hidden=32, layers=2, tied=True), factory=FACTORY)


def packed(data, seed, step, micro, rank, world, batch) -> Batch:
    """Rows as packed or padded data gives them: each starts at its own position, after padding
    of its own length on the left (attention mask 0, labels -100; on the right, causal attention
    alone would keep padding out of every counted token)."""
    b = default_batch(data, seed, step, micro, rank, world, batch)
    B, T = b.input_ids.shape
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    positions = torch.arange(T) + torch.randint(0, T, (B, 1), generator=g)
    mask = (torch.arange(T) >= torch.randint(0, T // 2, (B, 1), generator=g)).long()
    return Batch(b.input_ids, b.labels.masked_fill(mask == 0, IGNORE_INDEX), positions=positions,
                 attention_mask=mask)


def half_ignored(data, seed, step, micro, rank, world, batch) -> Batch:
    """The first half of every row not counted (a prompt before its answer)."""
    b = default_batch(data, seed, step, micro, rank, world, batch)
    b.labels[:, :b.labels.shape[1] // 2] = IGNORE_INDEX
    return b


def second_micro_ignored(data, seed, step, micro, rank, world, batch) -> Batch:
    """Micro-batch 1 of every step counts no label."""
    b = default_batch(data, seed, step, micro, rank, world, batch)
    if micro == 1:
        b.labels.fill_(IGNORE_INDEX)
    return b


# name: (model, stage, accumulate, recompute, make)
CASES = {
    "batched_stage3": (BATCHED, 3, 1, (), packed),
    "batched_stage1_recompute_accumulate": (BATCHED, 1, 2, (1, 2), packed),
    "gpt_half_ignored_stage0": (GPT, 0, 1, (), half_ignored),
    "gpt_half_ignored_stage3": (GPT, 3, 1, (), half_ignored),
    "gpt_micro_all_ignored_stage1": (GPT, 1, 2, (), second_micro_ignored),
    "legacy_stage3": (LEGACY, 3, 1, (), default_batch),
}


def make_schedule(model: ModelSpec, world: int, stage: int, accumulate: int, recompute) -> Schedule:
    return Schedule(name="labels", model=model, data=DataSpec("synthetic", None, {"vocab": VOCAB, "context": CONTEXT}),
                    train=TrainSpec(steps=4, batch=4, accumulate=accumulate, precision="fp32", seed=0),
                    optimizer=OptimizerSpec(kind="adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
                    ranks=world, stage=stage, recompute=set(recompute))


def run_case(rank: int, world: int, model, stage, accumulate, recompute, make) -> dict:
    from zdsl.model.units import gpt_units
    from zdsl.driver import compile_schedule
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.sizing import units_for_user_model
    from zdsl.runtime.state.rank import RankState

    sched = make_schedule(model, world, stage, accumulate, recompute)
    t = sched.train
    units = gpt_units(**model.args) if model.kind == "gpt" else units_for_user_model(model, CONTEXT)
    graph = compile_schedule(sched, units)
    state = RankState(graph, build_model(model, seed=t.seed), rank, world, device="cpu")
    steps = run_steps(graph, state, sched, rank, world, make=make)
    ref, ref_losses = ddp_train({}, sched.data, seed=t.seed, steps=t.steps, batch=t.batch, accumulate=t.accumulate,
                                optimizer=sched.to_config()["optimizer"], rank=rank, world=world,
                                build=lambda: build_model(model, seed=t.seed), make=make)
    return dict(zdsl=state.export_state(), losses=[s["loss"] for s in steps], ref=ref, ref_losses=ref_losses,
                init={n: p.detach() for n, p in build_model(model, seed=t.seed).named_parameters()})


def run_cases(rank: int, world: int, cases: dict) -> dict:
    return {name: run_case(rank, world, *case) for name, case in cases.items()}


@pytest.fixture(scope="module")
def results():
    return spawn(run_cases, 2, CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_zdsl_equals_ddp_on_the_same_batches_to_the_bit(results, name):
    for rank, by_case in enumerate(results):
        r = by_case[name]
        assert set(r["ref"]) <= set(r["zdsl"])      # the export adds persistent buffers (rotary tables)
        bad = [k for k in r["ref"] if not torch.equal(r["zdsl"][k], r["ref"][k])]
        assert not bad, f"rank {rank} {name}: differs from DDP in {bad[:4]}"
        assert r["losses"] == r["ref_losses"]
        assert all(math.isfinite(x) for x in r["losses"])
        moved = [k for k in r["init"] if not torch.equal(r["init"][k], r["zdsl"][k])]
        assert moved, f"rank {rank} {name}: nothing trained"


def test_the_first_loss_is_the_mean_over_the_counted_labels_by_hand(results):
    """Independent of the model's loss function: log-softmax of GPT's logits at the counted positions."""
    from zdsl.runtime.models.gpt import GPT as Model
    sched = make_schedule(GPT, 2, 0, 1, ())
    model = Model(**GPT.args, seed=0)
    for rank, by_case in enumerate(results):
        b = half_ignored(sched.data, 0, 0, 0, rank, 2, sched.train.batch)
        with torch.no_grad():
            x = model.embedding(b.input_ids)
            for block in model.blocks:
                x = block(x)
            logits = F.linear(model.head.ln_f(x), model.embedding.wte.weight)
            counted = b.labels != IGNORE_INDEX
            picked = logits.log_softmax(-1).gather(-1, b.labels.clamp_min(0)[..., None])[..., 0]
            want = float(-picked[counted].mean())
            unmasked = float(F.cross_entropy(logits.view(-1, VOCAB), default_batch(
                sched.data, 0, 0, 0, rank, 2, sched.train.batch).labels.reshape(-1)))
        for name in ("gpt_half_ignored_stage0", "gpt_half_ignored_stage3"):
            got = by_case[name]["losses"][0]
            assert got == pytest.approx(want, rel=1e-6), (rank, name)
        assert abs(want - unmasked) > 1e-3   # the mask changes the loss: the test above can tell


def test_a_micro_batch_counting_no_label_adds_zero_to_the_step_loss(results):
    """Step loss = (micro 0's loss + 0) / 2: recomputed here by a plain forward of micro 0."""
    from zdsl.runtime.models.gpt import GPT as Model
    sched = make_schedule(GPT, 2, 1, 2, ())
    model = Model(**GPT.args, seed=0)
    for rank, by_case in enumerate(results):
        b = second_micro_ignored(sched.data, 0, 0, 0, rank, 2, sched.train.batch)
        with torch.no_grad():
            first = float(model(b))
        assert by_case["gpt_micro_all_ignored_stage1"]["losses"][0] == pytest.approx(first / 2, rel=1e-6)
