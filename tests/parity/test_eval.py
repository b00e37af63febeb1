"""``eval every N steps on SOURCE batches=K`` on 2 gloo ranks, against one process.

zdsl trains the built-in GPT with the trio executor, as ``zdsl run`` does, and evaluates
with the forward-only graph on the same rank state (runtime/run/evaluate.py). The
reference takes the parameters zdsl holds at each evaluation into a plain torch GPT in
this (one) process and computes the cross entropy over the union of every rank's K eval
batches: ``val_loss`` must equal it to 1e-6, at ZeRO 0, 1, 2 and 3 (parameters on the
device and on the host), and with ``-100`` labels masking a different number of tokens
per batch and rank (token-weighted, as one process over the union). The same run
without evaluation must give the same training losses and final parameters, to the bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddp_reference import spawn
from test_state_vs_ddp import BATCH
from test_state_vs_ddp import MODEL
from test_state_vs_ddp import make_schedule

from zdsl.model.units import gpt_units
from zdsl.driver import compile_eval
from zdsl.driver import compile_schedule
from zdsl.schedule import DataSpec
from zdsl.schedule import EvalSpec

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

STEPS, EVERY, K = 3, 2, 3         # evaluations after steps 2 and 3 (the last)
EVAL_DATA = DataSpec("synthetic", None, {"vocab": 48, "context": MODEL["context"]})   # not the training data


def eval_batch(data, seed, step, micro, rank, world, batch, masked: bool):
    """The eval source's micro-batch; ``masked``: some labels -100, how many depends on step and rank."""
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.models.batch import Batch
    b = Batch.of(*make_batch(data, seed, step, micro, rank, world, batch))
    if masked:
        b.labels[:, : 2 + 3 * step + 5 * rank] = -100
    return b


def train(rank: int, world: int, stage: int, offload, masked: bool, evaluate: bool) -> dict:
    import trio

    from zdsl.runtime.exec.executor import Executor
    from zdsl.runtime.models.gpt import GPT
    from zdsl.runtime.run.evaluate import Evaluator
    from zdsl.runtime.state.rank import RankState

    schedule = make_schedule(world, stage, offload=offload)
    schedule.train.steps = STEPS
    schedule.eval = EvalSpec(EVERY, EVAL_DATA, K)
    units = gpt_units(**MODEL)
    graph = compile_schedule(schedule, units)
    state = RankState(graph, GPT(**MODEL, seed=schedule.train.seed), rank, world, device="cpu")
    executor = Executor(graph, state, rank)
    evaluator = Evaluator(compile_eval(schedule, units), schedule.eval, state, seed=schedule.train.seed,
                          rank=rank, world=world, batch=BATCH, device=torch.device("cpu"),
                          make_batch=lambda *a: eval_batch(*a, masked=masked))
    t = schedule.train
    out = {"losses": [], "vals": {}, "params": {}, "batches": [eval_batch(EVAL_DATA, t.seed, i, 0, rank, world,
                                                                          BATCH, masked) for i in range(K)]}

    async def loop():
        from ddp_reference import default_batch
        for step in range(STEPS):
            state.step_begin(step, [default_batch(schedule.data, t.seed, step, m, rank, world, t.batch)
                                    for m in range(t.accumulate)])
            await executor.run_step()
            out["losses"].append(state.step_end()["loss"])
            if evaluate and evaluator.due(step, STEPS):
                out["vals"][step] = await evaluator.run(step)
                out["params"][step] = {k: v.clone() for k, v in state.export_state().items()}
        if evaluate:       # the same K batches, the model untouched by evaluating: the same value again
            out["again"] = await evaluator.run(STEPS - 1)

    trio.run(loop)
    out["final"] = {k: v.clone() for k, v in state.export_state().items()}
    return out


def run_case(rank: int, world: int, stage: int, offload, masked: bool) -> tuple[dict, dict]:
    return train(rank, world, stage, offload, masked, True), train(rank, world, stage, offload, masked, False)


def run_cases(rank: int, world: int, cases: dict) -> dict:
    return {name: run_case(rank, world, *args) for name, args in cases.items()}


# name: (stage, offload, masked labels)
CASES = {
    "zero0": (0, None, False),
    "zero1": (1, None, False),
    "zero2_masked_labels": (2, None, True),
    "zero3": (3, None, False),
    "zero3_parameters_on_host": (3, {"parameters": "cpu", "optimizer": "cpu"}, False),
}


@pytest.fixture(scope="module")
def results():
    return spawn(run_cases, 2, CASES)


def reference_val_loss(params: dict, batches: list) -> float:
    """One process, one model, the cross entropy over the union of the ranks' eval batches."""
    from zdsl.runtime.models.gpt import GPT
    model = GPT(**MODEL, seed=1)
    model.load_state_dict(params)
    logits, labels = [], []
    with torch.no_grad():
        for b in batches:
            x = model.embedding(b.input_ids, b)
            for block in model.blocks:
                x = block(x, b)
            logits.append(F.linear(model.head.ln_f(x), model.embedding.wte.weight).flatten(0, 1))
            labels.append(b.labels.flatten())
    return float(F.cross_entropy(torch.cat(logits).double(), torch.cat(labels), ignore_index=-100))


@pytest.mark.parametrize("name", sorted(CASES))
def test_val_loss_equals_one_process_over_the_union(results, name):
    by_rank = [r[name][0] for r in results]
    batches = [b for r in by_rank for b in r["batches"]]
    assert sorted(by_rank[0]["vals"]) == [EVERY - 1, STEPS - 1]        # every N steps and after the last
    for step, val in by_rank[0]["vals"].items():
        assert all(r["vals"][step] == val for r in by_rank), "every rank reports the same val_loss"
        ref = reference_val_loss(by_rank[0]["params"][step], batches)
        assert abs(val - ref) <= 1e-6, f"after step {step + 1}: zdsl {val!r}, one process {ref!r}"
    assert by_rank[0]["again"] == by_rank[0]["vals"][STEPS - 1]
    first, last = by_rank[0]["vals"][EVERY - 1], by_rank[0]["vals"][STEPS - 1]
    assert first != last, "the evaluations saw the model change"


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_unchanged_by_evaluating(results, name):
    for r in results:
        with_eval, without = r[name]
        assert with_eval["losses"] == without["losses"]
        assert set(with_eval["final"]) == set(without["final"])
        assert all(torch.equal(with_eval["final"][k], v) for k, v in without["final"].items())


def test_masked_labels_weigh_tokens_not_batches(results):
    """The masked case's batches count different tokens: a mean of batch means would differ."""
    by_rank = [r["zero2_masked_labels"][0] for r in results]
    counts = {int((b.labels != -100).sum()) for r in by_rank for b in r["batches"]}
    assert len(counts) > 1
