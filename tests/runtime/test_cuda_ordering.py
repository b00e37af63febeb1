"""The CUDA path's ordering decisions that can be checked on the CPU (issue 24's defects): which
device a step's clip coefficient is on, and that every free marks its tensors as used by the
freeing stream before their memory goes back (so a block allocated on another lane's stream is
not reused while this one still reads it). The GPU suite (tests/gpu/test_gpu_ordering.py) runs
the same paths on CUDA."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from zdsl.runtime.state.compute import StepPlan


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank: ZeRO-1's reduce-scatter runs (and allocates the shard it frees)."""
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
    from zdsl.runtime.models.sizing import units_for_user_model
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
    asked: dict[str, bool] = {}
    empty = torch.empty

    def recording(*size, pin_memory=False, **kw):
        asked["pin_memory"] = pin_memory
        return empty(*size, **kw)
    table = state.table
    slot = next(s for s in table.slots.values() if s.buf.tier == "host" and not s.live)
    monkeypatch.setattr(table, "device", torch.device("cuda", 0))
    monkeypatch.setattr(buffers.torch, "empty", recording)
    table.alloc(slot)
    monkeypatch.undo()
    assert slot.buf.pinned is pinned and asked == {"pin_memory": pinned}
