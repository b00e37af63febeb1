"""A schedule without `model` or `data` (issue 56): the loop gives the model and feeds the batches.

Guards: `zdsl check` accepts such a schedule and says what the loop gives; `zdsl plan` asks for
`--model FILE.py:FUNCTION` and plans with it exactly as the written statement; `zdsl run` refuses
each, positioned, with the fix; the API loop on it trains the bits of the same loop on the schedule
with the model and data written in; the graph compiled at the first engine(x) refuses a batch of
another row, saying what was compiled, and every rank must feed the same first row.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from api_models import HERE, batches, mlp
from ddp_reference import spawn
from helpers import zdsl as zdsl_cli

import zdsl

BARE = "schedule loop \"the loop gives model and data\"\ntrain steps=4, batch=4, precision=fp32\n" \
       "optimizer adamw(lr=1e-2)\nranks {ranks} on cpu\nzero 3\n"
BUILD = f"""\
import sys
sys.path.insert(0, {str(HERE)!r})
import zdsl
from api_models import mlp


def build():
    return zdsl.units(mlp(), [["fc1", "relu"], "fc2"])
"""


def bare(folder, ranks: int = 1, extra: str = ""):
    path = folder / "loop.zs"
    path.write_text(BARE.format(ranks=ranks) + extra)
    return path


def written(folder, ranks: int = 1, data: bool = True):
    """``bare`` with the model (and ``data``) written in: the same model as ``mlp()`` split as given.py
    splits it."""
    (folder / "build.py").write_text(BUILD)
    path = folder / f"written{'' if data else '_no_data'}.zs"
    path.write_text(BARE.format(ranks=ranks) + 'model "build.py:build"()\n'
                    + (f'data python("{HERE / "api_models.py"}:batches")\n' if data else ""))
    return path


def test_check_accepts_it_and_says_what_the_loop_gives(tmp_path):
    gpt = tmp_path / "gpt.zs"
    gpt.write_text(BARE.format(ranks=1) + "model gpt(layers=2, width=32, heads=4)\n")
    done = zdsl_cli("check", str(bare(tmp_path)), str(gpt))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "the model and the batches come from your own loop" in lines[0]
    assert "--model FILE.py:FUNCTION" in lines[0]
    assert "4 units" in lines[1] and "the batches come from your own loop" in lines[1]


def test_plan_asks_for_the_model_then_plans_it_as_the_statement_would(tmp_path):
    path = bare(tmp_path)
    done = zdsl_cli("plan", str(path))
    assert done.returncode == 2 and "--model FILE.py:FUNCTION" in done.stderr and "model statement" in done.stderr
    (tmp_path / "build.py").write_text(BUILD)
    given = zdsl_cli("plan", str(path), "--model", "build.py:build", "--json", "--no-calibrate", cwd=tmp_path)
    assert given.returncode == 0, given.stderr
    stated = tmp_path / "stated.zs"
    stated.write_text(path.read_text() + 'model "build.py:build"()\n')
    statement = zdsl_cli("plan", str(stated), "--json", "--no-calibrate", cwd=tmp_path)
    plans = [json.loads(done.stdout) for done in (given, statement)]
    for plan in plans:
        del plan["file"], plan["machine_fit"]["ram_available"]     # which file; this machine's free RAM now
    assert plans[0] == plans[1]


def test_run_refuses_each_with_its_position_and_the_fix(tmp_path):
    done = zdsl_cli("run", str(bare(tmp_path)))
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert errors == [f"{tmp_path / 'loop.zs'}:1:1: error: zdsl run needs a model statement: without one the "
                      f"model comes from your own loop (zdsl.initialize(FILE, model=m))",
                      f"{tmp_path / 'loop.zs'}:1:1: error: zdsl run needs a data statement: without one the "
                      f"batches come from your own loop (engine(x) after zdsl.initialize)"]
    assert done.stderr.count("hint: add e.g.") == 2 and "zdsl.initialize" in done.stderr


def loop(engine, steps: int, rank: int = 0, world: int = 1) -> tuple[list[float], dict]:
    losses = []
    for step in range(steps):
        x, y = batches(0, step, 0, rank, world, 4)
        loss = F.cross_entropy(engine(x), y, label_smoothing=0.1)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, engine.state_dict()


@pytest.mark.parametrize("named", [False, True])
def test_the_loop_trains_the_bits_of_the_schedule_with_model_and_data_written(tmp_path, one_rank_group, recwarn,
                                                                              named):
    """Without data, the model given (or named as well): compiled at the first engine(x)."""
    fed = written(tmp_path, data=False) if named else bare(tmp_path)
    with zdsl.initialize(fed, model=mlp()) as engine:
        assert type(engine).__name__ == "DeferredEngine"
        losses, state = loop(engine, 4)
    assert not [w for w in recwarn if "meta device" in str(w.message)]     # never sized before its row
    with zdsl.initialize(written(tmp_path), model=mlp()) as engine:
        ref_losses, ref_state = loop(engine, 4)
    assert losses == ref_losses and losses[-1] < losses[0]
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)


def test_a_batch_of_another_row_is_refused_saying_what_was_compiled(tmp_path, one_rank_group):
    with zdsl.initialize(bare(tmp_path), model=mlp()) as engine:
        with pytest.raises(zdsl.ZdslApiError, match=r"engine\.state_dict: the schedule is compiled at the first"):
            engine.state_dict()
        loop(engine, 1)
        with pytest.raises(zdsl.ZdslApiError) as refused:
            engine(torch.randn(4, 10))
    said = str(refused.value)
    assert "a batch of inputs float32 (4, 10), but the schedule was compiled for inputs float32 (4, 12)" in said
    assert "train batch=4" in said and "the first engine(x) fed it" in said


def test_without_model_initialize_says_to_give_one(tmp_path, one_rank_group):
    with pytest.raises(zdsl.ZdslApiError, match="has no model statement: give initialize"):
        zdsl.initialize(bare(tmp_path))


def two_ranks(rank: int, world: int, paths: list, features: list) -> list:
    """Each schedule's loop at this rank: losses and (rank 0) weights; then a first batch of this
    rank's ``features`` columns, whose error (or None) is returned."""
    out = []
    for path in paths:
        with zdsl.initialize(path, model=mlp()) as engine:
            losses, state = loop(engine, 3, rank, world)
            out.append((losses, state))
    with zdsl.initialize(paths[0], model=mlp()) as engine:
        try:
            engine(torch.randn(4, features[rank]))
            out.append(None)
        except zdsl.ZdslApiError as exc:
            out.append(str(exc))
    return out


@pytest.mark.slow
def test_two_ranks_train_the_written_bits_and_must_feed_one_row(tmp_path):
    paths = [bare(tmp_path, ranks=2), written(tmp_path, ranks=2)]
    ranks = spawn(two_ranks, 2, paths, [12, 10])
    for (mine, ref, error) in ranks:
        assert mine[0] == ref[0]
        assert all(torch.equal(mine[1][k], ref[1][k]) for k in ref[1])
        assert "the ranks' first batches differ (rank 0: inputs float32 (12,); rank 1: inputs float32 (10,))" \
            in error
