"""The measured trace on CUDA (``zdsl run --trace``): ops on a lane's stream carry device times
(CUDA events, runtime/exec/streams.py), host lanes host times. Each span begins before it ends, and a
lane that runs one op at a time (every lane but the collectives') never has two at once: on a
stream an op's start event is recorded after the previous op's end event. A collective's span
runs from its issue to the end of the stream's wait for it, so collectives issued back to back
overlap by design and are only checked for begin <= end."""
from __future__ import annotations

import json

import pytest
from cuda_suite import GPUS, SGD, write_schedule

pytestmark = pytest.mark.gpu
EPS_US = 1e-3          # the trace is in microseconds, summed from seconds: allow float rounding


@pytest.mark.parametrize("gpus", GPUS)
def test_device_times_are_ordered_within_each_lane(tmp_path, gpus):
    from test_run_cli import zdsl

    from zdsl.driver import compile_file
    schedule = write_schedule(tmp_path, ranks=gpus, stage=3, optimizer=SGD, offload="offload optimizer -> cpu")
    trace = tmp_path / "trace.json"
    proc, _ = zdsl("run", str(schedule), "--trace", str(trace), "--trace-steps", "2")
    assert proc.returncode == 0, proc.stderr
    graph = compile_file(str(schedule), {}, simulate=False).graph
    timed = [op for op in graph.ops if op.kind != "mem.free"]
    collective_lanes = {op.lane for op in graph.ops if op.kind.startswith("comm.")}
    events = json.loads(trace.read_text())["traceEvents"]
    lane_of = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    steps = sorted({e["args"]["step"] for e in spans})
    assert len(steps) == 2
    lanes: dict[tuple, list] = {}
    for e in spans:
        assert e["dur"] >= 0, e
        lanes.setdefault((e["pid"], lane_of[e["pid"], e["tid"]], e["args"]["step"]), []).append(e)
    for rank in range(gpus):
        ops = sorted((e["args"]["step"], e["args"]["op"]) for e in spans if e["pid"] == rank)
        assert ops == sorted((s, op.id) for s in steps for op in timed)       # each timed op once a step
    assert {lane for _, lane, _ in lanes} == {op.lane for op in timed}
    for (rank, lane, step), group in lanes.items():
        if lane in collective_lanes:
            continue
        group.sort(key=lambda e: (e["ts"], e["ts"] + e["dur"]))
        for before, after in zip(group, group[1:]):
            assert after["ts"] >= before["ts"] + before["dur"] - EPS_US, \
                f"rank {rank} step {step} lane {lane}: {before['name']} and {after['name']} overlap"
