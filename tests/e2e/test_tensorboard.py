"""``zdsl run --tensorboard DIR``: the --metrics record as TensorBoard scalars, read back as TensorBoard's
scalars plugin reads them; without the package, an error naming the extra before any rank starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zdsl.runtime.run.tensorboard import run_folder
from zdsl.runtime.run.train import StepMetrics

ROOT = Path(__file__).parents[2]
QUICK = str(ROOT / "programs" / "quickstart.zs")


def zdsl_env(**extra) -> dict:
    env = dict(os.environ, **extra)
    env.pop("RANK", None)
    return env


def scalars(root: Path) -> dict[str, dict[str, dict[int, float]]]:
    """run folder name -> tag -> step -> value, through the data provider TensorBoard's UI reads."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer
    mux = plugin_event_multiplexer.EventMultiplexer(tensor_size_guidance={"scalars": 0})   # 0: keep every step
    mux.AddRunsFromDirectory(str(root))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(root))
    runs = provider.read_scalars(context.RequestContext(), experiment_id="", plugin_name="scalars",
                                 downsample=10**6)
    return {run: {tag: {d.step: d.value for d in data} for tag, data in tags.items()} for run, tags in runs.items()}


def expected(line: dict) -> dict[str, float]:
    """The scalars one --metrics line stands for."""
    peaks = line["peak_bytes"].values()
    return {"loss/train": line["loss"], "lr": line["lr"], "grad_norm": line["grad_norm"],
            "throughput/tokens_per_s": line["tokens_per_s"], "time/step_ms": line["step_s"] * 1000.0,
            **{f"memory/{t}_bytes": float(max(p[t] for p in peaks)) for t in ("device", "host", "nvme")}}


@pytest.mark.slow      # spawns 2 ranks
def test_scalars_equal_the_metrics_record_per_step(tmp_path):
    metrics, board = tmp_path / "m.jsonl", tmp_path / "tb"
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "run", QUICK, "--quiet", "--set", "steps=3",
                           "--metrics", str(metrics), "--tensorboard", str(board)],
                          capture_output=True, text=True, env=zdsl_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(text) for text in metrics.read_text().splitlines()]
    runs = scalars(board)
    assert len(runs) == 1 and next(iter(runs)).startswith("quickstart-"), runs     # one run folder
    (tags,) = runs.values()
    want = {tag: {line["step"]: value for line in lines for t, value in expected(line).items() if t == tag}
            for tag in expected(lines[0])}
    assert tags == want                    # every tag, every step, the --metrics value to the bit
    assert sorted(tags["loss/train"]) == [0, 1, 2] and tags["memory/device_bytes"][0] > 0
    assert "loss/val" not in tags          # no eval in the quickstart


@pytest.mark.slow      # spawns 2 ranks
def test_a_sigtermed_run_keeps_the_steps_it_wrote(tmp_path):
    metrics, board = tmp_path / "m.jsonl", tmp_path / "tb"
    launcher = subprocess.Popen([sys.executable, "-m", "zdsl.cli", "run", QUICK, "--quiet", "--set", "steps=100000",
                                 "--metrics", str(metrics), "--tensorboard", str(board)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=zdsl_env())
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 143, err
    lines = [json.loads(text) for text in metrics.read_text().splitlines()]
    (tags,) = scalars(board).values()
    steps = sorted(tags["loss/train"])
    # the stop may come between a step's JSON line and its scalars: at most that one step is missing
    assert steps == list(range(len(steps))) and len(steps) >= max(3, len(lines) - 1), (steps, len(lines))
    assert all(tags["loss/train"][s] == lines[s]["loss"] for s in steps)


def test_without_tensorboard_the_run_fails_before_any_rank_naming_the_extra(tmp_path):
    shim = tmp_path / "shim" / "tensorboard"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("No module named \'tensorboard\'")\n')
    path = os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))
    board = tmp_path / "tb"
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "run", QUICK, "--tensorboard", str(board)],
                          capture_output=True, text=True, env=zdsl_env(PYTHONPATH=path), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'zdsl[tensorboard]'" in proc.stderr and "--tensorboard" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "rank" not in proc.stderr + proc.stdout and not board.exists()     # no rank started


def metrics_at(step: int, **extra) -> StepMetrics:
    m = StepMetrics(step=step, loss=2.0 - step / 10, step_s=0.25, tokens_per_s=1000.0, skipped=False,
                    grad_norm=None, peak_bytes={0: {"device": 3, "host": 2**40 + 1, "nvme": 0},
                                                1: {"device": 5, "host": 7, "nvme": 0}}, lr=None)
    for key, value in extra.items():
        setattr(m, key, value)
    return m


WRITE_AND_DIE = """
import os, sys
from zdsl.runtime.run.tensorboard import TensorBoardWriter
from tests.e2e.test_tensorboard import metrics_at
writer = TensorBoardWriter(sys.argv[1], "demo")
writer.step(metrics_at(0))
writer.step(metrics_at(1, val_loss=1.5))
os._exit(0)        # no close: as a rank ends (os._exit), or is killed after the step
"""


def test_each_step_is_on_disk_when_written_and_val_loss_only_where_the_record_has_it(tmp_path):
    subprocess.run([sys.executable, "-c", WRITE_AND_DIE, str(tmp_path)], check=True, cwd=ROOT, timeout=120)
    (tags,) = scalars(tmp_path).values()
    assert tags["loss/train"] == {0: 2.0, 1: 1.9}
    assert tags["loss/val"] == {1: 1.5}
    assert "lr" not in tags and "grad_norm" not in tags           # the record has none
    assert tags["memory/device_bytes"] == {0: 5.0, 1: 5.0}         # the largest rank's peak
    assert tags["memory/host_bytes"][0] == 2**40 + 1               # bytes exact (float64)
    assert tags["time/step_ms"] == {0: 250.0, 1: 250.0}


def test_each_invocation_gets_its_own_run_folder(tmp_path):
    first, second = run_folder(tmp_path, "demo", now=0), run_folder(tmp_path, "demo", now=0)
    assert first.name == "demo-19700101-000000" and second.name == "demo-19700101-000000-2"
