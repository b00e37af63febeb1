"""HF models built lazily: parameters on meta until ``materialize_unit``, so a rank never holds
more than one unit's full parameters, with the eager model's exact bits.

Whether a unit's full parameters are still held is read from their storages through weak
references (``StorageWeakRef``: expired once nothing holds the memory), not from RSS.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from ddp_reference import run_steps, spawn
from hf_tiny import CONTEXT, VOCAB, save_tiny
from helpers import sized
from torch.multiprocessing.reductions import StorageWeakRef

from zdsl.driver import compile_schedule
from zdsl.runtime.models.hf import load
from zdsl.runtime.sizing import unit_specs
from zdsl.runtime.state.rank import RankState
from zdsl.schedule import DataSpec, ModelSpec, OptimizerSpec, Schedule, TrainSpec

# (family, saved with weights?): GPT-2's embeddings are tied (the head reads unit 0's), Llama's not.
SOURCES = [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False)]


def source_id(source) -> str:
    return f"{source[0]}-{'weights' if source[1] else 'config-only'}"


@pytest.fixture(scope="module", params=SOURCES, ids=source_id)
def folder(request, tmp_path_factory):
    family, weights = request.param
    return save_tiny(family, tmp_path_factory.mktemp(source_id(request.param)), weights=weights, seed=5)


def spec(folder) -> ModelSpec:
    return ModelSpec("hf", {}, path=str(folder))


def values(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


class Held:
    """Watches a lazy model's ``materialize_unit``: which units' materialised parameters are still
    held (their storages alive), and the most units ever held at once."""

    def __init__(self, model):
        self.refs: list[tuple[int, StorageWeakRef]] = []
        self.most = 0
        materialize_unit = model.materialize_unit

        def watched(u: int) -> None:
            self.most = max(self.most, len(self.units()))
            materialize_unit(u)
            self.refs += [(u, StorageWeakRef(p.untyped_storage())) for p in model.units()[u].parameters()]
            self.most = max(self.most, len(self.units()))

        model.materialize_unit = watched       # RankState and materialize() call it through the instance

    def units(self) -> set[int]:
        return {u for u, ref in self.refs if not ref.expired()}


def test_a_lazy_model_holds_no_parameters_until_asked(folder):
    state = torch.random.get_rng_state()
    model = load(spec(folder), seed=3, lazy=True)
    assert torch.equal(torch.random.get_rng_state(), state)        # torch's global RNG untouched
    assert model.is_lazy and all(p.is_meta for p in model.parameters())
    eager = load(spec(folder), seed=3)
    assert not eager.is_lazy
    buffers, eager_buffers = dict(model.named_buffers()), dict(eager.named_buffers())
    assert buffers.keys() == eager_buffers.keys()                   # Llama's rotary inv_freq: real, equal
    assert all(not b.is_meta and torch.equal(b, eager_buffers[n]) for n, b in buffers.items())
    with pytest.raises(RuntimeError, match="materialize"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="in order; next is 0"):
        model.materialize_unit(1)


def test_lazy_gives_the_eager_bits_unit_by_unit(folder):
    eager = load(spec(folder), seed=3)
    model = load(spec(folder), seed=3, lazy=True)
    params = {n: p for n, p in model.named_parameters()}
    for u, unit in enumerate(model.units()):
        model.materialize_unit(u)
        assert all(not p.is_meta for p in unit.parameters())
        assert all(p.is_meta for later in model.units()[u + 1:] for p in later.parameters())
    assert not model.is_lazy
    assert all(p is params[n] for n, p in model.named_parameters())   # the same objects, values swapped in
    expected, got = values(eager), values(model)
    assert expected.keys() == got.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    if model.tied:                               # the head reads unit 0's parameter, now with its values
        head = model.units()[-1]
        assert head._embedding.get_parameter(head.tied_name) is model.units()[0].get_parameter(head.tied_name)
    other_seed = values(load(spec(folder), seed=4, lazy=True).materialize())
    weights = (folder / "model.safetensors").is_file()
    assert all(torch.equal(other_seed[k], got[k]) for k in got) == weights   # seeded init follows the seed


def two_rank_graph(folder, stage: int = 3):
    schedule = Schedule(name="lazy", model=spec(folder), data=DataSpec("synthetic", None, {"vocab": VOCAB,
                                                                                        "context": CONTEXT}),
                        train=TrainSpec(steps=1, batch=2, seed=3), optimizer=OptimizerSpec(kind="adamw", lr=1e-3),
                        ranks=2, stage=stage)
    return compile_schedule(schedule, unit_specs(schedule.model, CONTEXT))


def test_rank_state_holds_one_units_full_parameters_at_a_time(folder):
    """Each rank of a 2-rank ZeRO-3 graph (built here in one process: start-up needs no group):
    the lazy model's units are materialised one at a time, each released before the next, none
    held afterwards; the shards are the eager model's bits."""
    graph = two_rank_graph(folder)
    for rank in range(2):
        model = load(spec(folder), seed=3, lazy=True)
        held = Held(model)
        lazy = RankState(graph, model, rank, 2, device="cpu")
        assert held.most == 1 and not held.units()
        assert {u for u, _ in held.refs} == set(range(len(model.units())))
        eager = RankState(graph, load(spec(folder), seed=3), rank, 2, device="cpu")
        got, expected = lazy.shard_state(), eager.shard_state()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_held_counts_units_kept_alive():
    """The measure can fail: materialising every unit at once holds them all."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        model = load(spec(save_tiny("llama", tmp, weights=False)), lazy=True)
        held = Held(model)
        model.materialize()
        assert held.most == len(model.units()) == len(held.units())


# -- through `zdsl run` ---------------------------------------------------------------------

RUN_SOURCES = [("gpt2", True), ("llama", False)]      # tied with weights, untied seeded
PROGRAM = """schedule lazy "lazy load"
model     hf("{folder}")
data      synthetic(vocab={vocab}, context={context})
train     steps=2, batch=2, precision=fp32, seed=3
optimizer adamw(lr=1e-2)
ranks     2 on cpu
zero      3
"""


def eager_run(rank: int, world: int, path: str) -> dict:
    """The schedule's steps from the eager model (RankState as the HF parity tests build it)."""
    from zdsl.driver import compile_file
    from zdsl.runtime.models.protocol import build_model
    compiled = compile_file(path, None, simulate=False)
    graph, schedule = compiled.graph, compiled.schedule
    state = RankState(graph, build_model(schedule.model, seed=schedule.train.seed), rank, world, device="cpu")
    losses = [row["loss"] for row in run_steps(graph, state, schedule, rank, world)]
    return dict(losses=losses, params=state.export_state())


@pytest.mark.slow
@pytest.mark.parametrize("source", RUN_SOURCES, ids=source_id)
def test_zdsl_run_lazily_gives_the_eager_bits(source, tmp_path):
    """`zdsl run` builds the model lazily; at 2 ranks ZeRO-3 its trained parameters (--export)
    are the eager model's, bit for bit."""
    from safetensors.torch import load_file
    family, weights = source
    folder = save_tiny(family, tmp_path / family, weights=weights, seed=5)
    path = tmp_path / "lazy.zs"
    path.write_text(PROGRAM.format(folder=folder, vocab=VOCAB, context=CONTEXT))
    sized(path)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "run", str(path), "--quiet", "--export", "out.safetensors"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ran = load_file(str(tmp_path / "out.safetensors"))
    by_rank = spawn(eager_run, 2, str(path))
    expected = by_rank[0]["params"]
    assert ran.keys() == expected.keys() and all(torch.equal(ran[k], expected[k]) for k in expected)
    initial = load(spec(folder), seed=3).state_dict()
    assert not all(torch.equal(ran[k], initial[k]) for k in ran if k in initial)        # trained
