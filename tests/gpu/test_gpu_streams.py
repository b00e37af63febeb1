"""The lanes' streams on CUDA: the order the events leave open must not matter (none of these has
run in this project's CI: no GPU is lent to it).

* every program at two ranks (NCCL, 3 steps) equals the same run with every device lane on one
  stream (``ZDSL_ONE_STREAM=1``), bit for bit, and DDP where the program is the built-in GPT in
  fp32 with a constant rate (what tests/ddp_reference.py trains);
* random ``torch.cuda._sleep`` delays on one lane (20 seeds) change no bit;
* freed buffers filled with NaN on their allocating stream change no bit;
* one step of every program under ``TORCH_CUDA_SANITIZER=1`` reports no race;
* no kernel, copy or memset runs on the default stream during a step;
* rank 1 creates no CUDA context on GPU 0.
"""
from __future__ import annotations

import json

import pytest
from cuda_suite import GPUS, SGD, torchrun, two_gpus, write_schedule
from test_gpu_programs import PROGRAMS, SMALLER, swap_here

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CLIPPED = "adamw(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, clip=0.5)"
# schedules that use every lane: gathers and reductions, copies up and down, the host step, NVMe
BUSY = {
    "zero1_clip": (1, CLIPPED, ""),
    "zero3_optimizer_cpu_clip": (3, CLIPPED, "offload optimizer -> cpu"),
    "zero3_nvme": (3, SGD, 'offload parameters -> nvme("{swap}", block=64KiB, depth=4)\n'
                           'offload optimizer -> nvme("{swap}", block=64KiB, depth=4)'),
}


def _run(program, folder, *sets, env=None):
    """``zdsl run PROGRAM`` on CUDA; (losses, exported parameters)."""
    from safetensors.torch import load_file
    from test_run_cli import zdsl
    folder.mkdir(parents=True, exist_ok=True)
    metrics, export = folder / "metrics.jsonl", folder / "model.safetensors"
    proc, _ = zdsl("run", str(program), "--set", "device=cuda", *sets, "--metrics", str(metrics),
                   "--export", str(export), env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], load_file(str(export))


def _ddp_comparable(program) -> bool:
    """The program is what the DDP reference trains: the built-in GPT, fp32, no rate schedule, no freeze."""
    from zdsl.driver import compile_file
    schedule = compile_file(str(program), {}, simulate=False).schedule
    optimizer = schedule.optimizer.to_config()
    return schedule.model.kind == "gpt" and schedule.train.precision == "fp32" and not schedule.freeze \
        and not any(k in optimizer for k in ("warmup", "decay", "decay_steps", "min_lr"))


@two_gpus
@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.stem)
def test_every_program_at_two_ranks_equals_its_run_on_one_stream(tmp_path, program):
    import torch
    sets = ("--set", "ranks=2", "--set", "steps=3", *SMALLER.get(program.stem, []),
            *swap_here(program, tmp_path / "swap"))
    losses, params = _run(program, tmp_path / "lanes", *sets)
    one_losses, one_params = _run(program, tmp_path / "one", *sets, env={"ZDSL_ONE_STREAM": "1"})
    assert losses == one_losses
    assert params.keys() == one_params.keys() and all(torch.equal(params[k], one_params[k]) for k in params)
    if _ddp_comparable(program):
        overrides = [s for s in sets if s != "--set"] + ["device=cuda"]
        reference = torchrun(2, "ddp", program, tmp_path / "ddp", *overrides)
        assert losses == pytest.approx([sum(r["losses"][s] for r in reference) / 2 for s in range(3)], rel=1e-4)


def _busy_schedule(tmp_path, name, gpus):
    stage, optimizer, offload = BUSY[name]
    return write_schedule(tmp_path, ranks=gpus, stage=stage, optimizer=optimizer, offload=offload, steps=3)


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("name", sorted(BUSY))
def test_random_delays_on_one_lane_change_no_bit(tmp_path, name, gpus):
    for rank, result in enumerate(torchrun(gpus, "sleep", _busy_schedule(tmp_path, name, gpus), tmp_path / "sleep",
                                           timeout=3600)):
        assert not result["moved"], f"rank {rank}: delays on these lanes changed the results (seed: lane): " \
                                    f"{result['moved']}"


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("name", sorted(BUSY))
def test_buffers_poisoned_when_freed_change_no_bit(tmp_path, name, gpus):
    for rank, result in enumerate(torchrun(gpus, "poison", _busy_schedule(tmp_path, name, gpus), tmp_path / "nan")):
        assert result["poisoned"] > 0, f"rank {rank}: no device buffer was freed: nothing was checked"
        assert result["same"], f"rank {rank}: a freed buffer was still read: {result['losses']} " \
                               f"against {result['base']}"


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.stem)
def test_one_step_of_every_program_under_the_cuda_sanitizer(tmp_path, program):
    from test_run_cli import zdsl
    proc, _ = zdsl("run", str(program), "--set", "ranks=1", "--set", "device=cuda", "--set", "steps=1",
                   *SMALLER.get(program.stem, []), *swap_here(program, tmp_path / "swap"),
                   env={"TORCH_CUDA_SANITIZER": "1"}, timeout=3600)
    assert "CSAN detected" not in proc.stderr and "data race" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("name", sorted(BUSY))
def test_no_work_on_the_default_stream_during_a_step(tmp_path, name, gpus):
    for rank, result in enumerate(torchrun(gpus, "streams", _busy_schedule(tmp_path, name, gpus), tmp_path / "prof")):
        work = result["work"]
        assert work and "spin_kernel" in work[0][0], f"rank {rank}: the default stream's marker came first: {work[:3]}"
        default = work[0][1]
        on_default = [w for w in work[1:] if w[1] == default]
        assert len(work) > 1 and not on_default, f"rank {rank}: on the default stream during the step: {on_default}"


@two_gpus
def test_rank_1_creates_no_context_on_gpu_0(tmp_path):
    schedule = _busy_schedule(tmp_path, "zero3_optimizer_cpu_clip", 2)
    results = torchrun(2, "contexts", schedule, tmp_path / "ctx")
    if any(r["contexts"] is None for r in results):
        pytest.skip("this torch build has no torch._C._cuda_hasPrimaryContext to ask")
    for rank, result in enumerate(results):
        assert result["device"] == rank and result["contexts"] == [rank], \
            f"rank {rank} holds CUDA contexts on GPUs {result['contexts']}"
