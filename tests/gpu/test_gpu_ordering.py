"""CUDA-path defects, each checked on a GPU (none of these has run in this project's CI:
no GPU is lent to it).

* a clipped step whose gradients are on the host (offloaded optimizer, NVMe) reads a host copy of
  the coefficient the device computed (a CPU gradient times a 0-dim CUDA tensor crashes at
  step 1);
* ZeRO-1's gradient shard, allocated on the comm stream by the reduce-scatter and freed on the
  compute stream after the step, is not reused by the next reduce-scatter while the step reads it
  (the free records the compute stream on it: zero1 cases against DDP);
* fused AdamW on the device gets a device ``step`` tensor (a unit optimizer built as the runtime
  builds it: the schedule language has no ``fused`` setting);
* an untraced step (``record=False``) ends waiting for the device, as a traced one does;
* ``zdsl calibrate`` on NCCL at two ranks gathers CUDA tensors.
"""
from __future__ import annotations

import json

import pytest
from cuda_suite import GPUS, torchrun, two_gpus, write_schedule

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CLIPPED = "adamw(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, clip=0.5)"
CASES = {
    "zero3_optimizer_cpu_clip": (3, CLIPPED, "offload optimizer -> cpu"),
    "zero2_optimizer_cpu_clip": (2, CLIPPED, "offload optimizer -> cpu"),
    "zero3_optimizer_nvme_clip": (3, CLIPPED, 'offload optimizer -> nvme("{swap}", block=64KiB, depth=4)'),
    "zero1_clip": (1, CLIPPED, ""),
}


def _run(tmp_path, stage, optimizer, offload, gpus):
    from test_run_cli import zdsl
    schedule = write_schedule(tmp_path, ranks=gpus, stage=stage, optimizer=optimizer, offload=offload)
    metrics = tmp_path / "metrics.jsonl"
    proc, _ = zdsl("run", str(schedule), "--metrics", str(metrics), timeout=1200)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return schedule, [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_clipped_offloaded_and_zero1_steps_train_as_ddp(tmp_path, name, gpus):
    schedule, losses = _run(tmp_path, *CASES[name], gpus)
    reference = torchrun(gpus, "ddp", schedule, tmp_path / "ddp")
    ref_losses = [sum(r["losses"][s] for r in reference) / gpus for s in range(len(losses))]
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert losses[-1] < losses[0], "the loss must fall"


def test_fused_device_adamw_steps_with_a_device_step_count():
    import torch
    from zdsl.runtime.state.optim import UnitOptimizer
    config = {"kind": "adamw", "lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "fused": True}
    opt = UnitOptimizer(config, [(0, 8), (8, 20)], master=False)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(8, generator=gen).cuda(), torch.randn(12, generator=gen).cuda()]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    flat = torch.zeros(opt.flat_numel, device="cuda")
    for _ in range(3):
        grads = [torch.randn(p.numel(), generator=gen).cuda() for p in params]
        opt.step(flat, params, grads)
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        torch_opt.step()
    assert all(opt.opt.state[p]["step"].device.type == "cuda" for p in opt.params)
    assert opt.steps == 3
    for p, r in zip(params, ref):
        assert torch.equal(p, r.detach())


def _losses_on_lane_streams(traced: bool) -> list[float]:
    import torch
    import torch.distributed as dist
    import trio
    from zdsl.driver import compile_schedule
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.exec.executor import Executor
    from zdsl.runtime.exec.streams import lane_streams
    from zdsl.runtime.models.batch import Batch
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.sizing import units_for_user_model
    from zdsl.runtime.state.rank import RankState
    from zdsl.schedule import DataSpec, ModelSpec, OptimizerSpec, Schedule, TrainSpec
    spec = ModelSpec("gpt", dict(layers=2, width=64, heads=4, vocab=256, context=32))
    sched = Schedule(name="untraced", model=spec, data=DataSpec("synthetic", None, {"vocab": 256, "context": 32}),
                     train=TrainSpec(steps=3, batch=4, accumulate=2, precision="fp32", seed=0),
                     optimizer=OptimizerSpec(kind="sgd", lr=0.05, clip=0.5), ranks=1, stage=0)
    graph = compile_schedule(sched, units_for_user_model(spec, 32))
    device = torch.device("cuda", 0)
    state = RankState(graph, build_model(spec, seed=0), 0, 1, device=device)
    executor = Executor(graph, state, 0, record=traced, streams=lane_streams(graph, device))
    losses = []
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        for step in range(3):
            state.step_begin(step, [Batch.of(*make_batch(sched.data, 0, step, m, 0, 1, 4)) for m in range(2)])
            trio.run(executor.run_step)
            losses.append(state.step_end()["loss"])
    finally:
        dist.destroy_process_group()
    return losses


def test_an_untraced_step_reads_complete_losses():
    """Without tracing the step still ends waiting for the device (the losses stacked after it are
    the compute stream's final ones), and the lanes wait for the default stream's zeroing and copies."""
    assert _losses_on_lane_streams(traced=False) == _losses_on_lane_streams(traced=True)


@two_gpus
def test_calibrate_on_nccl_at_two_ranks(tmp_path):
    from test_run_cli import zdsl
    out = tmp_path / "machine.json"
    proc, _ = zdsl("calibrate", "--quick", "--ranks", "2", "--backend", "nccl", "--out", str(out), timeout=1200)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and out.exists()
