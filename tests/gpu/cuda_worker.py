"""One rank of a GPU test, started by torchrun: ``cuda_worker.py MODE SCHEDULE OUT``.

``ddp``: torch DDP (NCCL) trains the schedule's model on this rank's GPU with the schedule's
data, optimizer and steps (``tests/ddp_reference.ddp_train``); ``pinned``: zdsl's own rank state
and executor run the schedule for two steps, recording whether each host buffer it allocated
is pinned. Each rank writes its result to ``OUT.rank<r>.pt``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # tests/: ddp_reference

import torch  # noqa: E402

from zdsl.driver import compile_file  # noqa: E402
from zdsl.runtime.data import make_batch  # noqa: E402
from zdsl.runtime.models.batch import Batch  # noqa: E402
from zdsl.runtime.dist.group import init_group  # noqa: E402
from zdsl.runtime.run.train import env_rank, pick_device  # noqa: E402


def ddp(compiled, rank: int, world: int, device) -> dict:
    from ddp_reference import ddp_train
    from zdsl.runtime.models.gpt import GPT
    schedule, t = compiled.schedule, compiled.schedule.train
    kw = dict(schedule.model.args)

    def build():
        model = GPT(**kw, seed=t.seed).to(device)
        # make_batch gives CPU tensors and DDP without device_ids does not move them
        model.register_forward_pre_hook(lambda module, args: tuple(a.to(device) for a in args))
        return model
    params, losses = ddp_train(kw, schedule.data, seed=t.seed, steps=t.steps, batch=t.batch,
                               accumulate=t.accumulate, optimizer=schedule.to_config()["optimizer"],
                               rank=rank, world=world, build=build)
    return {"params": {k: v.cpu() for k, v in params.items()}, "losses": losses}


def pinned(compiled, rank: int, world: int, device) -> dict:
    import trio

    from zdsl.runtime.exec.executor import Executor
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.buffers import BufferTable
    from zdsl.runtime.state.rank import RankState
    from zdsl.runtime.exec.streams import lane_streams
    graph, schedule, t = compiled.graph, compiled.schedule, compiled.schedule.train
    host: dict[str, bool] = {}
    alloc = BufferTable.alloc

    def recording(table, slot):          # every buffer the run gives memory, from start-up on
        tensor = alloc(table, slot)
        if tensor.device.type == "cpu":
            host[slot.buf.name] = tensor.is_pinned()
        return tensor
    BufferTable.alloc = recording        # this process is the probe's own
    state = RankState(graph, build_model(schedule.model, seed=t.seed), rank=rank, world=world, device=device)
    executor = Executor(graph, state, rank, streams=lane_streams(graph, device))

    async def loop():
        losses = []
        for step in range(2):
            state.step_begin(step, [Batch.of(*make_batch(schedule.data, t.seed, step, m, rank, world,
                                                         t.batch)).to(device)
                                    for m in range(t.accumulate)])
            await executor.run_step()
            losses.append(state.step_end()["loss"])
        return losses
    losses = trio.run(loop)
    for name, slot in state.slots.items():       # and whatever else holds host memory now
        if slot.live and slot.tensor is not None and slot.tensor.device.type == "cpu":
            host[name] = host.get(name, True) and slot.tensor.is_pinned()
    result = {"host": host, "losses": losses, "pool": None}
    swapper = state.opened_swapper
    if swapper is not None:
        with swapper.pool.buffer() as staging:
            result["pool"] = swapper.pool.pinned and staging.is_pinned()
        swapper.close()
    return result


def main(mode: str, schedule: str, out: str) -> None:
    rank, world = env_rank()
    compiled = compile_file(schedule, {}, simulate=False)
    assert compiled.ok, [d.message for d in compiled.diagnostics]
    device = pick_device(compiled.graph.config.get("device", "auto"), rank)
    init_group(rank, world, device, 300)
    try:
        result = {"ddp": ddp, "pinned": pinned}[mode](compiled, rank, world, device)
    finally:
        torch.distributed.destroy_process_group()
    torch.save(result, f"{out}.rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
