"""The CUDA path's ordering decisions that can be checked on the CPU (issue 24's defects): which
device a step's clip coefficient is on, and that every free marks its tensors as used by the
freeing stream before their memory goes back (so a block allocated on another lane's stream is
not reused while this one still reads it). The GPU suite (tests/gpu/test_gpu_ordering.py) runs
the same paths on CUDA."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from zdsl.runtime.state.compute import StepPlan


def test_a_host_gradient_gets_the_host_copy_of_a_device_coefficient():
    # "meta" stands for a device the CPU gradient cannot be multiplied with
    plan = StepPlan(coef=torch.tensor(0.25).to("meta"), coef_host=torch.tensor(0.25))
    g = torch.ones(4)
    coef = plan.coef_for(g)
    assert coef.device.type == "cpu"
    g.mul_(coef)
    assert torch.equal(g, torch.full((4,), 0.25))
    assert plan.coef_for(torch.ones(1, device="meta")) is plan.coef      # a device step reads it in place
    assert StepPlan().coef_for(g) is None                                 # no clipping this step


def _gpt_rank(stage: int, clip=None, placement=None):
    """A 2-layer GPT's graph and one rank's state on the CPU."""
    from zdsl.driver import compile_schedule
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.sizing import units_for_user_model
    from zdsl.runtime.state.rank import RankState
    from zdsl.schedule import DataSpec, ModelSpec, OptimizerSpec, Schedule, TrainSpec
    spec = ModelSpec("gpt", dict(layers=2, width=16, heads=2, vocab=64, context=16))
    sched = Schedule(name="ordering", model=spec, data=DataSpec("synthetic", None, {"vocab": 64, "context": 16}),
                     train=TrainSpec(steps=1, batch=2, accumulate=1, precision="fp32", seed=0),
                     optimizer=OptimizerSpec(kind="sgd", lr=0.1, clip=clip), ranks=1, stage=stage,
                     placement=placement or {})
    graph = compile_schedule(sched, units_for_user_model(spec, 16))
    return sched, graph, RankState(graph, build_model(spec, seed=0), 0, 1, device="cpu")


def _run_step(sched, graph, state) -> None:
    from test_unit_protocol import _batches
    state.step_begin(0, _batches(sched, 0, 1))
    for op in graph.ops:
        state.run_op(op)


def test_the_step_plan_of_a_clipped_step_carries_a_host_coefficient(one_rank_group):
    sched, graph, state = _gpt_rank(1, clip=1e-3)      # small: the coefficient is below 1 and applies
    _run_step(sched, graph, state)
    plan = state.compute._plan
    state.step_end()
    assert plan.coef is not None and plan.coef_host is not None
    assert plan.coef_host.device.type == "cpu" and float(plan.coef_host) == float(plan.coef) < 1.0


def test_every_free_marks_its_tensors_on_the_freeing_stream_while_they_still_hold_memory(monkeypatch,
                                                                                        one_rank_group):
    from zdsl.runtime.state import buffers
    marked: list[tuple[int, int]] = []

    def recording(t):
        if isinstance(t, torch.Tensor):
            marked.append((id(t), t.untyped_storage().nbytes()))
    monkeypatch.setattr(buffers, "record_current_stream", recording)
    sched, graph, state = _gpt_rank(1)
    freed = []
    release = state.table.release

    def releasing(slot):
        if slot.tensor is not None and slot.tensor.untyped_storage().nbytes():
            freed.append((slot.buf.name, id(slot.tensor)))
        release(slot)
    monkeypatch.setattr(state.table, "release", releasing)
    _run_step(sched, graph, state)
    state.step_end()
    assert any(name.startswith("grad") for name, _ in freed), freed     # the case of the ZeRO-1 race
    marked_ids = {i for i, nbytes in marked if nbytes > 0}
    unmarked = [name for name, i in freed if i not in marked_ids]
    assert not unmarked, f"freed without marking the freeing stream first: {unmarked}"


class RecordingStreams:
    """The executor's LaneStreams seam on the CPU: runs every op directly and records the calls."""

    def __init__(self):
        self.calls: list[str] = []

    def begin_step(self):
        self.calls.append("begin_step")

    def end_step(self):
        self.calls.append("end_step")

    def device_times(self):
        self.calls.append("device_times")
        return {}

    def ordered(self, op):
        return contextlib.nullcontext()

    def on_lane(self, op):
        return contextlib.nullcontext()

    def record(self, op):
        pass


@pytest.mark.parametrize("traced", [True, False])
def test_a_step_on_lane_streams_ends_waiting_for_the_device_traced_or_not(one_rank_group, traced):
    import trio
    from test_unit_protocol import _batches
    from zdsl.runtime.exec.executor import Executor
    sched, graph, state = _gpt_rank(1)
    streams = RecordingStreams()
    executor = Executor(graph, state, 0, record=traced, streams=streams)
    state.step_begin(0, _batches(sched, 0, 1))
    trio.run(executor.run_step)
    state.step_end()
    # device_times waits for the device itself; an untraced step must wait all the same
    assert streams.calls == ["begin_step", "device_times" if traced else "end_step"]


def test_only_gloo_falls_back_to_an_all_reduce_when_reduce_scatter_is_unsupported(monkeypatch):
    from zdsl.runtime.dist import collectives

    def unsupported(*args, **kwargs):
        raise RuntimeError("reduce_scatter_tensor is not supported on this build")
    monkeypatch.setattr(collectives, "_backend", lambda group: "nccl")
    monkeypatch.setattr(collectives, "_reduce_scatter", unsupported)
    monkeypatch.setattr(collectives, "_no_native_reduce_scatter", set())
    with pytest.raises(RuntimeError, match="not supported"):
        collectives.reduce_scatter(torch.zeros(2), torch.zeros(4))
    assert collectives._no_native_reduce_scatter == set()       # NCCL not marked as lacking it


def test_a_host_buffer_is_pinned_on_cuda_unless_its_placement_says_pinned_false():
    from zdsl.ir import Buffer
    from zdsl.runtime.state.buffers import pins_host_memory
    cuda = torch.device("cuda", 0)
    host = Buffer("optim[0]@host", "optim", 0, "host", 8)
    assert pins_host_memory(host, cuda)
    assert not pins_host_memory(Buffer("optim[0]@host", "optim", 0, "host", 8, pinned=False), cuda)
    assert not pins_host_memory(host, torch.device("cpu"))                  # nothing to pin for
    assert not pins_host_memory(Buffer("optim[0]", "optim", 0, "device", 8), cuda)


@pytest.mark.parametrize("pinned", [True, False])
def test_the_rank_allocates_host_buffers_as_the_schedule_pins_them(monkeypatch, pinned):
    """The compiled graph's flag reaches the allocation (the rank's device taken for CUDA: on the
    CPU pinning is moot, so the allocation is recorded, not made pinned)."""
    from zdsl.runtime.state import buffers
    from zdsl.schedule import Placement
    sched, graph, state = _gpt_rank(1, placement={"optimizer": Placement(tier="cpu", pinned=pinned)})
    asked: list[bool] = []       # pin_memory of each torch.empty (pageable memory may come from elsewhere)
    empty = torch.empty

    def recording(*size, pin_memory=False, **kw):
        asked.append(pin_memory)
        return empty(*size, **kw)
    table = state.table
    slot = next(s for s in table.slots.values() if s.buf.tier == "host" and not s.live)
    monkeypatch.setattr(table, "device", torch.device("cuda", 0))
    monkeypatch.setattr(buffers.torch, "empty", recording)
    table.alloc(slot)
    monkeypatch.undo()
    assert slot.buf.pinned is pinned and slot.live and (True in asked) is pinned


# -- LaneStreams itself, on a fake CUDA (streams and events that record what is asked of them) --------------

class FakeEvent:
    def __init__(self, log, enable_timing=False, **kw):
        self.log, self.timing = log, enable_timing
        log.append(("event", self))

    def record(self, stream=None):
        pass

    def synchronize(self):
        self.log.append(("sync", self))

    def elapsed_time(self, other):
        return 1.0


class FakeStream:
    def __init__(self, log, device=None, **kw):
        self.log = log
        log.append(("stream", self))

    def wait_event(self, event):
        self.log.append(("wait", self, event))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream and event API, recording into a log (the ops themselves run on the CPU)."""
    log: list[tuple] = []
    current = FakeStream([])
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **kw: FakeStream(log, *a, **kw))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: FakeEvent(log, *a, **kw))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return log


def _step_on_lanes(graph, state, sched, streams, record):
    import trio
    from test_unit_protocol import _batches
    from zdsl.runtime.exec.executor import Executor
    executor = Executor(graph, state, 0, record=record, streams=streams)
    ran: list[int] = []
    run = executor._run_one

    def running(op):
        streams.log.append(("run", op.id))
        ran.append(op.id)
        run(op)
    executor._run_one = running
    state.step_begin(0, _batches(sched, 0, 1))
    record = trio.run(executor.run_step)
    state.step_end()
    return record


@pytest.mark.parametrize("timing", [True, False])
def test_ordering_events_are_timing_events_only_when_device_times_are_read(fake_cuda, one_rank_group, timing):
    from zdsl.runtime.exec.streams import LaneStreams
    sched, graph, state = _gpt_rank(1)
    streams = LaneStreams(graph, torch.device("cuda", 0), timing=timing)
    streams.log = fake_cuda
    record = _step_on_lanes(graph, state, sched, streams, record=timing)
    events = [e for kind, e, *_ in fake_cuda if kind == "event"]
    assert len(events) > len(graph.ops)                    # an end per op, a begin per device op, the origin
    assert {e.timing for e in events} == {timing}
    assert bool(record.timings) is timing
    if not timing:
        with pytest.raises(RuntimeError, match="without timing"):
            streams.device_times()


def test_one_stream_puts_every_device_lane_on_a_single_stream(fake_cuda, one_rank_group, monkeypatch):
    from zdsl.runtime.exec.streams import LaneStreams
    sched, graph, _ = _gpt_rank(1)
    device_lanes = {op.lane for op in graph.ops} - {"host", "nvme"}
    assert len(device_lanes) > 1
    assert len(LaneStreams(graph, torch.device("cuda", 0)).streams) == len(device_lanes)
    made = sum(kind == "stream" for kind, *_ in fake_cuda)
    assert made == len(device_lanes)
    monkeypatch.setenv("ZDSL_ONE_STREAM", "1")
    one = LaneStreams(graph, torch.device("cuda", 0))
    assert one.streams.keys() == device_lanes and len({id(s) for s in one.streams.values()}) == 1
    assert sum(kind == "stream" for kind, *_ in fake_cuda) == made + 1


def test_host_code_waits_for_the_asynchronous_copies_it_reads(fake_cuda, one_rank_group):
    """With the optimizer on the host, the host step reads gradient shards that copy.d2h wrote
    asynchronously (pinned): before the step runs, the host has waited on every such copy's event."""
    from zdsl.runtime.exec.streams import LaneStreams
    from zdsl.schedule import Placement
    sched, graph, state = _gpt_rank(2, placement={"optimizer": Placement(tier="cpu")})
    streams = LaneStreams(graph, torch.device("cuda", 0), timing=False)
    streams.log = fake_cuda
    _step_on_lanes(graph, state, sched, streams, record=False)
    event_op = {}
    synced: set[int] = set()
    checked = 0
    for entry in fake_cuda:
        if entry[0] == "sync":
            synced.add(event_op.get(id(entry[1]), -1))
        elif entry[0] == "run":
            op = graph.ops[entry[1]]
            for i, e in enumerate(streams.events):      # events recorded so far, by op
                if e is not None:
                    event_op.setdefault(id(e), i)
            if op.lane == "host" and op.kind == "compute.step":
                copies = [d for d in op.deps if graph.ops[d].kind == "copy.d2h"]
                assert copies and set(copies) <= synced, (op.id, copies, synced)
                checked += 1
    assert checked


def test_which_ops_run_host_code_on_a_device_lane():
    from zdsl.ir import Buffer, Op, TaskGraph
    from zdsl.runtime.exec.streams import host_side_ops
    bufs = {n: Buffer(n, k, 0, t, 8) for n, k, t in [("g", "grad_shard", "device"), ("g@host", "grad_shard", "host"),
                                                      ("norm", "norm", "device")]}
    ops = [Op(0, "copy.d2h", "d2h", 0, ["g"], ["g@host"]),
           Op(1, "copy.d2h", "d2h", 0, ["g"], ["g@host"], accumulate=True),      # adds on the CPU
           Op(2, "copy.h2d", "h2d", 0, ["g@host"], ["g"]),
           Op(3, "compute.norm", "compute", None, ["g@host"], ["norm"]),          # reads it on the CPU
           Op(4, "compute.step", "host", 0, ["g@host"], []),                      # host lane: waits anyway
           Op(5, "mem.free", "compute", 0, [], ["g@host"]),
           Op(6, "compute.norm", "compute", None, ["g"], ["norm"])]
    graph = TaskGraph("t", 1, 2, "fp32", 1, [], bufs, ops)
    assert host_side_ops(graph) == [False, True, False, True, False, False, False]


class _Like:
    """A tensor's device and pinning, for the copy decision (no pinned memory without CUDA)."""

    def __init__(self, where: str, pinned: bool = False):
        self.device, self.is_cuda, self._pinned = torch.device(where), where == "cuda", pinned

    def is_pinned(self):
        return self._pinned


@pytest.mark.parametrize("kind,accumulate,src,dst,expected", [
    ("copy.h2d", False, _Like("cpu", True), _Like("cuda"), True),
    ("copy.h2d", True, _Like("cpu", True), _Like("cuda"), True),      # the device adds, in stream order
    ("copy.h2d", False, _Like("cpu"), _Like("cuda"), False),          # pageable: synchronous
    ("copy.d2h", False, _Like("cuda"), _Like("cpu", True), True),
    ("copy.d2h", True, _Like("cuda"), _Like("cpu", True), False),     # adds on the CPU: needs the bytes now
    ("copy.d2h", False, _Like("cuda"), _Like("cpu"), False),
    ("copy.h2d", False, _Like("cpu"), _Like("cpu"), False),           # a CPU rank
])
def test_a_copy_is_asynchronous_exactly_between_the_device_and_pinned_memory(kind, accumulate, src, dst, expected):
    from zdsl.ir import Op
    from zdsl.runtime.state.transfers import copies_asynchronously
    op = Op(0, kind, kind[5:], 0, ["a"], ["b"], accumulate=accumulate)
    assert copies_asynchronously(op, src, dst) is expected


@pytest.mark.parametrize("local_world,omp,expected", [("2", None, 4), ("3", None, 2), ("16", None, 1),
                                                       ("2", "5", None)])
def test_a_cuda_rank_gives_its_host_step_its_share_of_the_cores(monkeypatch, local_world, omp, expected):
    import os
    from zdsl.runtime.offload.host_adam import limit_host_threads
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    try:
        got = limit_host_threads(0, int(local_world))
        assert got == torch.get_num_threads() == (before if expected is None else expected)
    finally:
        torch.set_num_threads(before)


def test_on_cuda_the_meter_reports_the_allocators_bytes_beside_the_logical_ones(monkeypatch):
    from zdsl.runtime.state.memory import MemoryMeter
    held = {"memory_allocated": 100, "max_memory_allocated": 300, "memory_reserved": 512, "max_memory_reserved": 1024}
    for name, value in held.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, value=value: value)
    meter = MemoryMeter(torch.device("cuda", 0))
    meter.hold("param_full[0]", "device", "param_full", "parameters", 64)
    report = meter.report()
    assert report["peak"] == {"device": 64}
    assert report["allocator"] == {"allocated": 100, "peak_allocated": 300, "reserved": 512, "peak_reserved": 1024}
    assert "allocator" not in MemoryMeter(torch.device("cpu")).report()


def test_a_cuda_ranks_metrics_row_carries_the_allocators_peaks(one_rank_group):
    from zdsl.runtime.exec.executor import StepRecord
    from zdsl.runtime.run.train import gather_metrics

    class Rank:
        rank = 0

        def __init__(self, allocator):
            self.allocator = allocator

        def memory_report(self):
            report = {"peak": {"device": 64, "host": 8}}
            return {**report, "allocator": self.allocator} if self.allocator else report
    allocator = {"allocated": 1, "peak_allocated": 300, "reserved": 2, "peak_reserved": 1024}
    overlap = SimpleNamespace(lower_bound=0.25, efficiency=0.5, to_metrics=lambda: {})
    m = gather_metrics(0, StepRecord(0.5), {"loss": 1.0}, Rank(allocator), 1, torch.device("cpu"), tokens=4,
                       overlap=overlap)
    assert m.overlap["lower_bound_s"] == 0.25 and m.loss == 1.0
    assert m.peak_bytes == {0: {"device": 64, "host": 8, "nvme": 0, "device_allocated": 300,
                                "device_reserved": 1024}}
    m = gather_metrics(0, StepRecord(0.5), {"loss": 1.0}, Rank(None), 1, torch.device("cpu"), tokens=4)
    assert m.peak_bytes == {0: {"device": 64, "host": 8, "nvme": 0}}       # a CPU rank's row as before


def test_torchs_cuda_sanitizer_sees_the_ops_of_every_lane_thread(fake_cuda, monkeypatch):
    """Dispatch modes are per thread: the sanitizer TORCH_CUDA_SANITIZER enables in the main thread
    would miss every op a lane's worker thread runs, unless the lanes join it."""
    import sys
    import threading
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
    from zdsl.ir import Op
    from zdsl.runtime.exec.streams import LaneStreams
    seen: list[tuple[str, str]] = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((threading.current_thread().name, func.__name__))
            return func(*args, **(kwargs or {}))
    sanitizer = SimpleNamespace(cuda_sanitizer=SimpleNamespace(enabled=True, dispatch=Recording()))
    monkeypatch.setitem(sys.modules, "torch.cuda._sanitizer", sanitizer)
    sched, graph, _ = _gpt_rank(0)
    streams = LaneStreams(graph, torch.device("cuda", 0))
    device_op = next(op for op in graph.ops if op.lane == "compute")
    host_op = Op(len(graph.ops), "compute.step", "host", 0)
    streams.lane_of.append("host")
    streams.host_side.append(False)
    streams.events.append(None)
    streams.begins.append(None)
    left: list[int] = []

    def lane():
        for op in (device_op, host_op):
            with streams.ordered(op):
                torch.ones(2).mul_(3)
        with streams.on_lane(device_op):
            torch.ones(2).add_(1)
        left.append(len(_get_current_dispatch_mode_stack()))
    thread = threading.Thread(target=lane, name="lane")
    thread.start()
    thread.join()
    assert [name for thread_name, name in seen if thread_name == "lane"] == ["ones.default", "mul_.Tensor"] * 2 + \
        ["ones.default", "add_.Tensor"]
    assert left == [0]                     # the thread's mode stack as it was
    sanitizer.cuda_sanitizer.enabled = False
    seen.clear()
    with streams.ordered(device_op):
        torch.ones(2)
    assert not seen


@pytest.mark.parametrize("program", ["offload_optimizer.zs", "nvme.zs", "capacity.zs"])
def test_host_code_depends_on_every_asynchronous_copy_of_the_host_buffers_it_touches(program):
    """The host waits only for its ops' dependencies' events, so the graph must order host code
    after every copy that wrote a host buffer it reads (RAW: copy.d2h) and after every copy still
    reading a host buffer it overwrites (WAR: copy.h2d; an NVMe read or the host step rewriting a
    buffer while it is copied up, or a host lane's free releasing it: torch's pinned allocator
    would hold the block back, but the graph already orders the free after the copy)."""
    from pathlib import Path
    from zdsl.driver import compile_file
    from zdsl.runtime.exec.streams import host_side_ops
    path = Path(__file__).parents[2] / "programs" / program
    overrides = {"model.layers": "2"} if program == "capacity.zs" else {}
    graph = compile_file(str(path), overrides, simulate=False).graph
    host_side = host_side_ops(graph)
    on_host = {n for n, b in graph.buffers.items() if b.tier == "host"}
    last_copy_write: dict[str, int] = {}
    copy_readers: dict[str, list[int]] = {}
    checked = {"raw": 0, "war": 0}
    for op in graph.ops:
        if op.lane in ("host", "nvme") or host_side[op.id]:
            for name in set(op.reads) & on_host:
                if name in last_copy_write:
                    assert last_copy_write[name] in op.deps, (op.id, op.kind, name, "reads before the copy wrote it")
                    checked["raw"] += 1
            for name in set(op.writes) & on_host:
                missing = [r for r in copy_readers.get(name, ()) if r not in op.deps]
                assert not missing, (op.id, op.kind, name, "overwrites or frees while copies read it", missing)
                checked["war"] += bool(copy_readers.get(name))
        for name in op.writes:
            last_copy_write.pop(name, None)
            copy_readers[name] = []
            if op.kind == "copy.d2h":
                last_copy_write[name] = op.id
        if op.kind == "copy.h2d":
            for name in set(op.reads) & on_host:
                copy_readers.setdefault(name, []).append(op.id)
    assert checked["raw"] and checked["war"], checked


@pytest.mark.parametrize("pinned,pin", [(True, None), (False, False)])
def test_an_nvme_placements_pinned_option_reaches_the_swappers_staging_pool(monkeypatch, tmp_path, pinned, pin):
    """None: the pool's default, pinned exactly where CUDA is present (runtime/io/aligned.py)."""
    from zdsl.runtime.offload import swap
    from zdsl.runtime.state.transfers import Transfers
    made = {}
    monkeypatch.setattr(swap, "Swapper", lambda folder, block, depth, **kw: made.update(kw) or "swapper")
    config = {"placement": {"optimizer": {"tier": "nvme", "paths": [str(tmp_path)], "pinned": pinned,
                                          "block_bytes": 1 << 16, "queue_depth": 4}}}
    assert Transfers(SimpleNamespace(rank=0), config).swapper_of("optim[0]@nvme") == "swapper"
    assert made == {"pin": pin}
