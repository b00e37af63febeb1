"""Resuming a DeferredEngine before its first engine(x), as DeepSpeed users resume (issue 56).

A schedule without data, with the user's model, is compiled at the first engine(x); its
``load_checkpoint`` before that call finds and checks the checkpoint at once, returns its
client_state and its step, and loads the weights and optimizer state when the engine starts.
Guards: the resumed run's losses and weights are the bits of an uninterrupted run (and of the
load on an engine compiled from the schedule with data written in); a missing checkpoint is the
engine's own error, at the load; what needs the engine still says to call engine(x) first.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from api_models import batches, mlp
from ddp_reference import spawn
from test_loop_schedule import bare, written

import zdsl
from zdsl.runtime.checkpoint import CheckpointError


def steps(engine, first: int, last: int) -> list[float]:
    """The loop's steps ``first`` to ``last - 1`` (each step's batch is its number's, the rank's part)."""
    losses = []
    for step in range(first, last):
        x, y = batches(0, step, 0, engine.rank, engine.world, 4)
        loss = F.cross_entropy(engine(x), y, label_smoothing=0.1)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def test_a_deferred_load_resumes_the_bits_of_an_uninterrupted_run(tmp_path, one_rank_group):
    with zdsl.initialize(written(tmp_path), model=mlp()) as engine:
        ref_losses = steps(engine, 0, 2)
        ref_lr = engine.lr
        ref_losses += steps(engine, 2, 4)
        ref_state = engine.state_dict()
    with zdsl.initialize(written(tmp_path), model=mlp()) as engine:
        assert steps(engine, 0, 2) == ref_losses[:2]
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 1})
    with zdsl.initialize(written(tmp_path), model=mlp(seed=5)) as engine:    # the load on a compiled engine
        assert engine.load_checkpoint(tmp_path / "ckpt") == (str(tmp_path / "ckpt" / "step-000002"), {"epoch": 1})
        written_losses = steps(engine, 2, 4)
    with zdsl.initialize(bare(tmp_path), model=mlp(seed=5)) as engine:        # other weights: the load must land
        assert type(engine).__name__ == "DeferredEngine"
        assert engine.global_step == 0
        assert engine.load_checkpoint(tmp_path / "ckpt") == (str(tmp_path / "ckpt" / "step-000002"), {"epoch": 1})
        assert engine.global_step == 2 and engine.lr == ref_lr
        with pytest.raises(zdsl.ZdslApiError, match=r"engine\.save_checkpoint: the schedule is compiled at the"):
            engine.save_checkpoint(tmp_path / "other")
        losses = steps(engine, engine.global_step, 4)
        assert engine.global_step == 4
        state = engine.state_dict()
    assert losses == ref_losses[2:] == written_losses
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)


def test_a_missing_checkpoint_is_the_engines_error_at_the_load(tmp_path, one_rank_group):
    with zdsl.initialize(written(tmp_path), model=mlp()) as engine:
        with pytest.raises(CheckpointError) as compiled:
            engine.load_checkpoint(tmp_path / "nothing")
    with zdsl.initialize(bare(tmp_path), model=mlp()) as engine:
        with pytest.raises(CheckpointError) as deferred:
            engine.load_checkpoint(tmp_path / "nothing")
        assert engine.global_step == 0
        assert steps(engine, 0, 1)          # nothing pending: the engine starts as without the load
    assert str(deferred.value) == str(compiled.value)
    assert "no complete checkpoint to resume from" in str(deferred.value)


def two_ranks(rank: int, world: int, stated, fed, folder) -> tuple:
    """At this rank: the uninterrupted run's losses and (rank 0) weights on the schedule ``stated``, the
    deferred resume's on ``fed`` (steps 2 and 3), and the error of a load where only rank 1's folder
    is missing."""
    with zdsl.initialize(stated, model=mlp()) as engine:
        ref = steps(engine, 0, 4), engine.state_dict()
    with zdsl.initialize(stated, model=mlp()) as engine:
        steps(engine, 0, 2)
        engine.save_checkpoint(folder / "ckpt", client_state={"epoch": 1})
    with zdsl.initialize(fed, model=mlp(seed=5)) as engine:
        _, client = engine.load_checkpoint(folder / "ckpt")
        resumed = steps(engine, engine.global_step, 4), engine.state_dict()
    with zdsl.initialize(fed, model=mlp()) as engine:
        try:
            engine.load_checkpoint(folder / ("ckpt" if rank == 0 else "nothing"))
            error = None
        except CheckpointError as exc:
            error = str(exc)
    return ref, resumed, client, error


@pytest.mark.slow
def test_two_ranks_resume_the_bits_and_agree_on_a_missing_checkpoint(tmp_path):
    stated, fed = written(tmp_path, ranks=2), bare(tmp_path, ranks=2)      # written once, before the ranks read
    for rank, (ref, resumed, client, error) in enumerate(spawn(two_ranks, 2, stated, fed, tmp_path)):
        assert client == {"epoch": 1} and resumed[0] == ref[0][2:]
        assert resumed[1].keys() == ref[1].keys() and all(torch.equal(resumed[1][k], ref[1][k]) for k in ref[1])
        assert error is not None and f"{tmp_path / 'nothing'}: no complete checkpoint to resume from" in error, rank
