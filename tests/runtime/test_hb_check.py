"""The CPU happens-before checker (runtime/exec/hb_check.py): the CUDA path's stream ordering,
checked on a CPU run as if on a GPU. It finds the ZeRO-1 race commit 0a8a67d fixed (a gradient
shard freed on the compute stream went back to the comm stream's pool without record_stream) in a
saved ZeRO-1 graph, finds a race when a cross-lane dependency is dropped, and finds none in the
test schedules (stages 0-3, offload, NVMe, accumulation, clipping, fp16, bf16)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zdsl.ir import TaskGraph
from zdsl.runtime.exec.hb_check import HBRaceError
from zdsl.runtime.run.hb_steps import check_steps
from zdsl.schedule import DataSpec, ModelSpec, OptimizerSpec, Schedule, TrainSpec

ZERO1_GRAPH = Path(__file__).parent.parent / "data" / "zero1_race_graph.json"


def _zero1():
    """The saved ZeRO-1 graph (a 2-layer GPT, one rank) and the schedule it was compiled from."""
    spec = ModelSpec("gpt", dict(layers=2, width=16, heads=2, vocab=64, context=16))
    sched = Schedule(name="zero1_race", model=spec, data=DataSpec("synthetic", None, {"vocab": 64, "context": 16}),
                     train=TrainSpec(steps=1, batch=2, accumulate=1, precision="fp32", seed=0),
                     optimizer=OptimizerSpec(kind="sgd", lr=0.1, clip=None), ranks=1, stage=1)
    graph = TaskGraph.from_json(ZERO1_GRAPH.read_text())
    # the case: a gradient shard the reduce-scatter writes (comm lane), freed on the compute lane
    freed_on_compute = {n for op in graph.ops if op.kind == "mem.free" and op.lane == "compute" for n in op.writes}
    assert any(op.kind == "comm.reduce_scatter" and op.writes[0] in freed_on_compute for op in graph.ops)
    return graph, sched


def test_the_zero1_race_before_its_fix_is_reported_naming_the_shard_the_reduce_scatter_and_the_step(
        one_rank_group):
    graph, sched = _zero1()
    with pytest.raises(HBRaceError) as caught:
        check_steps(graph, sched, steps=2, record_streams=False)    # the free path before 0a8a67d
    text = str(caught.value)
    assert text.startswith("rank 0: happens-before check:"), text
    assert "grad_shard[" in text and "comm.reduce_scatter" in text and "compute.step" in text, text
    assert "without recording the compute stream" in text and "pool of the comm stream" in text, text


def test_the_zero1_graph_with_the_fix_has_no_race(one_rank_group):
    graph, sched = _zero1()
    checker = check_steps(graph, sched, steps=2)
    assert checker.clocks.races == []
    assert checker.step == 1


def test_dropping_a_cross_lane_dependency_is_reported(one_rank_group):
    """The executor runs the real graph (the CPU needs its order); the checker orders by a copy
    whose step no longer waits for the reduce-scatter that wrote its gradient shard."""
    graph, sched = _zero1()
    mutated = TaskGraph.from_json(graph.to_json())
    step = next(op for op in mutated.ops if op.kind == "compute.step")
    scatter = next(d for d in step.deps if mutated.ops[d].kind == "comm.reduce_scatter")
    step.deps = [d for d in step.deps if d != scatter]
    with pytest.raises(HBRaceError) as caught:
        check_steps(graph, sched, seen_as=mutated)
    text = str(caught.value)
    shard = mutated.ops[scatter].writes[0]
    assert f"{shard}: op #{scatter} comm.reduce_scatter" in text and "writes it" in text, text
    assert f"op #{step.id} compute.step" in text and "reads it on the compute stream" in text, text


SCHEDULE = """schedule hb "happens-before check"
model     gpt(layers=2, width=32, heads=2, vocab=256, context=16)
data      corpus("stdlib", context=16)
train     steps=2, batch=2, accumulate={accumulate}, precision={precision}, seed=0
optimizer adamw(lr=1e-3{clip})
ranks     1 on cpu
zero      {stage}
{extra}
"""

CASES = {
    "stage0": dict(stage=0),
    "stage1": dict(stage=1),
    "stage2": dict(stage=2),
    "stage3": dict(stage=3),
    "offload_optimizer": dict(stage=2, extra="offload optimizer -> cpu"),
    "nvme": dict(stage=3, extra='offload parameters -> nvme("{nvme}", block=64KiB, depth=4)\n'
                               'offload optimizer -> nvme("{nvme}", block=64KiB, depth=4)'),
    "accumulate": dict(stage=2, accumulate=2),
    "clip": dict(stage=3, clip=", clip=0.01"),
    "fp16": dict(stage=3, precision="fp16", clip=", clip=1.0"),
    "bf16": dict(stage=1, precision="bf16", clip=", clip=1.0"),
    "offload_clip_bf16": dict(stage=3, precision="bf16", clip=", clip=0.01", extra="offload optimizer -> cpu"),
}


def compile_case(tmp_path: Path, stage=0, accumulate=1, precision="fp32", clip="", extra=""):
    from zdsl.driver import compile_file
    text = SCHEDULE.format(stage=stage, accumulate=accumulate, precision=precision, clip=clip,
                           extra=extra.format(nvme=tmp_path / "nvme"))
    path = tmp_path / "hb.zs"
    path.write_text(text)
    compiled = compile_file(str(path), None, simulate=False)
    assert compiled.ok, [d.message for d in compiled.diagnostics]
    return compiled


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_test_schedules_have_no_race_as_if_on_cuda(tmp_path, one_rank_group, case):
    compiled = compile_case(tmp_path, **CASES[case])
    checker = check_steps(compiled.graph, compiled.schedule, steps=2)
    assert checker.clocks.races == []
    assert checker.step == 1
    # not vacuous: every lane's accesses were stamped (host lanes' NVMe and AdamW through the hook;
    # a collective's on NCCL's stream)
    lanes = {op.lane for op in compiled.graph.ops if op.kind != "mem.free"} - {"comm"}
    assert all(checker.clocks.of(lane)[lane] > 0 for lane in lanes), checker.clocks.clock
    if any(op.is_collective for op in compiled.graph.ops):
        assert checker.clocks.of("nccl")["nccl"] > 0


def test_host_accesses_outside_aten_are_stamped_only_while_a_checker_runs(tmp_path, one_rank_group):
    """An NVMe read writes its output with no aten op: the hook stamps it on the caller's lane."""
    from zdsl.runtime.io import host_access
    from zdsl.runtime.exec.hb_check import HBChecker
    from zdsl.runtime.offload.swap import Swapper
    assert host_access.observer is None
    graph, _ = _zero1()
    seen = []
    with Swapper(tmp_path / "swap", 4096, 2) as swapper:
        swapper.write_sync("x", torch.ones(1024))
        out = torch.empty(1024)
        with HBChecker(graph) as checker:
            checker.stamp_host = lambda reads, writes: seen.append((list(reads), list(writes)))
            host_access.observer = checker.stamp_host
            swapper.read_sync("x", out)
        assert host_access.observer is None
        swapper.read_sync("x", out)
    assert len(seen) == 1 and seen[0][0] == [] and seen[0][1][0] is out


def test_a_run_uses_the_checker_only_when_asked_and_only_on_the_cpu(monkeypatch):
    from zdsl.runtime.exec.hb_check import HBChecker
    from zdsl.runtime.exec.hb_check import run_streams
    graph, _ = _zero1()
    monkeypatch.delenv("ZDSL_HB_CHECK", raising=False)
    with run_streams(graph, torch.device("cpu"), None, 0) as streams:
        assert streams is None                          # a plain CPU run: no seam at all
    monkeypatch.setenv("ZDSL_HB_CHECK", "1")
    with run_streams(graph, torch.device("cpu"), None, 0) as streams:
        assert isinstance(streams, HBChecker)
    with pytest.raises(ValueError, match="rank 1: ZDSL_HB_CHECK=1 checks .* on a CPU run"):
        with run_streams(graph, torch.device("cuda", 0), None, 1):
            pass


def test_the_checker_keeps_the_lane_streams_timing_contract(monkeypatch):
    """As LaneStreams: the run's ``timing`` reaches the seam, and device times are refused while it is off."""
    from zdsl.runtime.exec.hb_check import run_streams
    graph, _ = _zero1()
    monkeypatch.setenv("ZDSL_HB_CHECK", "1")
    with run_streams(graph, torch.device("cpu"), None, 0, timing=False) as streams:
        assert streams.timing is False
        with pytest.raises(RuntimeError, match="without timing events"):
            streams.device_times()
        streams.timing = True                       # zdsl run turns it on for a timed step
        assert streams.device_times() == {}
    with run_streams(graph, torch.device("cpu"), None, 0) as streams:
        assert streams.timing is True


def test_the_callers_work_before_the_step_races_when_the_lanes_do_not_wait_for_the_default_stream(
        monkeypatch, one_rank_group):
    """What begin_step's wait on the default stream is for: the micro-batches the caller made."""
    from zdsl.runtime.exec.hb_check import HBChecker
    begin = HBChecker.begin_step

    def no_wait(self):
        begin(self)
        for lane in set(self.lane_of):
            self.clocks.of(lane).pop("default", None)
    monkeypatch.setattr(HBChecker, "begin_step", no_wait)
    graph, sched = _zero1()
    with pytest.raises(HBRaceError, match=r"the caller's work around the step \(default stream\)"):
        check_steps(graph, sched)
