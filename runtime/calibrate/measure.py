"""The microbenchmarks of ``zdsl calibrate``, each run on every rank at once: compute, the host
AdamW step, copies, collectives and the disk, measured the way the planner uses each rate."""
from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from dataclasses import dataclass

from zdsl.model.units import gpt_units
from zdsl.planner.calibration_fit import fit_latency_bandwidth
from zdsl.schedule import Placement

MiB = 1 << 20


class CalibrationError(RuntimeError):
    """Calibration could not run or a measurement failed (said in words)."""


@dataclass
class Settings:
    """What to measure and how long; ``quick`` trades precision for time (about 30 s on 2 cores)."""
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
    precision: str = "fp32"          # the schedule's train precision: what a CPU's compute runs in
    block: int = Placement.block_bytes   # NVMe I/O size and requests in flight: the schedule's defaults
    depth: int = Placement.queue_depth
    timeout_s: float = 60.0
    usual_reference_s: float | None = None   # this machine's usual reference step (its cached calibrations')

    def budget(self, full: float, quick: float) -> float:
        return quick if self.quick else full


def _sync_for(device):
    import torch
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _median_time(fn, sync, budget_s: float, min_reps: int = 3, max_reps: int = 1000) -> float:
    """Median seconds of ``fn`` after one warm-up, repeated for about ``budget_s``."""
    fn()
    sync()
    return statistics.median(_times(fn, budget_s, min_reps, max_reps, sync))


def _times(fn, seconds: float, min_reps: int = 1, max_reps: int | None = None, sync=lambda: None) -> list[float]:
    """Seconds of each call of ``fn`` (and ``sync`` after it), called back to back for about ``seconds``:
    at least ``min_reps`` calls, at most ``max_reps``."""
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_reps or (time.perf_counter() < deadline and (max_reps is None or len(times) < max_reps)):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


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


def compute_dtype(device, precision: str):
    """The dtype the compute rate is measured in: bf16 on CUDA (what its schedules train in); on a
    CPU the schedule's precision, since a bf16 step there runs 2-3x the fp32 rate where the CPU
    has bf16 instructions (avx512_bf16) and far below it where it has none."""
    import torch
    if device.type == "cuda" or precision == "bf16":
        return torch.bfloat16
    return torch.float32


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
        from zdsl.runtime.models.gpt import GPT, Block
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


# The compute-rate table (zdsl.sim.rates prices a unit at its precision's rate, interpolated at
# its width): widths, sequences per batch at each (fewer at the largest, to keep a quick calibration
# short) and precisions. fp16 on a CPU runs a fallback kernel, orders of magnitude below bf16: not
# measured there, a schedule in it is told so by zdsl plan.
TABLE_WIDTHS = {"cpu": (64, 512, 2048), "cuda": (768, 2048, 4096)}
TABLE_PRECISIONS = {"cpu": ("fp32", "bf16"), "cuda": ("fp32", "bf16", "fp16")}
TABLE_CONTEXT = {"cpu": 32, "cuda": 512}


def table_batch(kind: str, width: int) -> int:
    """Sequences per batch of the table's measurement at ``width`` on a ``cpu`` or ``cuda`` device."""
    return (2 if width >= 1024 else 4) if kind == "cpu" else 8


def measure_compute_table(device, s: Settings, fixed_s: float = 0.0, known: dict | None = None) -> dict:
    """A GPT block's forward+backward rate at each width of ``TABLE_WIDTHS`` in each precision of
    ``TABLE_PRECISIONS``: one batch's flops over its time less ``fixed_s``, the block's kernels'
    fixed cost (:func:`measure_compute`'s intercept on CPU, which the planner charges apart as
    ``kernel_overhead``; at most half the time). Not the slope over batch sizes that gives
    ``flops``: at width 2048 a matrix product of 64 rows runs far below one of 128, so the slope
    prices large units far too fast.
    ``known``: rates already measured at this shape, by (precision, width)."""
    import torch

    from zdsl.runtime.models.gpt import Block
    from zdsl.runtime.state.precision import DTYPES
    kind = "cpu" if device.type == "cpu" else "cuda"
    widths, context = TABLE_WIDTHS[kind], TABLE_CONTEXT[kind]
    sync = _sync_for(device)
    budget = s.budget(0.5, 0.15)
    out: dict = {"widths": list(widths), "context": context,
                 "batches": [table_batch(kind, w) for w in widths], "fixed_s": fixed_s}
    for precision in TABLE_PRECISIONS[kind]:
        dtype = DTYPES[precision]
        rates = []
        for width in widths:
            if known and (precision, width) in known:
                rates.append(known[(precision, width)])
                continue
            torch.manual_seed(0)
            heads = max(1, width // 64)
            block = Block(width, heads).to(device=device, dtype=dtype)
            b = table_batch(kind, width)
            flops = 3.0 * gpt_units(1, width, heads, 256, context)[1].fwd_flops_per_seq * b
            t = _median_time(_block_fwd_bwd(block, b, context, width), sync, budget)
            rates.append(flops / max(t - fixed_s, t / 2))
            del block
        out[precision] = rates
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
    # 8M elements (128 MiB of state) even when quick: a step's shard is far larger than the
    # last-level cache, and a 16 MiB state would stay in it and price the step several times fast.
    n = 8 << 20
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
    """Host<->device copy rate (pinned) on CUDA; a plain memory copy on CPU, of 64 MiB even
    when quick: the copies it prices (a one-rank collective's payload) are larger than the
    last-level cache, which holds a 16 MiB copy and would price it too fast."""
    import torch
    n = (16 if s.quick and device.type == "cuda" else 64) * MiB
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
# sizes a schedule moves, a transfer's fixed cost is much of its time (a MiB-sized shard's read
# takes several times its streaming time), so the sizes span both sides of it.
DISK_SIZES = (256 << 10, 1 * MiB, 4 * MiB, 16 * MiB)


MIN_DISK_CPU = 0.01     # a share of a core: noise can make compute beside a transfer faster


def _io_buffers(size: int):
    """Random bytes to write and a buffer to read them back into, both 4 KiB aligned as the
    run's host-pool buffers are (huge pages from 2 MiB): the swapper moves such a tensor's blocks
    in place, a smaller one's through its staging pool, as in a run."""
    import torch

    from zdsl.runtime.io.aligned import aligned_empty
    data = aligned_empty(size)
    data.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    return data, aligned_empty(size)


# Rounds of the disk test: each round times every size in both directions (a slice of the budget
# each), and a size's time is the median over all its rounds' transfers, so that a burst of outside
# load spreads over the sizes instead of bending the fitted rate through one of them; the CPU share
# beside compute likewise, in rounds of alone, beside reads, beside writes. Quick: 3 rounds, full: 4.
DISK_ROUNDS = {True: 3, False: 4}


def measure_disk(folder: str, s: Settings, rank: int, barrier=lambda: None, beside: bool = True) -> dict:
    """The runtime's own swapper (``runtime/offload/swap.py``: ``block``-sized direct-I/O requests, up to
    ``depth`` in flight, every block checksummed) writing then reading transfers of several
    sizes from a plain thread, as a lane does, in ``DISK_ROUNDS`` interleaved rounds; each
    direction fitted to ``latency + bytes / rate`` through each size's median time.
    Then the share of the rank's core a transfer takes from compute beside it
    (:func:`_disk_beside_compute`; not with ``beside`` False). ``barrier`` keeps the ranks at the
    same size and direction, as they share the disk in a run."""
    import torch

    from zdsl.runtime.offload.swap import SwapError, Swapper
    sizes = DISK_SIZES[:-1] if s.quick else DISK_SIZES
    rounds = DISK_ROUNDS[s.quick]
    slice_s = s.budget(0.4, 0.1) / rounds
    where = os.path.join(folder, f".zdsl-calibrate-{os.getpid()}-{rank}")
    times: dict[str, dict[int, list[float]]] = {"write": {n: [] for n in sizes}, "read": {n: [] for n in sizes}}
    direct = True
    try:
        with Swapper(where, s.block, s.depth) as swapper:
            buffers = {size: _io_buffers(size) for size in sizes}
            for size, (data, out) in buffers.items():     # each file made and read once: the warm-up
                name = f"transfer-{size}"
                swapper.reserve({name: size})
                swapper.write_sync(name, data)
                direct = direct and swapper.direct(name)
                swapper.read_sync(name, out)
            for _ in range(rounds):
                for size, (data, out) in buffers.items():
                    name = f"transfer-{size}"
                    barrier()
                    times["write"][size] += _times(lambda: swapper.write_sync(name, data), slice_s)
                    barrier()
                    times["read"][size] += _times(lambda: swapper.read_sync(name, out), slice_s)
            for size, (data, out) in buffers.items():
                if not torch.equal(out, data):
                    raise CalibrationError(f"disk test in {folder}: a read returned other bytes than were written")
                swapper.discard(f"transfer-{size}")
            del buffers
            barrier()
            cpu = _disk_beside_compute(swapper, s) if beside else {"read": 0.0, "write": 0.0}
    except SwapError as e:
        raise CalibrationError(f"disk test in {folder} failed: {e}") from None
    finally:
        shutil.rmtree(where, ignore_errors=True)
    points: dict[str, list[tuple[float, float]]] = {
        way: [(size, statistics.median(ts)) for size, ts in by_size.items()] for way, by_size in times.items()}
    result = {"direct": direct, "sizes": list(sizes), "points": points, "rounds": rounds, "beside_compute": cpu}
    for way in ("read", "write"):
        latency, rate = fit_latency_bandwidth(points[way])
        result.update({f"disk_{way}": rate, f"disk_{way}_latency": latency, f"disk_{way}_cpu": cpu[way]})
    return result


def _disk_beside_compute(swapper, s: Settings) -> dict:
    """How much of the core a disk transfer takes from compute: a GPT block's forward+backward
    on the host alone, then beside back-to-back reads, then beside writes, in ``DISK_ROUNDS``
    rounds and alone once more after the last; a round's share is ``1 - alone / beside`` with
    ``alone`` the mean of the alone times on either side of it, and each direction's share the
    median of its rounds' (load from outside that moves between rounds cancels in a round's
    ratio; zdsl.sim.simulate.transfer_demand turns it into the cores a transfer needs). The
    swapper's threads make system calls for each request and checksum each block; on one core
    they do not keep their rate beside compute, and a transfer beside a block's forward+backward
    takes up to a few times its time alone."""
    import torch

    from zdsl.runtime.models.gpt import Block
    shape = _model_shape(s, torch.device("cpu"))
    fwd_bwd = _block_fwd_bwd(Block(shape["width"], shape["heads"]), shape["batch"], shape["context"], shape["width"])
    data, out = _io_buffers(DISK_SIZES[2])
    swapper.write_sync("beside", data)
    rounds = DISK_ROUNDS[s.quick]
    # the time of four slices (alone, reads, writes, alone) spread over 3 per round and a last one
    slice_s = 4 * s.budget(0.5, 0.15) / (3 * rounds + 1)
    transfers = {"read": lambda: swapper.read_sync("beside", out), "write": lambda: swapper.write_sync("beside", data)}

    def beside_transfer(transfer) -> float:
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
            return statistics.median(_times(fwd_bwd, slice_s, min_reps=2))
        finally:
            stop.set()
            thread.join()
            if failed:                                 # else compute "beside" it ran alone
                raise failed[0]

    fwd_bwd()                                          # warm-up
    alone = [statistics.median(_times(fwd_bwd, slice_s, min_reps=2))]
    beside: dict[str, list[float]] = {way: [] for way in transfers}
    for _ in range(rounds):
        for way, transfer in transfers.items():
            beside[way].append(beside_transfer(transfer))
        alone.append(statistics.median(_times(fwd_bwd, slice_s, min_reps=2)))
    swapper.discard("beside")
    shares = {way: statistics.median(1.0 - (a0 + a1) / 2 / t for a0, a1, t in zip(alone, alone[1:], ts))
              for way, ts in beside.items()}
    return {way: min(1.0, max(MIN_DISK_CPU, share)) for way, share in shares.items()} | \
        {"alone_s": statistics.median(alone), "beside_s": {way: statistics.median(ts) for way, ts in beside.items()},
         "rounds": rounds}
