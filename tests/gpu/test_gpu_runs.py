"""Whole runs on CUDA held against each other and against the plan (none of these has run in this
project's CI: no GPU is lent to it).

* the allocator's peaks (``device_allocated``, ``device_reserved`` in the metrics) against the
  plan's device bytes, and no growth over 5 steps;
* fused and foreach device AdamW in fp32, bf16 and fp16;
* offloaded and NVMe optimizers with clipping in fp16;
* a resumed run and an untraced one equal the uninterrupted traced run, bit for bit.
"""
from __future__ import annotations

import json
import math

import pytest
from cuda_suite import ADAMW, GPUS, SGD, write_schedule

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MiB = 1 << 20
CLIPPED = "adamw(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, clip=0.5)"


def _zdsl_run(schedule, *args, env=None):
    from test_run_cli import zdsl
    proc, _ = zdsl("run", str(schedule), *map(str, args), env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("offload", ["", "offload optimizer -> cpu"])
def test_the_allocators_peaks_against_the_plan_and_no_growth(tmp_path, gpus, offload):
    """The logical device peak is within the plan (its model states plus the worst order's working
    bytes); the allocator holds at least that, reserves at least what it allocates, and reserves no
    more than twice the plan plus a fixed 256 MiB (cuBLAS workspaces, 2 MiB blocks for small
    tensors, a pool per stream); after the first step the peaks do not grow."""
    from zdsl.driver import compile_file
    from zdsl.planner.bound import worst_working
    from zdsl.sim.simulate import simulate
    schedule = write_schedule(tmp_path, ranks=gpus, stage=3, optimizer=ADAMW, offload=offload, steps=5)
    graph = compile_file(str(schedule), {}, simulate=False).graph
    planned = simulate(graph).memory.tiers["device"].model_states + worst_working(graph).get("device", 0)
    metrics = tmp_path / "metrics.jsonl"
    _zdsl_run(schedule, "--metrics", metrics)
    rows = _rows(metrics)
    assert len(rows) == 5
    for rank in map(str, range(gpus)):
        peaks = [row["peak_bytes"][rank] for row in rows]
        last = peaks[-1]
        assert 0 < last["device"] <= planned
        assert last["device"] <= last["device_allocated"] <= last["device_reserved"] <= 2 * planned + 256 * MiB, last
        for key in ("device", "device_allocated", "device_reserved"):
            assert [p[key] for p in peaks[1:]] == [peaks[1][key]] * 4, f"rank {rank}: {key} grows: {peaks}"


def _train_in_process(schedule, optimizer_settings: dict) -> dict:
    """zdsl's rank state on GPU 0 in this process, the optimizer's settings amended (the schedule
    language has no ``fused``/``foreach``: they are torch's implementation choices)."""
    import torch
    import torch.distributed as dist
    from cuda_worker import train
    from zdsl.driver import compile_file
    compiled = compile_file(str(schedule), {}, simulate=False)
    compiled.graph.config["optimizer"].update(optimizer_settings)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        return train(compiled, 0, 1, device)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision,rel", [("fp32", 1e-4), ("bf16", 3e-2), ("fp16", 1e-2)])
def test_fused_and_foreach_device_adamw_in_every_precision(tmp_path, precision, rel):
    schedule = write_schedule(tmp_path, ranks=1, stage=2, optimizer=ADAMW, precision=precision, steps=4)
    fused = _train_in_process(schedule, {"fused": True})
    foreach = _train_in_process(schedule, {"foreach": True})
    for run in (fused, foreach):
        assert all(math.isfinite(loss) for loss in run["losses"]) and run["losses"][-1] < run["losses"][0]
    # two implementations of the same update: a few ulps apart per step, in the compute precision
    assert fused["losses"] == pytest.approx(foreach["losses"], rel=rel)


@pytest.mark.parametrize("gpus", GPUS)
def test_offloaded_and_nvme_optimizers_with_clipping_in_fp16(tmp_path, gpus):
    """The host step is the same whether its state lives in host memory or on NVMe: bit for bit;
    against the device's own step, the same training within fp16's rounding."""
    import torch
    from safetensors.torch import load_file
    runs = {}
    for name, offload in [("device", ""), ("cpu", "offload optimizer -> cpu"),
                          ("nvme", 'offload optimizer -> nvme("{swap}", block=64KiB, depth=4)')]:
        folder = tmp_path / name
        folder.mkdir()
        schedule = write_schedule(folder, ranks=gpus, stage=3, optimizer=CLIPPED, offload=offload,
                                  precision="fp16", steps=4)
        metrics, export = folder / "metrics.jsonl", folder / "model.safetensors"
        _zdsl_run(schedule, "--metrics", metrics, "--export", export)
        rows = _rows(metrics)
        runs[name] = ([r["loss"] for r in rows], load_file(str(export)))
        assert all(math.isfinite(loss) for loss in runs[name][0]) and runs[name][0][-1] < runs[name][0][0], name
    assert runs["cpu"][0] == runs["nvme"][0]
    assert all(torch.equal(runs["cpu"][1][k], runs["nvme"][1][k]) for k in runs["cpu"][1])
    assert runs["cpu"][0] == pytest.approx(runs["device"][0], rel=1e-2)


@pytest.mark.parametrize("gpus", GPUS)
def test_resumed_and_untraced_runs_equal_the_uninterrupted_traced_one(tmp_path, gpus):
    import torch
    from safetensors.torch import load_file
    schedule = write_schedule(tmp_path, ranks=gpus, stage=3, optimizer=SGD, offload="offload optimizer -> cpu",
                              steps=4)
    full, untraced, resumed, ck = (tmp_path / "full.safetensors", tmp_path / "untraced.safetensors",
                                   tmp_path / "resumed.safetensors", tmp_path / "ck")
    _zdsl_run(schedule, "--trace", tmp_path / "trace.json", "--export", full)
    _zdsl_run(schedule, "--export", untraced)
    _zdsl_run(schedule, "--set", "steps=2", "--checkpoint-every", "2", "--checkpoint-dir", ck)
    proc = _zdsl_run(schedule, "--resume", ck, "--export", resumed)
    assert "resumed at step 2" in proc.stdout
    expected = load_file(str(full))
    for path in (untraced, resumed):
        got = load_file(str(path))
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), path
