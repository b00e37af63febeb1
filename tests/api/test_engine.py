"""The engine at one rank, in this process: the loop's results, its surface and every misuse.

Guards: the API loop with a model's own loss trains the bits the executor's loop (``zdsl run``'s
step frame) trains; a user's loss on a given model trains the bits plain torch trains; a
forward-only call leaves training's bits alone; gathered() shows full parameters and frees them
after; a checkpoint round trip keeps the bits and the client state; each misuse raises one
ZdslApiError and leaves the engine as it was (the correct loop after it still has the bits).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zdsl
from api_models import batches, mlp, schedule
from ddp_reference import run_steps
from zdsl.runtime.api import ZdslApiError

GPT_ZS = """\
schedule gpt_api "the built-in GPT with its own loss"
model     gpt(layers=2, width=32, heads=4, vocab=64, context=8)
data      synthetic(vocab=64, context=8)
train     steps=3, batch=2, accumulate={acc}, precision=fp32
optimizer adamw(lr=1e-2)
ranks     1 on cpu
zero      {zero}
"""


def reference(zs):
    """zdsl run's step frame on the executor (tests/ddp_reference.py's run_steps)."""
    from zdsl.driver import compile_file
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState
    compiled = compile_file(str(zs), {}, simulate=False)
    s = compiled.schedule
    state = RankState(compiled.graph, build_model(s.model, seed=s.train.seed), 0, 1)
    rows = run_steps(compiled.graph, state, s, 0, 1)
    return [r["loss"] for r in rows], state.export_state()


def gpt_loop(engine, steps: int):
    from zdsl.runtime.data import make_batch
    s = engine.run.schedule
    losses = []
    for step in range(steps):
        for micro in range(s.train.accumulate):
            out = engine(make_batch(s.data, s.train.seed, step, micro, 0, 1, s.train.batch))
            engine.backward(out)
            engine.step()
        losses.append(engine.loss)
    return losses


@pytest.mark.parametrize("zero,acc", [(0, 2), (3, 1), (3, 2)])
def test_a_models_own_loss_trains_the_bits_of_zdsl_runs_loop(tmp_path, one_rank_group, zero, acc):
    zs = tmp_path / "gpt.zs"
    zs.write_text(GPT_ZS.format(zero=zero, acc=acc))
    ref_losses, ref_state = reference(zs)
    with zdsl.initialize(zs) as engine:
        losses = gpt_loop(engine, 3)
        mine = engine.state_dict()
    assert losses == ref_losses
    assert set(mine) == set(ref_state)
    assert all(torch.equal(mine[k], ref_state[k]) for k in ref_state)


def torch_loop(model, steps: int, batch: int, smoothing: float):
    from zdsl.runtime.state.optim import make_torch_optimizer
    opt = make_torch_optimizer(model.parameters(), {"kind": "adamw", "lr": 1e-2})
    losses = []
    for step in range(steps):
        x, y = batches(0, step, 0, 0, 1, batch)
        loss = F.cross_entropy(model(x), y, label_smoothing=smoothing)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def user_loop(engine, steps: int, batch: int, smoothing: float):
    losses = []
    for step in range(steps):
        x, y = batches(0, step, 0, 0, 1, batch)
        loss = F.cross_entropy(engine(x), y, label_smoothing=smoothing)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("zero", [0, 3])
def test_a_user_loss_on_a_given_model_trains_the_bits_of_plain_torch(tmp_path, one_rank_group, zero):
    ref_losses, ref_state = torch_loop(mlp(), 4, 4, 0.1)
    with zdsl.initialize(schedule(tmp_path, zero=zero), model=mlp()) as engine:
        losses = user_loop(engine, 4, 4, 0.1)
        mine = engine.state_dict()
    assert losses == ref_losses
    assert all(torch.equal(mine[k], ref_state[k]) for k in ref_state), "the weights differ"
    assert losses[-1] < losses[0]


def test_a_forward_only_call_leaves_training_as_it_was(tmp_path, one_rank_group):
    ref_losses, _ = torch_loop(mlp(), 3, 4, 0.0)
    with zdsl.initialize(schedule(tmp_path), model=mlp()) as engine:
        x, _ = batches(0, 0, 0, 0, 1, 4)
        with torch.no_grad():
            seen = engine(torch.cat([x, x]))            # any number of rows
        assert torch.equal(seen[:4], mlp()(x).detach()) and not seen.requires_grad
        engine.eval()
        assert torch.equal(engine(x), seen[:4])
        engine.train()
        assert user_loop(engine, 3, 4, 0.0) == ref_losses


def test_gathered_shows_full_parameters_then_frees_them(tmp_path, one_rank_group):
    model = mlp()
    with zdsl.initialize(schedule(tmp_path, zero=3), model=model) as engine:
        user_loop(engine, 1, 4, 0.0)
        want = engine.state_dict()
        assert model.fc1.weight.untyped_storage().nbytes() == 0     # stage 3: sharded between steps
        with engine.gathered():
            assert torch.equal(model.fc1.weight, want["fc1.weight"])
            assert torch.equal(model.fc2.bias, want["fc2.bias"])
        assert model.fc1.weight.untyped_storage().nbytes() == 0
        user_loop(engine, 1, 4, 0.0)        # the next step gathers as before


def test_a_checkpoint_round_trip_keeps_the_bits_and_the_client_state(tmp_path, one_rank_group):
    ref_losses, ref_state = torch_loop(mlp(), 4, 4, 0.0)
    with zdsl.initialize(schedule(tmp_path), model=mlp()) as engine:
        first = user_loop(engine, 2, 4, 0.0)
        where = engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 7})
    assert where.name == "step-000002" and (where / "index.json").exists()
    with zdsl.initialize(schedule(tmp_path), model=mlp(seed=5)) as engine:
        assert engine.load_checkpoint(tmp_path / "ckpt") == (str(where), {"epoch": 7})     # as DeepSpeed's
        assert engine.global_step == 2
        rest = []
        for step in (2, 3):
            x, y = batches(0, step, 0, 0, 1, 4)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            rest.append(float(loss.detach()))
        mine = engine.state_dict()
    assert first + rest == ref_losses
    assert all(torch.equal(mine[k], ref_state[k]) for k in ref_state)


def misuse(engine, what: str):
    x, y = batches(0, 0, 0, 0, 1, 4)
    if what == "step before backward":
        engine(x)
        engine.step()
    elif what == "backward twice":
        out = engine(x)
        engine.backward(F.cross_entropy(out, y))
        engine.backward(F.cross_entropy(out, y))
    elif what == "backward without forward":
        engine.backward(torch.zeros((), requires_grad=True))
    elif what == "loss not a scalar":
        engine.backward(F.cross_entropy(engine(x), y, reduction="none"))
    elif what == "loss not from the output":
        engine(x)
        engine.backward(F.cross_entropy(mlp()(x), y))
    elif what == "forward twice":
        engine(x)
        engine(x)
    elif what == "batch of another shape":
        engine(torch.randn(3, 12))
    elif what == "batch of another dtype":
        engine(torch.zeros(4, 12, dtype=torch.long))
    elif what == "no tensor":
        engine([1, 2, 3])


MISUSES = {
    "step before backward": r"engine\.step\(\) before engine\.backward\(loss\)",
    "backward twice": r"engine\.backward\(loss\) twice for one engine\(x\)",
    "backward without forward": r"engine\.backward\(loss\) without engine\(x\)",
    "loss not a scalar": r"engine\.backward\(loss\): the loss must be a scalar tensor, got a tensor of shape \(4,\)",
    "loss not from the output": r"engine\.backward\(loss\): the loss was not computed from the output of the "
                                r"last engine\(x\)",
    "forward twice": r"engine\(x\) again before engine\.backward\(loss\)",
    "batch of another shape": r"engine\(x\): a batch of inputs float32 \(3, 12\), but the schedule was compiled "
                              r"for inputs float32 \(4, 12\) \(train batch=4, each row as data python.*gives it\); "
                              r"feed batches of that shape, or change `train batch=`",
    "batch of another dtype": r"engine\(x\): a batch of inputs int64 \(4, 12\)",
    "no tensor": r"engine\(x\): takes a tensor, a pair \(inputs, labels\) of tensors or a Batch, not list",
}


TOOK_EFFECT = ("step before backward", "backward twice", "loss not a scalar", "loss not from the output",
               "forward twice")


@pytest.mark.parametrize("what", sorted(MISUSES))
def test_each_misuse_is_one_error_and_leaves_the_engine_as_it_was(tmp_path, one_rank_group, what):
    ref_losses, _ = torch_loop(mlp(), 2, 4, 0.0)
    with zdsl.initialize(schedule(tmp_path), model=mlp()) as engine:
        with pytest.raises(ZdslApiError, match=r"rank 0: " + MISUSES[what]):
            misuse(engine, what)
        steps = [0, 1]
        if what in TOOK_EFFECT:     # the calls before the misuse did: finish their step
            if what != "backward twice":
                engine.backward(F.cross_entropy(engine._output, batches(0, 0, 0, 0, 1, 4)[1]))
            engine.step()
            steps = [1]
        losses = [user_loop_at(engine, s) for s in steps]
    assert losses == ref_losses[-len(steps):]


def user_loop_at(engine, step: int) -> float:
    x, y = batches(0, step, 0, 0, 1, 4)
    loss = F.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def test_a_schedule_for_more_ranks_than_the_world_is_refused(tmp_path, one_rank_group):
    with pytest.raises(ZdslApiError, match=r"the schedule trains on 2 ranks \(`ranks 2`\) but this script runs as 1; "
                                           r"launch 2 ranks, or set `ranks 1`"):
        zdsl.initialize(schedule(tmp_path, ranks=2), model=mlp())


def test_step_is_a_no_op_before_the_accumulation_boundary(tmp_path, one_rank_group):
    with zdsl.initialize(schedule(tmp_path, accumulate=2), model=mlp()) as engine:
        assert not engine.is_boundary
        for micro in range(2):
            x, y = batches(0, 0, micro, 0, 1, 4)
            engine.backward(F.cross_entropy(engine(x), y))
            assert engine.is_boundary == (micro == 1)
            engine.step()
            assert engine.global_step == micro
        with pytest.raises(ZdslApiError, match="the engine is closed"):
            engine.close()
            engine(x)


def test_closing_in_the_middle_of_a_step_ends_it_and_a_new_engine_trains(tmp_path, one_rank_group):
    ref_losses, _ = torch_loop(mlp(), 1, 4, 0.0)
    engine = zdsl.initialize(schedule(tmp_path, zero=3), model=mlp())
    engine(batches(0, 0, 0, 0, 1, 4)[0])          # the step's backward waits at its gate
    engine.close()
    with zdsl.initialize(schedule(tmp_path, zero=3), model=mlp()) as engine:
        assert [user_loop_at(engine, 0)] == ref_losses
