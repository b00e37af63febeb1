"""`zdsl run` end to end, as a user runs it: processes per rank, gloo, the CLI's messages.

Also the promises about failure: a rank that raises, dies or hangs stops every
rank with a message naming the rank and the op, in bounded time; a schedule
launched at the wrong rank count fails before any collective.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

ROOT = Path(__file__).parents[2]
QUICK = str(ROOT / "programs" / "quickstart.zs")


def zdsl(*args, env=None, timeout=240):
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("RANK", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One run of the quickstart that the checks of training, export, trace, timeline and output folders
    share (each a start of 2 ranks otherwise): 12 steps, its metrics into a folder not made yet, the
    export, a trace of the last 2 steps and its timeline."""
    folder = tmp_path_factory.mktemp("trained")
    out = dict(metrics=folder / "not" / "yet" / "m.jsonl", export=folder / "model.safetensors",
               trace=folder / "t.json", svg=folder / "t.svg")
    proc, _ = zdsl("run", QUICK, "--set", "steps=12", "--metrics", str(out["metrics"]), "--export", str(out["export"]),
                   "--trace", str(out["trace"]), "--trace-steps", "2", "--timeline", str(out["svg"]))
    return proc, out


def test_quickstart_trains_and_exports(trained):
    proc, out = trained
    metrics, export = out["metrics"], out["export"]
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(12))
    losses = [m["loss"] for m in lines]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    assert set(lines[0]["peak_bytes"]) == {"0", "1"} and lines[0]["peak_bytes"]["0"]["device"] > 0
    assert "Traceback" not in proc.stderr
    # the export loads into the model with plain torch and safetensors
    import torch
    from safetensors.torch import load_file
    from zdsl.runtime.models.gpt import GPT
    model = GPT(layers=2, width=64, heads=4, vocab=256, context=32)
    model.load_state_dict(load_file(str(export)), strict=True)
    idx = torch.zeros(1, 8, dtype=torch.long)
    assert torch.isfinite(model(idx, idx))


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_failing_rank_stops_every_rank_with_its_name_and_op(mode):
    proc, seconds = zdsl("run", QUICK, "--quiet", "--timeout", "20", env={"ZDSL_FAULT": f"1:7:{mode}"})
    assert proc.returncode == 1
    assert "rank 1" in proc.stderr
    if mode == "raise":
        assert "op #7" in proc.stderr and "injected fault" in proc.stderr
    else:
        assert "SIGKILL" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert seconds < 60


def test_a_hung_rank_does_not_hang_the_run():
    proc, seconds = zdsl("run", QUICK, "--quiet", "--timeout", "5", env={"ZDSL_FAULT": "1:9:hang"}, timeout=120)
    assert proc.returncode == 1
    assert "rank 0" in proc.stderr      # the rank that waited names the op it waited in
    assert seconds < 60


def test_wrong_rank_count_fails_before_any_collective():
    procs = []
    for rank in range(3):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        procs.append(subprocess.Popen([sys.executable, "-m", "zdsl.cli", "run", QUICK, "--quiet"],
                                      env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1
        assert "compiled for 2 ranks but 3 were launched" in err


def test_a_bad_schedule_is_rejected_before_launch(tmp_path):
    bad = tmp_path / "bad.zs"
    bad.write_text(QUICK and Path(QUICK).read_text().replace("zero      3", "zero      7"))
    proc, _ = zdsl("run", str(bad))
    assert proc.returncode == 1
    assert "bad.zs:" in proc.stderr and "Traceback" not in proc.stderr


def test_a_bad_collectives_variable_is_a_clear_error_not_a_bug():
    proc, _ = zdsl("run", QUICK, "--quiet", "--set", "steps=1", env={"ZDSL_GLOO_LOOP_POLICY": "fast"})
    assert proc.returncode != 0
    assert "ZDSL_GLOO_LOOP_POLICY='fast': use one of batch, idle, normal" in proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr


def test_nvme_swap_files_are_removed_after_a_run(tmp_path):
    program = tmp_path / "nvme.zs"
    swap = tmp_path / "swap"
    program.write_text((ROOT / "programs" / "nvme.zs").read_text().replace("/tmp/zdsl_nvme", str(swap)))
    proc, _ = zdsl("run", str(program), "--set", "steps=2", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert swap.exists() and oct(swap.stat().st_mode & 0o777) == "0o700"
    assert [p for p in swap.rglob("*") if p.is_file()] == []


def test_run_writes_a_measured_trace_and_timeline(trained, tmp_path):
    """``zdsl run --trace --trace-steps 2 --timeline``: one process per rank, one thread per lane,
    every timed op of the last two steps once per rank, flow arrows, memory counters, a picture."""
    from zdsl.driver import compile_file
    proc, out = trained
    trace, svg = out["trace"], out["svg"]
    assert proc.returncode == 0, proc.stderr
    data = json.loads(trace.read_text())
    assert data["metadata"]["steps"] == [10, 11]
    events = data["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    graph = compile_file(QUICK, {}, simulate=False).graph
    lanes = {op.lane for op in graph.ops if op.kind != "mem.free"}
    assert names == {(rank, lane) for rank in (0, 1) for lane in lanes}
    spans = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):         # every timed op of each traced step, each exactly once
        ops = [(e["args"]["step"], e["args"]["op"]) for e in spans if e["pid"] == rank]
        assert sorted(ops) == sorted((s, op.id) for s in (10, 11) for op in graph.ops if op.kind != "mem.free")
    assert all(e["dur"] >= 0 for e in spans)
    assert any(e["ph"] == "s" for e in events) and any(e["ph"] == "f" for e in events)
    assert any(e["ph"] == "C" and e["name"].startswith("memory.") for e in events)
    assert "<svg" in svg.read_text()[:500]
    proc, _ = zdsl("run", QUICK, "--trace", str(tmp_path / "t.json"), "--trace-steps", "0")
    assert proc.returncode == 2 and "--trace-steps must be at least 1" in proc.stderr


def test_output_folders_are_made_before_training_or_refused(trained, tmp_path):
    proc, out = trained                 # its metrics went into a folder that did not exist
    assert proc.returncode == 0, proc.stderr
    assert len(out["metrics"].read_text().splitlines()) == 12
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for flag, path, words in (("--metrics", tmp_path, "is a folder"),
                              ("--trace", blocker / "t.json", "cannot make its folder")):
        proc, _ = zdsl("run", QUICK, "--quiet", flag, str(path))
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr and "Traceback" not in proc.stderr and "rank" not in proc.stderr
