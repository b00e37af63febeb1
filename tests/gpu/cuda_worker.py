"""One rank of a GPU test, started by torchrun: ``cuda_worker.py MODE SCHEDULE OUT [KEY=VALUE ...]``
(the pairs are ``--set`` overrides of the schedule).

``ddp``: torch DDP (NCCL) trains the schedule's model on this rank's GPU with the schedule's
data, optimizer and steps (``tests/ddp_reference.ddp_train``); ``pinned``: zdsl's own rank state
and executor run the schedule for two steps, recording whether each host buffer it allocated
is pinned. The other modes run zdsl's rank state and executor in this process
(:func:`train`) and hold a disturbed run against an undisturbed one: ``sleep``, ``poison``,
``streams`` (no work on the default stream during a step), ``contexts`` (no CUDA context on
another rank's GPU). Each rank writes its result to ``OUT.rank<r>.pt``.
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
    for swapper in state.opened_swappers:
        with swapper.pool.buffer() as staging:
            pinned = swapper.pool.pinned and staging.is_pinned()
            result["pool"] = pinned if result["pool"] is None else result["pool"] and pinned
        swapper.close()
    return result


def train(compiled, rank: int, world: int, device, *, streams=None, steps: int | None = None,
          around_step=None) -> dict:
    """zdsl's rank state and executor on ``compiled`` (the same parts ``zdsl run`` uses): each
    step's loss and the final parameters (CPU copies). ``streams``: the lane streams (default:
    the runtime's); ``around_step(step)``: a context the executor's step runs in (after the
    batches are queued, before the losses are read)."""
    import contextlib

    import trio

    from zdsl.runtime.exec.executor import Executor
    from zdsl.runtime.exec.streams import lane_streams
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState
    graph, schedule, t = compiled.graph, compiled.schedule, compiled.schedule.train
    torch.manual_seed(t.seed)
    state = RankState(graph, build_model(schedule.model, seed=t.seed), rank=rank, world=world, device=device)
    executor = Executor(graph, state, rank, record=False,
                        streams=streams if streams is not None else lane_streams(graph, device, timing=False))

    async def loop():
        losses = []
        for step in range(steps or t.steps):
            state.step_begin(step, [Batch.of(*make_batch(schedule.data, t.seed, step, m, rank, world,
                                                         t.batch)).to(device) for m in range(t.accumulate)])
            with (around_step or (lambda step: contextlib.nullcontext()))(step):
                await executor.run_step()
            losses.append(state.step_end()["loss"])
        return losses
    losses = trio.run(loop)
    params = {k: v.detach().cpu() for k, v in state.export_state().items()}
    state.close_swap()
    return {"losses": losses, "params": params}


def same(a: dict, b: dict) -> bool:
    """Bit for bit: the losses and every parameter."""
    return a["losses"] == b["losses"] and a["params"].keys() == b["params"].keys() and \
        all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def sleep(compiled, rank: int, world: int, device, seeds: int = 20) -> dict:
    """Random delays (``torch.cuda._sleep``) before random ops of one device lane, a lane and a
    seed per run: the results must not move by a bit (no order the streams leave open matters)."""
    import random
    from contextlib import contextmanager

    from zdsl.runtime.exec.streams import HOST_LANES, LaneStreams

    class Sleepy(LaneStreams):
        def __init__(self, graph, device, seed):
            super().__init__(graph, device, timing=False)
            self.rng = random.Random(seed)
            self.lane = self.rng.choice(sorted(lane for lane in self.streams if lane not in HOST_LANES))

        @contextmanager
        def ordered(self, op):
            with super().ordered(op):
                if op.lane == self.lane and self.rng.random() < 0.5:
                    torch.cuda._sleep(self.rng.randrange(1_000, 2_000_000))    # up to ~1 ms
                yield
    base = train(compiled, rank, world, device)
    moved = {}
    for seed in range(seeds):
        streams = Sleepy(compiled.graph, device, 1000 * seed + rank)
        if not same(train(compiled, rank, world, device, streams=streams), base):
            moved[seed] = streams.lane
    return {"base": base["losses"], "moved": moved}


POISONED_KINDS = ("param_full", "param_shard", "grad_full", "grad_shard", "optim")


def poison(compiled, rank: int, world: int, device) -> dict:
    """Every flat buffer freed on the device is filled with NaN on the stream that allocated it,
    once the freeing stream has passed the free (when the caching allocator may give the block to
    that stream's next allocation): a reader the free did not wait for would read NaN."""
    from zdsl.runtime.state.buffers import BufferTable
    base = train(compiled, rank, world, device)
    home: dict[str, torch.cuda.Stream] = {}
    alloc, release = BufferTable.alloc, BufferTable.release

    def allocating(table, slot):
        t = alloc(table, slot)
        if t.is_cuda:
            home[slot.buf.name] = torch.cuda.current_stream(t.device)
        return t

    poisoned = []

    def releasing(table, slot):
        t = slot.tensor
        if slot.buf.kind in POISONED_KINDS and t is not None and t.is_cuda and t.is_floating_point() \
                and t.untyped_storage().nbytes():
            stream = home.get(slot.buf.name, torch.cuda.current_stream(t.device))
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream(t.device))
            stream.wait_event(freed)
            with torch.cuda.stream(stream):
                t.fill_(float("nan"))
            poisoned.append(slot.buf.name)
        release(table, slot)
    BufferTable.alloc, BufferTable.release = allocating, releasing
    try:
        run = train(compiled, rank, world, device)
    finally:
        BufferTable.alloc, BufferTable.release = alloc, release
    return {"same": same(run, base), "poisoned": len(poisoned), "losses": run["losses"], "base": base["losses"]}


def streams(compiled, rank: int, world: int, device) -> dict:
    """One step under the profiler after a warm-up step: every kernel, copy and memset it ran, with
    its stream; the first is a marker (``torch.cuda._sleep``) put on the default stream."""
    import json
    import tempfile

    from contextlib import contextmanager

    from torch.profiler import ProfilerActivity, profile
    profiled = []

    @contextmanager
    def around_step(step):
        if step != 1:
            yield
            return
        torch.cuda.synchronize(device)     # what the caller queued for the step is not the step's work
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(1000)        # the marker: its stream is the default stream
            yield                          # the step ends waiting for the device
        profiled.append(prof)
    train(compiled, rank, world, device, steps=2, around_step=around_step)
    prof = profiled[0]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    work = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])
    return {"work": [(e["name"], e["args"].get("stream"), e["cat"]) for e in work]}


def contexts(compiled, rank: int, world: int, device) -> dict:
    """After training: which GPUs this process holds a CUDA context on."""
    train(compiled, rank, world, device, steps=2)
    torch.distributed.barrier()
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return {"device": device.index,
            "contexts": None if has is None else [i for i in range(torch.cuda.device_count()) if has(i)]}


def main(mode: str, schedule: str, out: str, *sets: str) -> None:
    rank, world = env_rank()
    compiled = compile_file(schedule, dict(s.split("=", 1) for s in sets), simulate=False)
    assert compiled.ok, [d.message for d in compiled.diagnostics]
    device = pick_device(compiled.graph.config.get("device", "auto"), rank)
    init_group(rank, world, device, 300)
    try:
        result = {"ddp": ddp, "pinned": pinned, "sleep": sleep, "poison": poison, "streams": streams,
                  "contexts": contexts}[mode](compiled, rank, world, device)
    finally:
        torch.distributed.destroy_process_group()
    torch.save(result, f"{out}.rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
