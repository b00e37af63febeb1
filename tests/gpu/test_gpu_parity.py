"""zdsl on CUDA against torch DDP on CUDA (NCCL): stages 0-3 on one GPU and on two, and offload.

zdsl trains through its own launcher (``zdsl run``: a process per GPU, NCCL, a stream per lane,
pinned host buffers); DDP trains the same GPT, data and optimizer under torchrun. Not bitwise as
on the CPU (tests/parity/test_run_vs_ddp.py): cuBLAS, atomics in the embedding's backward and NCCL's
reduction order are free to differ. SGD's update is linear in the gradient, so its parameters
show only that rounding (1e-5 relative); AdamW's first steps are nearly sign(g) and amplify a
rounding in a near-zero gradient, so it gets the relative error of the whole update instead.
"""
from __future__ import annotations

import json

import pytest
import torch
from cuda_suite import ADAMW, GPUS, MODEL, SGD, torchrun, write_schedule

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# name: (stage, optimizer, offload statements)
CASES = {f"zero{stage}": (stage, SGD, "") for stage in range(4)} | {
    "zero3_adamw": (3, ADAMW, ""),
    "zero2_optimizer_cpu": (2, SGD, "offload optimizer -> cpu"),
    "zero3_optimizer_cpu_adamw": (3, ADAMW, "offload optimizer -> cpu(pinned=true)"),
    "zero3_parameters_cpu": (3, SGD, "offload parameters -> cpu\noffload optimizer -> cpu"),
    "zero3_optimizer_nvme": (3, SGD, 'offload optimizer -> nvme("{swap}", block=64KiB, depth=4)'),
    "zero3_parameters_and_optimizer_nvme": (3, SGD, 'offload parameters -> nvme("{swap}", block=64KiB, depth=4)\n'
                                                    'offload optimizer -> nvme("{swap}", block=64KiB, depth=4)'),
}


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_zdsl_on_cuda_matches_ddp(tmp_path, name, gpus):
    from safetensors.torch import load_file
    from test_run_cli import zdsl
    from test_run_vs_ddp import max_rel
    stage, optimizer, offload = CASES[name]
    schedule = write_schedule(tmp_path, ranks=gpus, stage=stage, optimizer=optimizer, offload=offload)
    metrics, export = tmp_path / "metrics.jsonl", tmp_path / "model.safetensors"
    proc, _ = zdsl("run", str(schedule), "--metrics", str(metrics), "--export", str(export))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    reference = torchrun(gpus, "ddp", schedule, tmp_path / "ddp")
    ref = reference[0]["params"]
    ref_losses = [sum(r["losses"][s] for r in reference) / gpus for s in range(len(losses))]   # zdsl's: the ranks' mean
    mine = load_file(str(export))
    assert set(ref) <= set(mine)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses[-1] < losses[0], "the loss must fall"
    if optimizer == SGD:
        assert max_rel(mine, ref) <= 1e-5
    else:
        from zdsl.runtime.models.gpt import GPT
        init = {n: p.detach() for n, p in GPT(**MODEL, seed=0).named_parameters()}
        dz = torch.cat([(mine[k] - init[k]).flatten() for k in init])
        dr = torch.cat([(ref[k] - init[k]).flatten() for k in init])
        assert float((dz - dr).norm() / dr.norm()) < 1e-3
