"""Measure this machine for the planner's cost model: ``zdsl calibrate``.

The planner (``zdsl.planner.simulate.op_duration``) prices every op with a
handful of rates from :class:`zdsl.schedule.MachineProfile`. Its predictions
are only as good as those rates, so each is measured here *the way the
planner uses it*, under the conditions of a real run:

* ``flops``: forward + backward of the schedule's GPT (``--schedule``), or
  of one GPT block of the given size, against the flops the compiler
  charges for it (3x the analytic forward flops), i.e. the rate
  ``op.flops / flops`` needs: on CPU the slope of its time over several
  batch sizes (each kernel's fixed cost is charged apart, below), on CUDA
  one batch's flops over its time. Plain ``torch.mm`` at the block's shapes
  is reported beside it (the ceiling). fp32 on CPU, bf16 on CUDA.
* ``host_flops``: the same on the host CPU (the device rate on a CPU box).
* ``memory_bw``/``host_memory_bw``: an AdamW step on a flat fp32 shard,
  counted as the planner counts a ``compute.step`` (moments + parameter +
  gradient bytes): the runtime's host kernel (``host_adam``), and on CUDA
  the device's step for ``memory_bw``.
* ``link``/``latency``, ``scatter_*``, ``reduce_*``: ``all_gather``,
  ``reduce_scatter`` and ``all_reduce`` (the runtime's own) of several sizes
  between the ranks, each fitted to ``latency + payload*(n-1)/n / link``.
* ``pcie``: pinned host<->device copies on CUDA; a memory copy on CPU
  (what a "copy to device" costs there).
* ``disk_read``/``disk_write`` and their ``*_latency``: the NVMe tier's
  own swapper writing and reading transfers of 256 KiB to 16 MiB
  (``O_DIRECT`` requests of the schedule's block size, several in flight),
  each direction fitted to ``latency + bytes / rate``; ``disk_*_cpu``
  the share of a core a transfer takes from a GPT block's forward+backward
  run beside it.
* ``overhead``: what the runtime itself costs per op (dispatch, worker
  hand-off, completion, a collective's wake-up), which rates cannot see and
  which dominates small models. Measured by training a tiny ZeRO-3 GPT
  (``REFERENCE``) through the real executor, in three blocks of steps spread
  over the calibration (first, middle, last; their median): ``overhead``
  per lane op and ``kernel_overhead`` per kernel a compute op dispatches
  are the line through each op's time beyond its rated time against its
  kernels,
  ``comm_overhead`` per collective the cost that then makes the planner's
  prediction of that graph equal the measured median step, and
  ``scatter_overhead`` per reduce-scatter that plus what a reduce-scatter
  took beyond its rated time more than the other collectives did.
  Each of these four fixed costs is clamped at 0, and 0 is a sensible,
  valid result (the language allows a fixed cost of 0: ``MACHINE_MAY_BE_ZERO``
  in ``zdsl/schedule.py``): it says the rates alone already account for
  the measured time, and noise put the fitted line below 0. It happens
  often on shared cores: ``kernel_overhead`` when the ops' excess does not
  rise with their kernel count, ``scatter_overhead`` when reduce-scatters
  took *less* beyond their own measured rate (``scatter_*``, which already
  holds their reduction's cost) than the other collectives did. Rates are
  never 0 and never negative (each fit keeps them positive), so the
  statement written is always one the checker accepts.
* ``cores``: the rank's share of the host's cores (ranks are bound to it).
* ``comm_under_load``: on CPU, the share of its rate a collective keeps
  while compute fills those cores: gloo's threads wait for a core rather
  than take a fair share. The slope of each reference collective's time
  beyond its rate against the seconds a compute op ran beside it.

All ranks measure at once (one process per rank, the runtime's thread
count per rank), because that is how they contend for cores, memory and
disk in a run; a rate is the mean over ranks of each rank's median. The output is a ``machine``
statement that a schedule includes (``include "machine.zs"``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

from zdsl.schedule import MACHINE_OPTIONS

from zdsl.schedule import MachineProfile

from zdsl.runtime.run.launch import free_port

ZS_KEYS = {field: key for key, field in MACHINE_OPTIONS}   # MachineProfile field -> .zs keyword
MiB = 1 << 20
BLOCK = 1 * MiB          # NVMe block, the schedule default
DEPTH = 8                # NVMe requests in flight, the schedule default


class CalibrationError(RuntimeError):
    """Calibration could not run or a measurement failed (said in words)."""


@dataclass
class Settings:
    """What to measure and how long; ``quick`` trades precision for < 15 s."""
    ranks: int = 2
    backend: str = "auto"            # auto | gloo | nccl
    disk_folder: str | None = None   # where the NVMe test files go (default: the temp folder)
    quick: bool = False
    width: int | None = None         # model shape the compute rate is measured at
    layers: int | None = None        # with layers (and vocab): the whole model, else one block
    vocab: int | None = None
    heads: int | None = None
    context: int | None = None
    batch: int | None = None
    block: int = BLOCK               # NVMe I/O size and requests in flight (the schedule's nvme(...))
    depth: int = DEPTH
    timeout_s: float = 60.0

    def budget(self, full: float, quick: float) -> float:
        return quick if self.quick else full


@dataclass
class Calibration:
    """The measured profile and how each number was obtained."""
    profile: MachineProfile
    details: dict = field(default_factory=dict)

    def fields(self) -> dict:
        """The MachineProfile fields, as the schedule dataclass names them."""
        return asdict(self.profile)

    def machine_statement(self) -> str:
        p = self.profile
        args = ", ".join(f"{ZS_KEYS[k]}={_num(getattr(p, k))}" for k in ZS_KEYS)
        return f"machine {p.name}({args})"

    def to_zs(self) -> str:
        """The text of ``machine.zs``: comments saying how, then one statement."""
        lines = [f"# {line}" for line in self.details.get("notes", [])]
        return "\n".join(lines + [self.machine_statement()]) + "\n"


def _num(v: float) -> str:
    return f"{v:.3g}"


# -- timing helpers --------------------------------------------------------------------------

def _sync_for(device):
    import torch
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _median_time(fn, sync, budget_s: float, min_reps: int = 3, max_reps: int = 1000) -> float:
    """Median seconds of ``fn`` after one warm-up, repeated for about ``budget_s``."""
    fn()
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- the measurements (each runs on every rank at once) --------------------------------------

def _model_shape(s: Settings, device) -> dict:
    cuda = device.type == "cuda"
    return {
        "width": s.width or (768 if cuda else 64),
        "heads": s.heads or (12 if cuda else 4),
        "context": s.context or (1024 if cuda else 32),
        "batch": s.batch or (8 if cuda else 4),
        "layers": s.layers,
        "vocab": s.vocab or 256,
    }


def _block_fwd_bwd(block, batch: int, context: int, width: int):
    """A closure running a GPT ``block``'s forward and backward on one random batch, on the
    block's device and in its dtype."""
    import torch
    p = next(block.parameters())
    x = torch.randn(batch, context, width, device=p.device, dtype=p.dtype, requires_grad=True)
    g = torch.randn_like(x)
    return lambda: block(x).backward(g)


def measure_compute(device, s: Settings, dtype) -> dict:
    """Matmul ceiling at the block's shapes, and the block's forward+backward rate."""
    import torch
    from zdsl.compile.units import gpt_units

    shape = _model_shape(s, device)
    d, tokens = shape["width"], shape["batch"] * shape["context"]
    sync = _sync_for(device)
    mats = [(torch.randn(tokens, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype),
             torch.empty(tokens, n, device=device, dtype=dtype))
            for k, n in ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d))]
    mm_flops = sum(2.0 * tokens * a.shape[1] * b.shape[1] for a, b, _ in mats)
    budget = s.budget(2.5, 0.3)
    with torch.no_grad():   # preallocated outputs: the ceiling, without the allocator
        t_mm = _median_time(lambda: [torch.mm(a, b, out=c) for a, b, c in mats], sync, budget)
    out = {"mm_flops": mm_flops / t_mm, "shape": shape, "dtype": str(dtype).replace("torch.", "")}
    try:
        from zdsl.runtime.models.gpt import GPT
        from zdsl.runtime.models.gpt import Block
    except Exception as e:  # the model is optional here: fall back to the matmul rate
        out["block_flops"] = None
        out["block_note"] = f"GPT model unavailable ({type(e).__name__}); flops = matmul rate"
        return out
    torch.manual_seed(0)
    b, T, heads = shape["batch"], shape["context"], shape["heads"]
    whole = bool(shape.get("layers"))
    if whole:   # the whole model, embedding and head included: what a step's compute lane runs
        layers, vocab = shape["layers"], shape["vocab"]
        model = GPT(layers, d, heads, vocab, T, device=device).to(dtype=dtype)
        specs = gpt_units(layers, d, heads, vocab, T)
        out["measured"] = f"GPT forward+backward: layers {layers}, vocab {vocab}, "
    else:
        block = Block(d, heads).to(device=device, dtype=dtype)
        specs = gpt_units(1, d, heads, 256, T)[1:2]
        out["measured"] = "GPT block forward+backward: "

    def fwd_bwd_at(batch: int):
        if whole:
            idx = torch.randint(vocab, (batch, T), device=device)
            tgt = torch.randint(vocab, (batch, T), device=device)
            return lambda: model(idx, tgt).backward()
        return _block_fwd_bwd(block, batch, T, d)

    per_seq = 3.0 * sum(u.fwd_flops_per_seq for u in specs)      # forward + 2x for backward
    t_model = _median_time(fwd_bwd_at(b), sync, budget)
    out["block_flops"] = per_seq * b / t_model
    if device.type == "cpu":
        # Eager PyTorch pays a fixed cost per kernel, as large here as the block's arithmetic,
        # which the planner charges apart (kernel_overhead, fitted on the runtime's own ops in
        # fit_overhead): the rate is the slope of forward+backward's time over several batch
        # sizes (the same kernels, flops in proportion), not one batch's flops over its time.
        # (On CUDA, launches overlap the device's work: one batch's rate.)
        batches = sorted({max(1, b // 4), max(1, b // 2), b, 2 * b})
        points = [(per_seq * n, _median_time(fwd_bwd_at(n), sync, s.budget(1.5, 0.2)) if n != b else t_model)
                  for n in batches]
        fixed_s, rate = fit_latency_bandwidth(points)
        out.update(block_flops=rate, fixed_s=fixed_s, batches=batches, flops_at_batch=per_seq * b / t_model)
    return out


def measure_optimizer(device, s: Settings) -> dict:
    """AdamW steps on a flat fp32 shard, bytes counted as the planner's compute.step does:
    the step the runtime runs on the host (``host_adam``: what a CPU run and an offloaded
    optimizer use) and, on CUDA, the step on the device.

    The device step is ATen's own single-tensor AdamW (what ``torch.optim.AdamW(foreach=False)``
    runs, kernel for kernel), written out so calibration does not pay torch.optim's
    first-use import (seconds) for a number that takes milliseconds.
    """
    import torch
    from zdsl.runtime.offload.host_adam import host_adamw_
    n = (1 << 20) if s.quick else (4 << 20)
    state_bytes = n * (8 + 2 * 4)          # two fp32 moments + fp32 parameter and gradient
    lr, wd, b1, b2, eps = 1e-3, 0.1, 0.9, 0.95, 1e-8
    budget = s.budget(1.0, 0.25)

    def tensors(where):
        g = torch.Generator().manual_seed(0)
        p = (torch.randn(n, generator=g) * 0.02).to(where)
        grad = (torch.randn(n, generator=g) * 1e-3).to(where)
        return p, grad, torch.zeros(n, device=where), torch.zeros(n, device=where)

    hp, hg, hm, hv = tensors("cpu")
    count = [0]

    def host_step():
        count[0] += 1
        host_adamw_(hp, hg, hm, hv, count[0], lr, b1, b2, eps, wd, threads=torch.get_num_threads())
    host_sec = _median_time(host_step, lambda: None, budget)
    out = {"host_adam_bandwidth": state_bytes / host_sec, "adam_numel": n}
    if device.type != "cuda":
        out["adam_bandwidth"] = out["host_adam_bandwidth"]
        return out
    p, g, m, v = tensors(device)
    t = 1

    def step():
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        denom = (v.sqrt() / (bc2 ** 0.5)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)
    with torch.no_grad():
        sec = _median_time(step, _sync_for(device), budget)
    out["adam_bandwidth"] = state_bytes / sec
    return out


def measure_copy(device, s: Settings) -> dict:
    """Host<->device copy rate (pinned) on CUDA; a plain memory copy on CPU."""
    import torch
    n = (16 if s.quick else 64) * MiB
    budget = s.budget(0.8, 0.25)
    if device.type != "cuda":
        src = torch.empty(n, dtype=torch.uint8).fill_(1)
        dst = torch.empty(n, dtype=torch.uint8)
        t = _median_time(lambda: dst.copy_(src), lambda: None, budget)
        return {"pcie": n / t, "copy_note": f"memcpy of {n // MiB} MiB (no device: copies are host memcpy)"}
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    sync = _sync_for(device)
    t_h2d = _median_time(lambda: dev.copy_(host, non_blocking=True), sync, budget)
    t_d2h = _median_time(lambda: host.copy_(dev, non_blocking=True), sync, budget)
    return {"pcie": 2 * n / (t_h2d + t_d2h), "h2d": n / t_h2d, "d2h": n / t_d2h,
            "copy_note": f"pinned copies of {n // MiB} MiB"}


def _collective_fns():
    """The runtime's own all-gather, reduce-scatter and all-reduce (on gloo a reduce-scatter is
    an all-reduce: see ``runtime/dist/collectives.py``), so each rate is the one a run sees."""
    from zdsl.runtime.dist import collectives
    return collectives.all_gather, collectives.reduce_scatter, collectives.all_reduce


def fit_latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``t = latency + x / bandwidth`` to (x bytes, t seconds), minimising relative error.

    Relative weights keep the small sizes (which carry the latency) from
    being drowned by the large ones (which carry the bandwidth).
    """
    if len(points) < 2:
        x, t = points[0]
        return 0.0, x / t
    intercept, slope = least_squares_line(points, [1.0 / (t * t) for _, t in points])
    if slope <= 0:                                   # noise: bandwidth from the largest size alone
        x, t = max(points)
        return min(t for _, t in points), x / t
    return max(intercept, 1e-6), 1.0 / slope


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def measure_collectives(device, s: Settings, rank: int, world: int) -> dict:
    """Each kind of collective at several payloads, fitted to ``latency + payload*(n-1)/n / link``;
    every rank runs the same loop."""
    import torch
    import torch.distributed as dist
    gather, scatter, reduce = _collective_fns()
    sync = _sync_for(device)
    # 4 KiB carries the latency: a step's small collectives (a gradient norm is 8 bytes, a tiny
    # unit's shard a few KiB) sit below the sizes that carry the bandwidth.
    sizes = [4 << 10, 64 << 10, 1 * MiB, 8 * MiB] if s.quick else [4 << 10, 64 << 10, 512 << 10, 4 * MiB, 16 * MiB]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in COLLECTIVES}
    for size in sizes:
        numel = size // 4 // world * world
        full = torch.zeros(numel, device=device)
        shard = torch.ones(numel // world, device=device)
        reps = max(3, min(20 if s.quick else 40, int((4 if s.quick else 16) * MiB / size)))
        for name, call in (("all_gather", lambda: gather(full, shard)),
                           ("reduce_scatter", lambda: scatter(shard, full)),
                           ("all_reduce", lambda: reduce(full))):
            call()
            sync()
            dist.barrier()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                call()
                sync()
                times.append(time.perf_counter() - t0)
            payload = numel * 4 * (world - 1) / world
            # The mean, not the median: on shared cores a small collective takes either ~0.3 ms
            # or ~3 ms (a wake-up missed), and which mode holds the median flips from size to
            # size and run to run; the mean is what a step pays per call on average.
            results[name].append((payload, statistics.fmean(times)))
    out: dict = {name: fit_latency_bandwidth(pts) for name, pts in results.items()}
    out["sizes"] = sizes
    out["points"] = results
    return out


# Transfer sizes of the disk test: a small unit's shard to a large one's optimizer state. At the
# sizes a schedule moves, a transfer's fixed cost is much of its time (traced: a 1.5 MiB shard's
# read took 3-5 ms in a run against 1.4 ms at the streaming rate).
DISK_SIZES = (256 << 10, 1 * MiB, 4 * MiB, 16 * MiB)
MIN_DISK_CPU = 0.01     # a share of a core: noise can make compute beside a transfer faster


def measure_disk(folder: str, s: Settings, rank: int, barrier=lambda: None) -> dict:
    """The runtime's own swapper (``runtime/offload/swap.py``: ``block``-sized direct-I/O requests, up to
    ``depth`` in flight, every block checksummed) writing then reading transfers of several
    sizes from a plain thread, as a lane does; each direction fitted to ``latency + bytes / rate``.
    Then the share of the rank's core a transfer takes from compute beside it
    (:func:`_disk_beside_compute`). ``barrier`` keeps the ranks at the same size, as they share
    the disk in a run."""
    import torch

    from zdsl.runtime.offload.swap import Swapper

    from zdsl.runtime.offload.swap import SwapError
    sizes = DISK_SIZES[:-1] if s.quick else DISK_SIZES
    budget = s.budget(0.4, 0.1)
    where = os.path.join(folder, f".zdsl-calibrate-{os.getpid()}-{rank}")
    points: dict[str, list[tuple[float, float]]] = {"write": [], "read": []}
    direct = True
    try:
        with Swapper(where, s.block, s.depth) as swapper:
            for size in sizes:
                data = torch.randint(0, 256, (size,), dtype=torch.uint8)
                out = torch.empty_like(data)
                name = f"transfer-{size}"
                swapper.reserve({name: size})
                barrier()
                points["write"].append((size, _median_time(lambda: swapper.write_sync(name, data),
                                                           lambda: None, budget)))
                direct = direct and swapper.direct(name)
                barrier()
                points["read"].append((size, _median_time(lambda: swapper.read_sync(name, out),
                                                          lambda: None, budget)))
                if not torch.equal(out, data):
                    raise CalibrationError(f"disk test in {folder}: a read returned other bytes than were written")
                swapper.discard(name)
            barrier()
            cpu = _disk_beside_compute(swapper, s)
    except SwapError as e:
        raise CalibrationError(f"disk test in {folder} failed: {e}") from None
    finally:
        shutil.rmtree(where, ignore_errors=True)
    result = {"direct": direct, "sizes": list(sizes), "points": points, "beside_compute": cpu}
    for way in ("read", "write"):
        latency, rate = fit_latency_bandwidth(points[way])
        result.update({f"disk_{way}": rate, f"disk_{way}_latency": latency, f"disk_{way}_cpu": cpu[way]})
    return result


def _disk_beside_compute(swapper, s: Settings) -> dict:
    """How much of the core a disk transfer takes from compute: a GPT block's forward+backward
    on the host alone, then beside back-to-back reads, then writes, then alone again; the share
    is ``1 - alone / beside``. The swapper's threads wake for each request and checksum each
    block, and the scheduler runs them first: traced, a block's forward+backward took 1.4x its
    time beside reads and 2x beside writes while the transfers kept their rate."""
    import threading

    import torch

    from zdsl.runtime.models.gpt import Block
    shape = _model_shape(s, torch.device("cpu"))
    fwd_bwd = _block_fwd_bwd(Block(shape["width"], shape["heads"]), shape["batch"], shape["context"], shape["width"])
    size = DISK_SIZES[2]
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    out = torch.empty_like(data)
    swapper.write_sync("beside", data)
    budget = s.budget(0.5, 0.15)
    nothing = lambda: None                     # noqa: E731
    alone = [_median_time(fwd_bwd, nothing, budget)]
    beside = {}
    for way, transfer in (("read", lambda: swapper.read_sync("beside", out)),
                          ("write", lambda: swapper.write_sync("beside", data))):
        stop = threading.Event()
        failed: list[BaseException] = []

        def loop() -> None:
            try:
                while not stop.is_set():
                    transfer()
            except BaseException as e:  # noqa: BLE001 - raised below, in the measuring thread
                failed.append(e)
        thread = threading.Thread(target=loop, name="zdsl-calibrate-disk", daemon=True)
        thread.start()
        try:
            beside[way] = _median_time(fwd_bwd, nothing, budget)
        finally:
            stop.set()
            thread.join()
        if failed:                                 # else compute "beside" it ran alone
            raise failed[0]
    alone.append(_median_time(fwd_bwd, nothing, budget))
    swapper.discard("beside")
    base = statistics.fmean(alone)
    return {way: min(1.0, max(MIN_DISK_CPU, 1.0 - base / t)) for way, t in beside.items()} | \
        {"alone_s": base, "beside_s": beside}


# -- one rank ---------------------------------------------------------------------------------

STEPS = ("compute", "optimizer", "copy", "collectives", "disk", "runtime")
# Reference steps (full, quick), ~15 ms each here. The host's speed moves from one half second to
# the next: 48 steps in one block put the reference 50% off the programs run beside it.
RUNTIME_STEPS = {False: 240, True: 24}
RUNTIME_BLOCKS = 3

# The graph the per-op overhead is fitted on: small enough that fixed costs dominate. Its step
# count only has to be valid: measure_runtime runs as many steps as each block needs.
REFERENCE = """schedule calibrate_reference "zdsl calibrate: a tiny ZeRO-3 step, what the runtime costs per op"
model     gpt(layers=2, width=64, heads=4, vocab=256, context=32)
data      synthetic(vocab=256, context=32)
train     steps={steps}, batch=4, precision=fp32, seed=0
optimizer adamw(lr=1e-3)
ranks     {ranks} on {device}
zero      3
"""


@functools.lru_cache(maxsize=None)
def reference_graph(ranks: int, device: str):
    """The compiled reference schedule: once per process, for the runtime blocks and the fit
    alike (nothing that runs it changes it)."""
    from zdsl.cli import compile_file
    with tempfile.TemporaryDirectory(prefix="zdsl-calibrate-") as tmp:
        path = os.path.join(tmp, "reference.zs")
        with open(path, "w", encoding="utf-8") as f:
            f.write(REFERENCE.format(steps=RUNTIME_STEPS[False], ranks=ranks, device=device))
        compiled = compile_file(path, {}, simulate=False)
    if not compiled.ok:
        raise CalibrationError("the reference schedule does not compile: "
                               + "; ".join(d.message for d in compiled.diagnostics if d.is_error))
    return compiled


def measure_runtime(device, s: Settings, rank: int, world: int, steps: int, slots: int = 1) -> dict:
    """Step times of ``steps`` steps of the reference schedule through the real executor (all ranks
    at once); ``slots``: collectives the backend runs at once (for their service times)."""
    import torch
    import trio

    from zdsl.runtime.data import make_batch
    from zdsl.runtime.exec.executor import Executor
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState
    from zdsl.runtime.dist.collectives import all_gather
    from zdsl.runtime.exec.streams import lane_streams
    compiled = reference_graph(world, device.type)
    graph, schedule = compiled.graph, compiled.schedule
    state = RankState(graph, build_model(schedule.model, seed=0), rank=rank, world=world, device=device)
    executor = Executor(graph, state, rank, streams=lane_streams(graph, device))
    t = schedule.train
    mine = torch.zeros(8)
    gathered = torch.zeros(8 * world)

    async def loop() -> list:
        records = []
        for step in range(steps):
            batches = [tuple(x.to(device) for x in make_batch(schedule.data, t.seed, step, m, rank, world, t.batch))
                       for m in range(t.accumulate)]
            state.step_begin(step, batches)
            records.append(await executor.run_step())
            state.step_end()
            if world > 1:                 # `zdsl run` gathers each step's metrics: ranks start aligned
                all_gather(gathered, mine)
        return records

    records = trio.run(loop)[2:]              # the first steps allocate and warm up
    del state, executor
    if device.type == "cuda":
        torch.cuda.empty_cache()
    intervals = [comm_intervals(graph, t, slots) for t in records]       # once a step, for both below
    loaded = [comm_under_compute(graph, t, iv) for t, iv in zip(records, intervals)]
    return {"step_s": statistics.median(t.seconds for t in records), "steps": [t.seconds for t in records],
            "lane_op_s": {i: statistics.median(t.timings[i].end - t.timings[i].start for t in records)
                          for i in lane_ops(graph)},
            "comm_service_s": {i: statistics.median(iv[i][1] - iv[i][0] for iv in intervals) for i in comm_ops(graph)},
            "comm_loaded_s": {i: statistics.median(x[i] for x in loaded) for i in comm_ops(graph)},
            "ops": len(graph.ops)}


@dataclass
class OverheadFit:
    """The fixed costs per op that make the reference's prediction match its measurement."""
    op: float                   # seconds per op run in a lane's thread (compute, copy, I/O)
    comm: float                 # seconds per collective (< 0: not fitted apart, ``op`` applies)
    bare_s: float               # the predicted step with no fixed cost at all
    scatter: float = -1.0       # seconds per reduce-scatter (< 0: ``comm`` applies)
    kernel: float = 0.0         # seconds per kernel a compute op dispatches
    under_load: float = 0.0     # a collective's rate while compute fills the cores (0: fair share)


def lane_ops(graph) -> list[int]:
    """Positions of the ops a lane's thread runs (not collectives, not frees)."""
    return [i for i, op in enumerate(graph.ops) if op.kind != "mem.free" and not op.kind.startswith("comm.")]


def comm_ops(graph) -> list[int]:
    """Positions of the collectives."""
    return [i for i, op in enumerate(graph.ops) if op.kind.startswith("comm.")]


def comm_intervals(graph, record, slots: int = 1) -> dict[int, tuple[float, float]]:
    """Each collective's service interval in one measured step: from when it was issued, or when
    the backend had a thread free for it if that was later, to its end. The runtime issues a
    lane's collectives without waiting; the backend runs ``slots`` at once, in issue order (gloo:
    two threads), so one issued behind others starts when the ``slots``-th latest end before it
    has passed. The planner runs a lane's collectives the same way (``comm_slots``), so this is
    the measured time comparable to its duration."""
    from zdsl.observe.overlap import BackendThreads
    intervals, lanes = {}, {}
    for i in comm_ops(graph):
        t = record.timings[i]
        start, _ = lanes.setdefault(graph.ops[i].lane, BackendThreads(slots)).take(t.start, t.end)
        intervals[i] = (start, t.end)
    return intervals


def comm_under_compute(graph, record, intervals: dict[int, tuple[float, float]]) -> dict[int, float]:
    """Seconds of each collective's service interval (:func:`comm_intervals`) during which a
    compute op ran on the rank (the cores were full: what ``comm_under_load`` is fitted on)."""
    from zdsl.observe.overlap import union_length
    compute = [(record.timings[i].start, record.timings[i].end)
               for i, op in enumerate(graph.ops) if op.kind.startswith("compute.")]
    return {i: union_length([(max(s, cs), min(e, ce)) for cs, ce in compute if cs < e and ce > s])
            for i, (s, e) in intervals.items()}


def fit_overhead(profile: MachineProfile, ranks: int, device: str, measured_s: float,
                 lane_op_s: dict[int, float] | None = None,
                 comm_service_s: dict[int, float] | None = None,
                 comm_loaded_s: dict[int, float] | None = None) -> OverheadFit:
    """Fixed costs per op that make the reference step's prediction equal ``measured_s``.

    With ``lane_op_s`` (the measured seconds of each lane op of the reference, by position)
    and collectives in the graph, the cost per lane op and per kernel come from what each lane
    op took beyond its rated time (:func:`lane_costs`), and the cost per collective is then the
    one that makes the step match. Without it,
    one cost for every op makes the step match. Each prediction grows with its cost: bisection.

    With ``comm_service_s`` (each collective's measured service time, :func:`comm_intervals`) a
    reduce-scatter costs what it took beyond its rated time more than the other collectives did
    (the medians' difference): its reduction runs on the backend's threads, on the cores the
    backward it overlaps is using, which its isolated rate does not see. Here it came to 0.9-1.3 ms
    more than the others, and one cost for all put ZeRO-1 and -2 programs, whose steps
    reduce-scatter as often as they gather or more, 12-17% under their measured steps.
    """
    from zdsl.planner.simulate import rated_duration
    from zdsl.planner.simulate import simulate
    graph = reference_graph(ranks, device).graph
    bare = simulate(graph, dataclasses.replace(profile, op_overhead=0.0, comm_overhead=-1.0,
                                               kernel_overhead=0.0)).step_s
    has_comm = any(op.kind.startswith("comm.") for op in graph.ops)

    def bisect(key, fixed: dict | None = None) -> float:
        """The x that makes the step match; ``key`` names the field x sets, or maps x to fields."""
        fields = key if callable(key) else (lambda x: {**fixed, key: x})

        def step(x: float) -> float:
            return simulate(graph, dataclasses.replace(profile, **fields(x))).step_s
        lo, hi = 0.0, max(measured_s, 1e-6)
        if step(lo) >= measured_s:
            return 0.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step(mid) < measured_s else (lo, mid)
        return (lo + hi) / 2

    if not lane_op_s or not has_comm:
        return OverheadFit(bisect("op_overhead", {"comm_overhead": -1.0}), -1.0, bare)
    op_cost, kernel_cost = lane_costs(graph, profile, lane_op_s)
    under = 0.0
    service = dict(comm_service_s or {})
    if comm_loaded_s and profile.cores > 0 and profile.name == "cpu":
        under = rate_under_load(graph, profile, service, comm_loaded_s)
        # what remains of each service time once the wait for a core is taken out
        service = {i: sec - (1.0 - under) * comm_loaded_s.get(i, 0.0) for i, sec in service.items()}
    profile = dataclasses.replace(profile, op_overhead=op_cost, kernel_overhead=kernel_cost, comm_under_load=under)
    extra = scatter_extra(graph, profile, service)
    if extra is None:
        return OverheadFit(op_cost, bisect("comm_overhead", {}), bare, kernel=kernel_cost, under_load=under)
    comm = bisect(lambda x: {"comm_overhead": x, "scatter_overhead": max(0.0, x + extra)})
    if comm == 0.0:             # the extra alone overshoots the step: the reduce-scatter's cost is fitted instead
        scatter = bisect("scatter_overhead", {"comm_overhead": 0.0})
        return OverheadFit(op_cost, 0.0, bare, scatter, kernel_cost, under)
    return OverheadFit(op_cost, comm, bare, max(0.0, comm + extra), kernel_cost, under)


# A collective that took 50x its rate under load is waiting, not moving: the floor of the fit.
MIN_UNDER_LOAD = 0.02


def rate_under_load(graph, profile: MachineProfile, service_s: dict[int, float],
                    loaded_s: dict[int, float]) -> float:
    """The share of its rate a collective keeps while compute fills the rank's cores.

    A collective needs ``W`` seconds of progress (rated time plus a fixed cost); it makes them at
    rate 1 while the cores are free and at ``a`` while compute runs beside it (``loaded`` of its
    ``service`` seconds), so ``service - rated = cost + (1 - a) x loaded``: the least-squares
    slope over the reference's collectives gives ``a``. 1 (no effect) without a rising line."""
    from zdsl.planner.simulate import rated_duration
    points = [(loaded_s.get(i, 0.0), sec - rated_duration(graph, graph.ops[i], profile))
              for i, sec in service_s.items()]
    _, slope = least_squares_line(points)
    return min(1.0, max(MIN_UNDER_LOAD, 1.0 - slope))


def least_squares_line(points: list[tuple[float, float]],
                       weights: list[float] | None = None) -> tuple[float, float]:
    """(intercept, slope) of the (weighted) least-squares line through (x, y) points; slope 0
    (and the mean) where the x do not vary."""
    w = weights or [1.0] * len(points)
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    var = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
    slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points)) / var if var > 0 else 0.0
    return my - slope * mx, slope


def lane_costs(graph, profile: MachineProfile, lane_op_s: dict[int, float]) -> tuple[float, float]:
    """(seconds per lane op, seconds per kernel of a compute op) from the measured lane ops: the
    least-squares line through each op's time beyond its rated time against the kernels it
    dispatches (``op.kernels``; 0 for a step or a copy). In the executor a kernel costs about
    twice what it does in a bare forward+backward (the runtime's saved-tensor hooks, a core
    shared with the collectives' threads): 8 us here against 4. Without two kernel counts to
    draw a line through, or with a line that falls, the median excess per op and no kernel cost;
    a line that would start below 0 goes through the origin."""
    from zdsl.planner.simulate import rated_duration
    points = [(graph.ops[i].kernels, sec - rated_duration(graph, graph.ops[i], profile))
              for i, sec in lane_op_s.items()]
    if not points:
        return 0.0, 0.0
    intercept, slope = least_squares_line(points)
    if slope <= 0:
        return max(0.0, statistics.median(y for _, y in points)), 0.0
    if intercept < 0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return intercept, slope


def scatter_extra(graph, profile: MachineProfile, comm_service_s: dict[int, float]) -> float | None:
    """Seconds a reduce-scatter took beyond its rated time more than the other collectives did
    (median against median), or None without both kinds measured."""
    from zdsl.planner.simulate import rated_duration
    scatter, other = [], []
    for i, sec in comm_service_s.items():
        op = graph.ops[i]
        (scatter if op.kind == "comm.reduce_scatter" else other).append(sec - rated_duration(graph, op, profile))
    if not scatter or not other:
        return None
    return statistics.median(scatter) - statistics.median(other)


def _device_for(rank: int, backend: str):
    import torch
    if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def _run_rank(rank: int, world: int, port: int, s: Settings, backend: str, report) -> dict:
    """Every measurement on one rank, in lock step with the others; returns this rank's numbers."""
    import torch
    import torch.distributed as dist

    device = _device_for(rank, s.backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu":              # bound to its cores, with their threads: as `zdsl run` does
        from zdsl.runtime.dist.affinity import set_cpu_threads
        threads = set_cpu_threads(rank, world)
    else:
        threads = max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=s.timeout_s))
        if backend == "gloo":             # gloo's loop threads as a run has them
            from zdsl.runtime.dist.affinity import calm_gloo_loops
            calm_gloo_loops()
    try:
        from zdsl.runtime.dist.collectives import comm_slots
        slots = comm_slots()
        out: dict = {"threads": threads, "device": str(device), "seconds": {}, "comm_slots": slots}
        clock = [time.perf_counter()]

        def barrier(done: str | None = None) -> None:
            if world > 1:
                dist.barrier()
            if done:
                out["seconds"][done] = time.perf_counter() - clock[0]
                clock[0] = time.perf_counter()
        barrier("start")
        # The reference step in blocks spread over the calibration (first, middle, last), so that a
        # burst of outside load during one of them moves the median less
        block_steps = RUNTIME_STEPS[s.quick] // RUNTIME_BLOCKS
        early = [measure_runtime(device, s, rank, world, block_steps, slots)]
        barrier("runtime (first block)")
        report("compute")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        out["compute"] = measure_compute(device, s, dtype)
        if device.type == "cuda":
            small = dataclasses.replace(s, width=None, heads=None, context=None, batch=None, layers=None)
            out["host_compute"] = measure_compute(torch.device("cpu"), small, torch.float32)
        barrier("compute")
        report("optimizer")
        out["optimizer"] = measure_optimizer(device, s)
        barrier("optimizer")
        report("copy")
        out["copy"] = measure_copy(device, s)
        barrier("copy")
        report("collectives")
        if world > 1:
            out["collectives"] = measure_collectives(device if backend == "nccl" else torch.device("cpu"),
                                                     s, rank, world)
        barrier("collectives")
        early.append(measure_runtime(device, s, rank, world, block_steps, slots))
        barrier("runtime (middle block)")
        report("disk")
        out["disk"] = measure_disk(s.disk_folder or tempfile.gettempdir(), s, rank,
                                   dist.barrier if world > 1 else (lambda: None))
        barrier("disk")
        report("runtime")
        out["runtime"] = [*early, measure_runtime(device, s, rank, world, block_steps, slots)]
        barrier("runtime")
        if world > 1:
            every: list = [None] * world
            dist.all_gather_object(every, out)
            return {"ranks": every}
        return {"ranks": [out]}
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _child(rank: int, world: int, port: int, s: Settings, errors) -> None:
    """A spawned rank (1..world-1). Failures go back to rank 0 in words."""
    code = 0
    try:
        from zdsl.runtime.run.cli import configure_rank_logging
        configure_rank_logging(rank)      # warnings only, as rank 0's (the swapper logs its opening)
        _run_rank(rank, world, port, s, _pick_backend(s), lambda step: None)
    except BaseException as e:  # noqa: BLE001 - reported, then the process exits non-zero
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        errors.put(f"rank {rank} traceback:\n{traceback.format_exc()}")
        code = 1
    # As `zdsl run`'s ranks do: leave without interpreter teardown, where torch's C++ statics
    # (gloo's threads) can abort a rank that measured cleanly ("terminate called without an
    # active exception", seen once in CI). The queue is flushed first: os._exit skips its feeder.
    errors.close()
    errors.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _pick_backend(s: Settings) -> str:
    import torch
    if s.backend == "nccl" or (s.backend == "auto" and torch.cuda.is_available()
                               and torch.cuda.device_count() >= s.ranks):
        if not torch.cuda.is_available():
            raise CalibrationError("backend nccl needs CUDA, and torch sees no CUDA device; use --backend gloo")
        if torch.cuda.device_count() < s.ranks and s.ranks > 1:
            raise CalibrationError(f"nccl needs one GPU per rank: {torch.cuda.device_count()} GPU(s) for "
                                   f"{s.ranks} ranks; use --ranks {torch.cuda.device_count()} or --backend gloo")
        return "nccl"
    return "gloo"


# -- putting it together ----------------------------------------------------------------------

def _summarise(raw: list[dict], s: Settings, backend: str, world: int) -> Calibration:
    # The ranks' medians, averaged: on a shared machine one rank's window can catch a burst
    # of outside load, and taking the slowest rank then overstates every op of a step.
    mean = lambda get: statistics.fmean(get(r) for r in raw)  # noqa: E731
    first = raw[0]
    cuda = first["device"].startswith("cuda")
    comp = first["compute"]
    block = mean(lambda r: r["compute"]["block_flops"] or r["compute"]["mm_flops"])
    mm = mean(lambda r: r["compute"]["mm_flops"])
    host = mean(lambda r: (r.get("host_compute") or r["compute"])["block_flops"]
                or (r.get("host_compute") or r["compute"])["mm_flops"])
    adam = mean(lambda r: r["optimizer"]["adam_bandwidth"])
    pcie = mean(lambda r: r["copy"]["pcie"])
    disk = {key: mean(lambda r: r["disk"][key])
            for key in ("disk_read", "disk_write", "disk_read_latency", "disk_write_latency",
                        "disk_read_cpu", "disk_write_cpu")}
    host_adam = mean(lambda r: r["optimizer"]["host_adam_bandwidth"])
    profile = MachineProfile(name="cuda" if cuda else "cpu", flops=block, host_flops=host,
                             pcie_bandwidth=pcie, **disk, memory_bandwidth=adam,
                             host_memory_bandwidth=host_adam, cores=_cores_per_rank(world),
                             comm_slots=first.get("comm_slots", 1))
    if world > 1:   # each kind of collective its own (latency, bandwidth); one rank keeps the defaults
        fit = {name: (mean(lambda r: r["collectives"][name][0]), mean(lambda r: r["collectives"][name][1]))
               for name in COLLECTIVES}
        profile.link_latency, profile.link_bandwidth = fit["all_gather"]
        profile.scatter_latency, profile.scatter_bandwidth = fit["reduce_scatter"]
        profile.reduce_latency, profile.reduce_bandwidth = fit["all_reduce"]
    step_s, block_s, lane_op_s, comm_service_s, comm_loaded_s = reference_times(raw)
    blocks = len(block_s)
    fit = fit_overhead(profile, world, "cuda" if cuda else "cpu", step_s, lane_op_s, comm_service_s, comm_loaded_s)
    profile.op_overhead, profile.kernel_overhead, bare_s = fit.op, fit.kernel, fit.bare_s
    profile.comm_under_load = fit.under_load
    profile.comm_overhead = fit.comm if fit.comm >= 0 else fit.op   # written out: the statement has no "unset"
    profile.scatter_overhead = fit.scatter if fit.scatter >= 0 else profile.comm_overhead
    import torch
    shape = comp["shape"]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    notes = [
        f"machine profile measured by `zdsl calibrate{' --quick' if s.quick else ''}` "
        f"on {platform.node() or 'this machine'}, {when}",
        f"torch {torch.__version__}, backend {backend}, {world} rank(s) measuring at once on {first['device']}, "
        f"{first['threads']} thread(s) per rank; each rate is the mean of the ranks' medians",
        f"  flops       {comp.get('measured', '')}width {shape['width']}, heads {shape['heads']}, "
        f"context {shape['context']}, batch {shape['batch']}, {comp['dtype']}",
        f"              (torch.mm alone at its shapes: {_num(mm)} flop/s"
        + (f"; {comp['block_note']})" if comp.get("block_note") else ")"),
        *([f"              the slope of its time over batch {', '.join(str(n) for n in comp['batches'])} "
            f"(kernels are charged apart; batch {shape['batch']}'s flops over its time: "
            f"{_num(comp['flops_at_batch'])} flop/s)"] if comp.get("batches") else []),
        f"  memory_bw   AdamW step on {first['optimizer']['adam_numel']} fp32 elements, "
        f"counted as 16 bytes each (moments, parameter, gradient)"
        + (": the device's; host_memory_bw the host's (runtime/offload/host_adam.py)" if cuda
           else ", the runtime's host step (runtime/offload/host_adam.py)"),
        f"  pcie        {first['copy']['copy_note']}"
        + (f"; h2d {_num(first['copy']['h2d'])} B/s, d2h {_num(first['copy']['d2h'])} B/s" if cuda else ""),
    ]
    if world > 1:
        c = first["collectives"]
        notes += [f"  link        all_gather (link, latency), reduce_scatter (scatter_*) and all_reduce (reduce_*) "
                  f"of {_size(c['sizes'][0])} to {_size(c['sizes'][-1])},",
                  "              each fitted to latency + payload*(n-1)/n / link (the runtime's own collectives)"]
    else:
        notes.append("  link        default (one rank: no collectives to measure)")
    notes.append(f"  cores       {_num(profile.cores)} per rank ({os.cpu_count()} cores, {world} rank(s)): "
                 "lanes running at once share them")
    notes.append(f"  comm_slots  {profile.comm_slots}: collectives the {backend} backend runs at once"
                 + (" (its worker threads)" if backend == "gloo" else " (one stream)"))
    if profile.comm_under_load:
        notes.append(f"  comm_under_load  {_num(profile.comm_under_load)}: the share of its rate a collective keeps "
                     "while compute fills the cores (the slope of each reference collective's time beyond its rate "
                     "against the time compute ran beside it)")
    notes.append(f"  overhead    per op run in a lane's thread and kernel_overhead per kernel a compute op dispatches "
                 "(the line through each one's time beyond its rated time against its kernels), "
                 "comm_overhead per collective (then fitted to the step) and scatter_overhead per reduce-scatter "
                 "(comm_overhead plus the median of what each took beyond its rated time less the other "
                 f"collectives' median), on a tiny ZeRO-3 GPT (width 64, 2 layers, {first['runtime'][0]['ops']} ops)")
    notes.append(f"              run by the executor: measured {step_s * 1e3:.1f} ms a step, of which its "
                 f"lane ops {sum(lane_op_s.values()) * 1e3:.1f} ms; rates alone predict {bare_s * 1e3:.1f} ms")
    notes.append(f"              (the median of {blocks} blocks of {len(first['runtime'][0]['steps'])} steps, "
                 f"spread over the calibration: {', '.join(f'{b * 1e3:.1f}' for b in block_s)} ms)")
    disk = first["disk"]
    notes.append(f"  disk        the runtime's swapper ({'O_DIRECT' if disk['direct'] else 'buffered: no O_DIRECT here'}, "
                 f"{_size(s.block)} requests, {s.depth} in flight) writing and reading "
                 f"{', '.join(_size(n) for n in disk['sizes'])} per rank, each direction fitted to "
                 "latency + bytes / rate")
    notes.append(f"              in {s.disk_folder or tempfile.gettempdir()}; disk_read_cpu, disk_write_cpu: "
                 f"1 - (a GPT block's forward+backward alone) / (beside back-to-back {_size(DISK_SIZES[2])} "
                 f"transfers): {disk['beside_compute']['alone_s'] * 1e3:.2f} ms alone, "
                 + ", ".join(f"{t * 1e3:.2f} beside {w}s" for w, t in disk['beside_compute']['beside_s'].items()))
    details = {"notes": notes, "ranks": raw, "backend": backend, "mm_flops": mm, "block_flops": block}
    return Calibration(profile, details)


def reference_times(raw: list[dict]) -> tuple[float, list[float], dict[int, float], dict[int, float],
                                               dict[int, float]]:
    """(reference step, each block's step, each lane op's seconds, each collective's service
    seconds, and of those the seconds a compute op ran beside it) from the ranks' runtime blocks.

    A step lasts as long as its slowest rank: a block's step is the median over its steps of the
    slowest rank's time, the figure `zdsl run --metrics` reports (its ``step_s``). The reference
    step is the median of the blocks' steps, so one block caught in a burst of outside load does
    not move it. A lane op's (or collective's) seconds: the mean over ranks of the median over
    blocks of its medians.
    """
    blocks = len(raw[0]["runtime"])
    block_s = [statistics.median(max(times) for times in zip(*(r["runtime"][b]["steps"] for r in raw)))
               for b in range(blocks)]

    def per_op(key: str) -> dict[int, float]:
        return {i: statistics.fmean(statistics.median(blk[key][i] for blk in r["runtime"]) for r in raw)
                for i in raw[0]["runtime"][0].get(key, {})}
    return (statistics.median(block_s), block_s, per_op("lane_op_s"), per_op("comm_service_s"),
            per_op("comm_loaded_s"))


def _cores_per_rank(world: int) -> float:
    """The rank's share of this machine's cores (what its lanes compete for)."""
    return round((os.cpu_count() or 1) / max(world, 1), 3)


def _size(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


def calibrate(backend: str = "auto", ranks: int = 2, disk_folder: str | None = None, quick: bool = False,
              progress: bool = True, **shape) -> Calibration:
    """Measure this machine with ``ranks`` processes; returns the profile and how it was measured.

    ``shape`` sets the model size the compute rate is measured at (width,
    heads, context, batch; default: the size of the CPU example programs, or
    GPT-2 small on CUDA) and the NVMe request size and depth (block, depth).
    ``disk_folder`` should be where NVMe swap files go.
    """
    import multiprocessing as mp

    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    s = Settings(ranks=ranks, backend=backend, disk_folder=disk_folder, quick=quick, **shape)
    from zdsl.runtime.dist.collectives import check_settings
    try:
        check_settings()
    except ValueError as e:
        raise CalibrationError(str(e)) from None
    if ranks < 1:
        raise CalibrationError("ranks must be at least 1")
    if backend not in ("auto", "gloo", "nccl"):
        raise CalibrationError(f"unknown backend {backend!r}: use gloo, nccl or auto")
    if disk_folder is not None and not os.path.isdir(disk_folder):
        raise CalibrationError(f"disk folder {disk_folder} does not exist")
    port = free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    children = [ctx.Process(target=_child, args=(r, ranks, port, s, errors), daemon=True)
                for r in range(1, ranks)]
    bar = Progress(SpinnerColumn(), TextColumn("calibrating [bold]{task.description}"), BarColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True, disable=not progress)
    threads_before = None
    try:
        with bar:
            task = bar.add_task("starting ranks", total=len(STEPS) + 1)
            for p in children:       # first, so they import torch while this process does
                p.start()
            import torch
            threads_before = torch.get_num_threads()
            chosen = _pick_backend(s)
            labels = {"compute": "compute (matmul, GPT block)", "optimizer": "memory (AdamW step)",
                      "copy": "host-device copies", "collectives": f"collectives ({chosen}, {ranks} ranks)",
                      "disk": "disk (O_DIRECT)", "runtime": "runtime (a tiny ZeRO-3 step, per-op cost)"}

            def report(step: str) -> None:
                bar.update(task, description=labels[step], advance=1)
            try:
                result = _run_rank(0, ranks, port, s, chosen, report)
            except Exception as e:
                cause = _child_errors(errors)
                if isinstance(e, CalibrationError) and not cause:
                    raise
                raise CalibrationError(f"rank 0: {type(e).__name__}: {e}" + (f"\n{cause}" if cause else "")) from None
            bar.update(task, description="done", advance=1)
        for p in children:
            p.join(timeout=s.timeout_s)
            if p.exitcode not in (0, None):
                raise CalibrationError(f"a rank failed after measuring:\n{_child_errors(errors)}")
    finally:
        if threads_before is not None:
            torch.set_num_threads(threads_before)
        for p in children:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return _summarise(result["ranks"], s, chosen, ranks)


def _child_errors(errors) -> str:
    lines = []
    try:
        while True:
            lines.append(errors.get(timeout=0.5))
    except Exception:
        pass
    return "\n".join(line for line in lines if "traceback" not in line.split("\n", 1)[0])


def shape_of_schedule(path: str) -> tuple[dict, int, str | None]:
    """(model shape and NVMe request settings, ranks, NVMe folder) of a schedule file."""
    from zdsl.check.checker import load_schedule
    from zdsl.lang.errors import ZsError
    try:
        schedule, _ = load_schedule(path)
    except ZsError as e:
        raise CalibrationError(f"{path}: {e}") from None
    except OSError as e:
        raise CalibrationError(f"cannot read {path}: {e.strerror}") from None
    shape: dict = {}
    if schedule.model.kind == "gpt":
        from zdsl.compile.units import GPT_DEFAULTS
        args = {**GPT_DEFAULTS, **schedule.model.args}
        shape.update(width=args["width"], heads=args["heads"], context=args["context"],
                     layers=args["layers"], vocab=args["vocab"])
    shape["batch"] = schedule.train.batch
    folder = None
    for placement in schedule.placement.values():
        if placement.tier == "nvme":
            shape.update(block=placement.block_bytes, depth=placement.queue_depth)
            folder = placement.path
    if folder and not os.path.isdir(folder):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            folder = None
    return shape, schedule.ranks, folder


def main(argv: list[str] | None = None) -> int:
    """``zdsl calibrate [--out machine.zs] [--quick]``; exit 0 on success, 2 on a stated failure."""
    ap = argparse.ArgumentParser(prog="zdsl calibrate",
                                 description="Measure this machine and write a `machine` profile for schedules.")
    ap.add_argument("--out", help="file to write (default: print the profile)")
    ap.add_argument("--quick", action="store_true", help="shorter, noisier measurements (< 15 s)")
    ap.add_argument("--ranks", type=int, default=None,
                    help="processes measuring at once (default: the schedule's ranks, else 2)")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    ap.add_argument("--disk", dest="disk_folder", default=None,
                    help="folder for the disk test: where NVMe offload will swap (default: temp folder)")
    for name in ("layers", "width", "heads", "vocab", "context", "batch"):
        ap.add_argument(f"--{name}", type=int, default=None, help=f"model {name} the compute rate is measured at")
    ap.add_argument("--schedule", metavar="FILE.zs",
                    help="measure at this schedule's model size, ranks and NVMe folder, block and depth")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    shape, ranks = {}, 2
    if a.schedule:
        try:
            shape, ranks, folder = shape_of_schedule(a.schedule)
        except CalibrationError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        a.disk_folder = a.disk_folder or folder
    a.ranks = ranks if a.ranks is None else a.ranks
    shape.update({k: getattr(a, k) for k in ("layers", "width", "heads", "vocab", "context", "batch")
                  if getattr(a, k) is not None})
    start = time.perf_counter()
    try:
        cal = calibrate(a.backend, a.ranks, a.disk_folder, a.quick, progress=not a.no_progress, **shape)
    except CalibrationError as e:
        print(f"error: calibration failed: {e}", file=sys.stderr)
        return 2
    text = cal.to_zs()
    if a.out:
        try:
            with open(a.out, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            print(f"error: cannot write {a.out}: {e.strerror}", file=sys.stderr)
            return 2
        print(f"{cal.machine_statement()}\nwrote {a.out} in {time.perf_counter() - start:.1f} s; "
              f"use it with: include \"{a.out}\"", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
