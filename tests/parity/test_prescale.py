"""Gradient averaging inside a collective: the pipelines that reach it, against DDP.

A gradient is multiplied by 1/world after the last backward that writes it, before its
reduction. No policy ever reduces a gradient twice, but a hand-written pipeline can: a second
``reduce gradients[u]`` all-reduces a gradient every rank already holds averaged, and is
scaled inside the collective, so it leaves the values as they are (DDP's bits). A second
``scatter`` is refused: a reduce-scatter may consume its input (gloo's by all-reduce sums it
in place, gloo's own leaves it), so what a second one produced depended on the algorithm (here
0.54 relative off DDP with gloo's own reduce-scatter, exact with the all-reduce one).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_reference import ddp_train, run_steps, spawn

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

PIPELINE = """schedule twice "each gradient reduced twice"
model     gpt(layers=2, width=32, heads=2, vocab=64, context=16)
data      synthetic(vocab=64, context=16)
train     steps=4, batch=4, precision=fp32
optimizer {optimizer}
ranks     2 on cpu
zero      {zero}
{extra}
forward unit u {{
    compute   u
}}
backward unit u {{
    compute   u
    {verb}   gradients[u]
    {verb}   gradients[u]
}}
step unit u {{
    step      u
    {gather}
}}
"""


def program(folder: Path, zero: int, optimizer: str = "adamw(lr=1e-2, weight_decay=0.1)", extra: str = "") -> Path:
    path = folder / f"twice{zero}.zs"
    path.write_text(PIPELINE.format(zero=zero, optimizer=optimizer, extra=extra,
                                    verb="reduce " if zero == 0 else "scatter",
                                    gather="" if zero == 0 else "gather    parameters[u]"))
    return path


def train(rank: int, world: int, path: str, sets: dict) -> dict:
    from zdsl.driver import compile_file
    from zdsl.runtime.models.gpt import GPT
    from zdsl.runtime.state.rank import RankState

    compiled = compile_file(path, sets, simulate=False)
    assert compiled.ok
    graph, s = compiled.graph, compiled.schedule
    state = RankState(graph, GPT(**s.model.args, seed=s.train.seed), rank, world, device="cpu")
    in_comm = sorted(state.prescale.in_collective)
    t = s.train
    losses = [row["loss"] for row in run_steps(graph, state, s, rank, world)]
    ref, ref_losses = ddp_train(s.model.args, s.data, seed=t.seed, steps=t.steps, batch=t.batch,
                                accumulate=t.accumulate, optimizer=s.to_config()["optimizer"], rank=rank, world=world)
    return dict(mine=state.export_state(), losses=losses, ref=ref, ref_losses=ref_losses, in_comm=in_comm)


def run_cases(rank: int, world: int, cases: dict) -> dict:
    return {name: train(rank, world, *args) for name, args in cases.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("twice")
    plain = str(program(folder, 0))
    sgd = str(program(folder, 0, "sgd(lr=0.05, momentum=0.9)", "bucket    4KiB"))
    cases = {"adamw": (plain, {}), "sgd_buckets_accumulate": (sgd, {"accumulate": "2"})}
    return spawn(run_cases, 2, cases)


@pytest.mark.parametrize("name", ["adamw", "sgd_buckets_accumulate"])
def test_a_gradient_all_reduced_twice_gives_ddp_bits(results, name):
    for rank, by_case in enumerate(results):
        r = by_case[name]
        assert r["in_comm"], "the second all-reduces must scale in the collective"
        bad = [k for k in r["ref"] if not torch.equal(r["mine"][k], r["ref"][k])]
        assert not bad, f"rank {rank}: {bad[:3]} differ from DDP"
        assert r["losses"] == r["ref_losses"]


@pytest.mark.parametrize("zero", [1, 2])
def test_a_gradient_reduce_scattered_twice_is_refused(tmp_path, zero):
    env = dict(os.environ)
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "run", str(program(tmp_path, zero)), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1
    assert "comm.reduce_scatter unit 3: reduce-scatters grad_full[3] again with no backward" in proc.stderr
    assert "scatter each gradient once" in proc.stderr and "Traceback" not in proc.stderr
