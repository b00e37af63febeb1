"""An evaluation leaves training's random generator as it found it (runtime/run/evaluate.py).

The model (``build_noisy`` in tests/user_models.py) draws dropout masks in eval mode too, so an evaluation moves the
global generator: the rank state must put it back, or the next step draws other masks. One rank
in this process (a gloo group of one), trained by the trio executor as ``zdsl run`` trains it.
"""
from __future__ import annotations

import pytest
import torch
import trio

from user_models import NOISY_FACTORY as FACTORY

STEPS, K = 3, 2                   # eval every step, K eval batches each time
CONTEXT, VOCAB = 16, 64


def schedule_of(stage: int, evaluate: bool):
    from zdsl.schedule import DataSpec, EvalSpec, ModelSpec, OptimizerSpec, Schedule, TrainSpec
    s = Schedule(name="eval_rng", model=ModelSpec("user", {}, factory=FACTORY),
                 data=DataSpec("synthetic", None, {"vocab": VOCAB, "context": CONTEXT}),
                 train=TrainSpec(steps=STEPS, batch=2, precision="fp32", seed=0),
                 optimizer=OptimizerSpec(kind="adamw", lr=1e-2), ranks=1, stage=stage)
    if evaluate:
        s.eval = EvalSpec(1, DataSpec("synthetic", None, {"vocab": VOCAB, "context": CONTEXT}), K)
    return s


def train(stage: int, evaluate: bool) -> dict:
    """Train STEPS steps (evaluating after each one if ``evaluate``): the losses, the final
    parameters, and for each evaluation whether the generator after it equals the one before."""
    from zdsl.driver import compile_eval, compile_schedule
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.exec.executor import Executor
    from zdsl.runtime.models.batch import as_batch
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.sizing import units_for_user_model
    from zdsl.runtime.run.evaluate import Evaluator
    from zdsl.runtime.state.rank import RankState

    schedule = schedule_of(stage, evaluate)
    units = units_for_user_model(schedule.model, CONTEXT)
    graph = compile_schedule(schedule, units)
    torch.manual_seed(0)                                  # as a rank of `zdsl run` seeds before its model
    state = RankState(graph, build_model(schedule.model, seed=0), 0, 1, device="cpu")
    executor = Executor(graph, state, 0)
    evaluator = Evaluator(compile_eval(schedule, units), schedule.eval, state, seed=0, rank=0, world=1,
                          batch=2, device=torch.device("cpu"), make_batch=make_batch) if evaluate else None
    out = {"losses": [], "kept": [], "vals": []}

    async def loop():
        for step in range(STEPS):
            state.step_begin(step, [as_batch(make_batch(schedule.data, 0, step, 0, 0, 1, 2))])
            await executor.run_step()
            out["losses"].append(state.step_end()["loss"])
            if evaluator is not None:
                before = torch.get_rng_state()
                out["vals"].append(await evaluator.run(step))
                out["kept"].append(torch.equal(torch.get_rng_state(), before))

    trio.run(loop)
    out["final"] = {k: v.clone() for k, v in state.export_state().items()}
    return out


def test_the_model_draws_in_eval_mode():
    """Without this the tests below could not see a generator left moved."""
    from zdsl.runtime.models.batch import Batch
    from zdsl.runtime.models.protocol import build_model, run_units
    model = build_model(schedule_of(0, False).model, seed=0).eval()
    idx = torch.randint(0, VOCAB, (2, CONTEXT))
    before = torch.get_rng_state()
    with torch.no_grad():
        run_units(model, Batch.of(idx, idx))
    assert not torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_generator_after_an_evaluation_equals_the_one_before(one_rank_group, stage):
    run = train(stage, True)
    assert run["kept"] == [True] * STEPS, "the global generator after an evaluation differs from before"
    assert len(set(run["vals"])) > 1                          # the evaluations ran, on a changing model


@pytest.mark.parametrize("stage", [0, 3])
def test_training_with_eval_every_step_has_the_bits_of_training_without(one_rank_group, stage):
    with_eval, without = train(stage, True), train(stage, False)
    assert with_eval["losses"] == without["losses"]
    assert set(with_eval["final"]) == set(without["final"])
    assert all(torch.equal(with_eval["final"][k], v) for k, v in without["final"].items())
