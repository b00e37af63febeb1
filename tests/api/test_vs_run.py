"""Two ranks: the API loop against `zdsl run` and against DDP.

Guards: the API loop with the model's own loss reproduces `zdsl run` of the same schedule bit for
bit (each step's loss, the final weights) at stages 0-3, accumulating, with host and NVMe offload,
bf16, fp16 (its loss scale), clipping and a warmup-cosine learning rate; a checkpoint the API
saves at 2 ranks is one `zdsl run --resume` continues at 1 rank, and the API continuing it at 1
rank trains the same bits; a user's label-smoothed cross-entropy on a given model trains DDP's
bits with the same loss, init and data.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from api_models import batches, mlp, schedule
from ddp_reference import spawn
from helpers import zdsl

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

GPT_ZS = """\
schedule parity "the built-in GPT, its own loss"
model     gpt(layers=2, width=32, heads=4, vocab=64, context=8)
data      synthetic(vocab=64, context=8)
train     steps={steps}, batch=2, accumulate={acc}, precision={precision}
optimizer adamw(lr=1e-2{clip})
ranks     2 on cpu
zero      {zero}
{offload}
"""
NVME = 'offload parameters -> nvme("{folder}", block=64KiB)\noffload optimizer -> nvme("{folder}", block=64KiB)'
HOST = "offload parameters -> cpu\noffload optimizer -> cpu"
# name: (zero, accumulate, precision, clip, offload)
CASES = {
    "zero0_accumulate_lr_schedule": (0, 2, "fp32", None, ""),
    "zero3_fp16": (3, 1, "fp16", None, ""),
    "zero1_clip": (1, 1, "fp32", 0.05, ""),
    "zero2_bf16": (2, 1, "bf16", None, ""),
    "zero3_host_offload_clip": (3, 1, "fp32", 0.05, HOST),
    "zero3_nvme_accumulate": (3, 2, "fp32", None, NVME),
}


def write_case(folder, name: str, steps: int = 3):
    zero, acc, precision, clip, offload = CASES[name]
    path = folder / f"{name}.zs"
    schedule_lr = ", warmup=1, decay=cosine, min_lr=1e-3" if "lr_schedule" in name else ""
    path.write_text(GPT_ZS.format(steps=steps, acc=acc, precision=precision, zero=zero,
                                  clip=(f", clip={clip}" if clip else "") + schedule_lr,
                                  offload=offload.format(folder=folder / f"nvme_{name}")))
    return path


def api_gpt(rank: int, world: int, paths: dict, save: str | None = None) -> dict:
    """Each schedule of ``paths`` through the API with the GPT's own loss: per step this rank's loss,
    and the final state dict (rank 0)."""
    import zdsl
    from zdsl.runtime.data import make_batch
    out = {}
    for name, path in paths.items():
        with zdsl.initialize(path) as engine:
            s = engine.run.schedule
            losses = []
            for step in range(2 if save else s.train.steps):
                for micro in range(s.train.accumulate):
                    loss = engine(make_batch(s.data, s.train.seed, step, micro, rank, world, s.train.batch))
                    engine.backward(loss)
                    engine.step()
                losses.append(engine.loss)
            if save:
                engine.save_checkpoint(save)
            out[name] = (losses, engine.state_dict())
    return out


def zdsl_run(path, tmp_path, *args):
    metrics, weights = tmp_path / f"{path.stem}.jsonl", tmp_path / f"{path.stem}.safetensors"
    proc = zdsl("run", str(path), "--metrics", str(metrics), "--export", str(weights), "--quiet", *args)
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], load_file(str(weights))


@pytest.fixture(scope="module")
def api_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("api")
    paths = {name: write_case(folder, name) for name in CASES}
    return folder, paths, spawn(api_gpt, 2, paths)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_api_loop_is_zdsl_run_bit_for_bit(api_runs, tmp_path, name):
    folder, paths, by_rank = api_runs
    ref_losses, ref_weights = zdsl_run(paths[name], tmp_path)
    losses = [sum(step) / 2 for step in zip(*(by_rank[r][name][0] for r in range(2)))]   # as zdsl run averages
    weights = by_rank[0][name][1]
    assert losses == ref_losses
    assert set(weights) == set(ref_weights)
    assert [k for k in ref_weights if not torch.equal(weights[k], ref_weights[k])] == []
    assert by_rank[1][name][1] == {}        # the state dict is rank 0's


def api_resume(rank: int, world: int, path, ckpt, overrides: dict) -> tuple[list, dict]:
    import zdsl
    from zdsl.runtime.data import make_batch
    with zdsl.initialize(path, overrides=overrides) as engine:
        engine.load_checkpoint(ckpt)
        s = engine.run.schedule
        losses = []
        for step in range(engine.global_step, s.train.steps):
            for micro in range(s.train.accumulate):
                loss = engine(make_batch(s.data, s.train.seed, step, micro, rank, world, s.train.batch))
                engine.backward(loss)
                engine.step()
            losses.append(engine.loss)
        return losses, engine.state_dict()


def test_an_api_checkpoint_resumes_at_another_rank_count_as_zdsl_run_resumes_it(tmp_path):
    path = tmp_path / "resume.zs"
    path.write_text(GPT_ZS.format(steps=4, acc=1, precision="fp32", zero=3, clip="", offload=""))
    ckpt = tmp_path / "ckpt"
    spawn(api_gpt, 2, {"resume": path}, str(ckpt))
    one_rank = {"ranks": "1", "accumulate": "2"}       # the same global batch on one rank
    ref_losses, ref_weights = zdsl_run(path, tmp_path, "--resume", str(ckpt),
                                       *[f"--set={k}={v}" for k, v in one_rank.items()])
    [(losses, weights)] = spawn(api_resume, 1, path, str(ckpt), one_rank)
    assert losses == ref_losses and len(losses) == 2
    assert [k for k in ref_weights if not torch.equal(weights[k], ref_weights[k])] == []


def api_and_ddp(rank: int, world: int, folder, zero: int, smoothing: float) -> tuple:
    """A given Mlp with a label-smoothed cross-entropy through the API, then through DDP."""
    import zdsl
    from torch.nn.parallel import DistributedDataParallel as DDP
    from zdsl.runtime.state.optim import make_torch_optimizer
    mine = []
    with zdsl.initialize(schedule(folder, ranks=2, zero=zero), model=mlp()) as engine:
        for step in range(4):
            x, y = batches(0, step, 0, rank, world, 4)
            loss = F.cross_entropy(engine(x), y, label_smoothing=smoothing)
            engine.backward(loss)
            engine.step()
            mine.append(float(loss.detach()))
        weights = engine.state_dict()
    model = mlp()
    ddp, ref = DDP(model), []
    opt = make_torch_optimizer(model.parameters(), {"kind": "adamw", "lr": 1e-2})
    for step in range(4):
        x, y = batches(0, step, 0, rank, world, 4)
        loss = F.cross_entropy(ddp(x), y, label_smoothing=smoothing)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(float(loss.detach()))
    return mine, ref, weights, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("zero", [1, 3])
def test_a_user_loss_on_a_given_model_equals_ddp(tmp_path, zero):
    for rank, (mine, ref, weights, ref_weights) in enumerate(spawn(api_and_ddp, 2, tmp_path, zero, 0.1)):
        assert mine == ref, f"rank {rank}"
        if rank == 0:
            assert [k for k in ref_weights if not torch.equal(weights[k], ref_weights[k])] == []
    assert mine[-1] < mine[0]
