"""zdsl's ZeRO-N schedule trained through the Python API in a user's loop, under torchrun.

The same schedule ``zdsl_peer`` gives ``zdsl run`` (``schedule_text``, ``zero`` set as
``--set zero=N`` sets it), opened with ``zdsl.initialize`` and fed the same batches by the
harness's loop (``run_peer``): per step ``engine((tokens, targets))`` (the GPT's last unit scores
the targets, so its output is the loss ``zdsl run`` trains), ``engine.backward``, ``engine.step``.
A step's time is the harness's: from the barrier before ``engine(x)`` to ``engine.step()``'s
return, the slowest rank's counted (as ``zdsl run --metrics`` counts a step as its slowest rank's).
"""
from __future__ import annotations

from benchmarks.peers import BenchConfig, run_peer
from benchmarks.peers.zdsl_peer import schedule_text


def setup(cfg: BenchConfig, rank: int, world: int):
    import os
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    import zdsl
    stage = int(cfg.extra.get("stage", 3))
    # one file for every rank: the graph digest the ranks agree on includes the schedule's path
    path = Path(tempfile.gettempdir()) / f"zdsl_api_peer-{os.getppid()}.zs"    # torchrun's agent: one job
    if rank == 0:
        path.write_text(schedule_text(cfg, stage=3))
    dist.barrier()
    engine = zdsl.initialize(str(path), overrides={"zero": str(stage)})
    dist.barrier()
    if rank == 0:
        path.unlink()

    def step(tokens, targets):
        loss = engine((tokens, targets))
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, {"wrapper": f"zdsl.initialize(zero={stage}) in a user loop", "optimizer": "zdsl AdamW (sharded)"}


if __name__ == "__main__":
    run_peer("zdsl-api", setup)
