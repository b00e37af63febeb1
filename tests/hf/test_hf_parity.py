"""zdsl trains HF models at 2 ranks as transformers and torch's AdamW do in one process.

Each case saves a tiny pretrained folder (transformers' own init), trains it with zdsl at 2 gloo
ranks (stage 0 or 3, fp32) and with a single-process reference: transformers'
``AutoModelForCausalLM.from_pretrained`` of the same folder, the same batches (both ranks' as one
global batch, so the gradient is the mean of the two ranks' losses, as zdsl's), torch's AdamW with
zdsl's settings. Every rank's loss at every step agrees within 1e-6 relative; the first step's
loss is transformers' ``model(input_ids, labels=...)`` on the pretrained weights.
"""
from __future__ import annotations

import pytest
import torch
from ddp_reference import run_steps, spawn
from hf_tiny import CONTEXT, VOCAB, save_tiny, transformers_loss, transformers_model

from zdsl.driver import compile_schedule
from zdsl.runtime.data import make_batch
from zdsl.runtime.state.optim import make_torch_optimizer
from zdsl.schedule import DataSpec, ModelSpec, OptimizerSpec, Schedule, TrainSpec

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

WORLD, BATCH = 2, 2
# name: (family, stage, steps, attention)
CASES = {
    "gpt2_zero0": ("gpt2", 0, 5, "sdpa"),
    "gpt2_zero3": ("gpt2", 3, 5, "sdpa"),
    "llama_zero0": ("llama", 0, 5, "sdpa"),
    "llama_zero3": ("llama", 3, 5, "sdpa"),
    "llama_zero3_eager": ("llama", 3, 2, "eager"),
    "mistral_zero3": ("mistral", 3, 2, "sdpa"),
    "qwen2_zero3": ("qwen2", 3, 2, "sdpa"),
    "qwen3_zero3": ("qwen3", 3, 2, "sdpa"),
}


def make_schedule(folder, stage: int, steps: int, attn: str) -> Schedule:
    return Schedule(name="hf", model=ModelSpec("hf", {"attn_implementation": attn}, path=str(folder)),
                    data=DataSpec("synthetic", None, {"vocab": VOCAB, "context": CONTEXT}),
                    train=TrainSpec(steps=steps, batch=BATCH, seed=0),
                    optimizer=OptimizerSpec(kind="adamw", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1),
                    ranks=WORLD, stage=stage)


def zdsl_losses(rank: int, world: int, schedules: dict) -> dict[str, list[float]]:
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.sizing import unit_specs
    from zdsl.runtime.state.rank import RankState
    out = {}
    for name, schedule in schedules.items():
        graph = compile_schedule(schedule, unit_specs(schedule.model, CONTEXT))
        state = RankState(graph, build_model(schedule.model, seed=schedule.train.seed), rank, world, device="cpu")
        out[name] = [row["loss"] for row in run_steps(graph, state, schedule, rank, world)]
    return out


def reference_losses(schedule: Schedule) -> list[list[float]]:
    """Per step, each rank's loss: transformers' model and torch's AdamW on the global batch."""
    torch.manual_seed(0)
    model = transformers_model(schedule.model.path, schedule.model.args["attn_implementation"])
    opt = make_torch_optimizer(model.parameters(), schedule.to_config()["optimizer"])
    t, out = schedule.train, []
    for step in range(t.steps):
        losses = [transformers_loss(model, *make_batch(schedule.data, t.seed, step, 0, r, WORLD, t.batch))
                  for r in range(WORLD)]
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([float(x.detach()) for x in losses])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folders = {f: save_tiny(f, tmp_path_factory.mktemp(f)) for f in {c[0] for c in CASES.values()}}
    schedules = {name: make_schedule(folders[f], stage, steps, attn) for name, (f, stage, steps, attn) in CASES.items()}
    by_rank = spawn(zdsl_losses, WORLD, schedules)
    return {name: ([r[name] for r in by_rank], reference_losses(s)) for name, s in schedules.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_losses_match_transformers_and_adamw(runs, case):
    ours, reference = runs[case]
    for step, expected in enumerate(reference):
        for rank in range(WORLD):
            assert ours[rank][step] == pytest.approx(expected[rank], rel=1e-6), (step, rank)


def test_first_step_is_transformers_loss_on_the_pretrained_weights(runs, tmp_path):
    """The first step's loss at stage 3 is ``model(input_ids, labels)`` of the saved folder (the
    window form: see hf_tiny.transformers_loss), computed here afresh."""
    ours, _ = runs["llama_zero3"]
    schedule = make_schedule(save_tiny("llama", tmp_path / "again"), 3, 1, "sdpa")
    with torch.no_grad():
        loss = transformers_loss(transformers_model(schedule.model.path),
                                 *make_batch(schedule.data, 0, 0, 0, 0, WORLD, BATCH))
    assert ours[0][0] == pytest.approx(float(loss), rel=1e-6)
