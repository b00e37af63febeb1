"""Offloaded state on CUDA lives in pinned host memory: every host buffer the rank state gives
memory (the offloaded optimizer's shards, the gradients copied down, the parameters copied up),
and the NVMe swapper's staging buffers, so host<->device copies run asynchronously at full rate;
``pinned=false`` on a placement keeps that placement's buffers pageable."""
from __future__ import annotations

import pytest
from cuda_suite import ADAMW, GPUS, torchrun, write_schedule

pytestmark = pytest.mark.gpu

OFFLOADS = {
    "optimizer_cpu": "offload optimizer -> cpu",
    "parameters_and_optimizer_cpu": "offload parameters -> cpu\noffload optimizer -> cpu",
    "optimizer_nvme": 'offload optimizer -> nvme("{swap}", block=64KiB, depth=4)',
    "parameters_and_optimizer_nvme": 'offload parameters -> nvme("{swap}", block=64KiB, depth=4)\n'
                                     'offload optimizer -> nvme("{swap}", block=64KiB, depth=4)',
}


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("name", sorted(OFFLOADS))
def test_offloaded_host_buffers_are_pinned(tmp_path, name, gpus):
    schedule = write_schedule(tmp_path, ranks=gpus, stage=3, optimizer=ADAMW, offload=OFFLOADS[name])
    for rank, result in enumerate(torchrun(gpus, "pinned", schedule, tmp_path / "probe")):
        assert result["host"], f"rank {rank}: no host buffer was allocated: nothing offloaded?"
        unpinned = sorted(n for n, pinned in result["host"].items() if not pinned)
        assert not unpinned, f"rank {rank}: host buffers not pinned: {unpinned}"
        if "nvme" in name:
            assert result["pool"] is True, f"rank {rank}: the swapper's staging buffers are not pinned"
        assert all(loss == loss for loss in result["losses"])          # trained: no NaN


UNPINNED = {
    "optimizer_cpu": ("offload optimizer -> cpu(pinned=false)", set()),
    "parameters_cpu_unpinned": ("offload parameters -> cpu(pinned=false)\noffload optimizer -> cpu",
                                {"optim", "grad_shard"}),
    "optimizer_nvme": ('offload optimizer -> nvme("{swap}", block=64KiB, depth=4, pinned=false)', set()),
}


@pytest.mark.parametrize("name", sorted(UNPINNED))
def test_pinned_false_keeps_its_placements_host_buffers_pageable(tmp_path, name):
    from zdsl.ir import parse_buffer_name
    offload, pinned_kinds = UNPINNED[name]
    schedule = write_schedule(tmp_path, ranks=1, stage=3, optimizer=ADAMW, offload=offload)
    result = torchrun(1, "pinned", schedule, tmp_path / "probe")[0]
    assert result["host"], "no host buffer was allocated: nothing offloaded?"
    wrong = sorted(n for n, pinned in result["host"].items() if pinned != (parse_buffer_name(n)[0] in pinned_kinds))
    assert not wrong, f"host buffers pinned against their placement: {wrong}"
    if "nvme" in name:
        assert result["pool"] is False, "the swapper's staging buffers are pinned despite pinned=false"
    assert all(loss == loss for loss in result["losses"])
