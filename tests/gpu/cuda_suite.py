"""What the GPU tests share: the schedule they train, and the two ways of running it (zdsl's own
launcher, and torchrun for the DDP reference and the probes in ``cuda_worker.py``)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda"
WORKER = Path(__file__).resolve().parent / "cuda_worker.py"
MODEL = dict(layers=2, width=64, heads=4, vocab=256, context=32)
SGD = "sgd(lr=0.05, momentum=0.9)"
ADAMW = "adamw(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)"

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL between them)")
GPUS = [1, pytest.param(2, marks=two_gpus)]

SCHEDULE = """schedule gpu_suite "zdsl on CUDA against DDP"
model     gpt({model})
data      synthetic(vocab={vocab}, context={context})
train     steps={steps}, batch=4, precision={precision}, seed=0
optimizer {optimizer}
ranks     {ranks} on {device}
zero      {stage}
{offload}
"""


def write_schedule(folder: Path, *, ranks: int, stage: int, optimizer: str = SGD, offload: str = "",
                   steps: int = 5, precision: str = "fp32") -> Path:
    """A schedule of the suite's GPT in ``folder``; ``{swap}`` in ``offload`` is a swap folder there."""
    path = folder / f"zero{stage}.zs"
    path.write_text(SCHEDULE.format(model=", ".join(f"{k}={v}" for k, v in MODEL.items()), vocab=MODEL["vocab"],
                                    context=MODEL["context"], steps=steps, precision=precision,
                                    optimizer=optimizer, ranks=ranks,
                                    device=DEVICE, stage=stage, offload=offload.format(swap=folder / "swap")))
    return path


def torchrun(ranks: int, mode: str, schedule: Path, out: Path, *sets: str, timeout: float = 600) -> list[dict]:
    """``cuda_worker.py MODE SCHEDULE OUT [KEY=VALUE ...]`` on ``ranks`` processes (torchrun: one
    per GPU; the pairs are ``--set`` overrides); each rank's result, by rank."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={ranks}", str(WORKER), mode, str(schedule), str(out), *sets],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(f"{out}.rank{r}.pt", map_location="cpu", weights_only=False) for r in range(ranks)]
