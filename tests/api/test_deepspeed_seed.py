"""programs/deepspeed_seed.py, the seeds' DeepSpeed example ported, run as its users run it.

Guards: under torchrun at 2 ranks (ZeRO-3, parameters and optimizer on NVMe, a model object split
into units, the user's CrossEntropyLoss) it learns, each rank's losses are DDP's with the same
model, init, data and Adam, bit for bit, and its saved state dict loads into the user's model.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_reference import spawn

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

PROGRAM = Path(__file__).resolve().parents[2] / "programs" / "deepspeed_seed.py"


def seed_program():
    spec = importlib.util.spec_from_file_location("deepspeed_seed", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ddp_losses(rank: int, world: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    seed = seed_program()
    torch.manual_seed(0)
    model = DDP(seed.SimpleModel(seed.input_size, seed.hidden_size, seed.output_size))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data, labels = seed.batches(seed=0, step=0, micro=0, rank=rank, world=world, batch=32)
    losses = []
    for _ in range(10):
        loss = torch.nn.CrossEntropyLoss()(model(data), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_the_seed_example_learns_under_torchrun_and_equals_ddp(tmp_path):
    from zdsl.runtime.dist.spawn import free_port
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(PROGRAM)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {0: {}, 1: {}}
    # the ranks share one pipe: another rank's print may come between a line and its newline
    for rank, i, loss in re.findall(r"rank (\d) iteration (\d+): loss = ([0-9.e+-]+)", proc.stdout):
        losses[int(rank)][int(i)] = float(loss)
    mine = [[losses[r][i] for i in range(10)] for r in range(2)]
    assert mine == spawn(ddp_losses, 2)
    assert all(row[-1] < row[0] / 10 for row in mine), mine
    seed = seed_program()
    seed.SimpleModel(seed.input_size, seed.hidden_size, seed.output_size).load_state_dict(
        torch.load(tmp_path / "simple_model.pth"))
