"""programs/classifier.zs through the CLI: DeepSpeed's MLP classifier on data python(...) learns at 2 ranks with
ZeRO-3 on NVMe, and a data function that breaks its contract stops `zdsl run` (before any rank starts) or
`zdsl check` with a message naming it, never a traceback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import zdsl

PROGRAMS = Path(__file__).parents[2] / "programs"
CLASSIFIER = PROGRAMS / "classifier.zs"


def on_nvme_in(folder: Path) -> list[str]:
    """--set arguments that put the program's swap files in ``folder`` (not a path other runs share)."""
    nvme = f'nvme("{folder}", block=64KiB)'
    return ["--set", f"offload.parameters={nvme}", "--set", f"offload.optimizer={nvme}"]


@pytest.mark.slow      # spawns 2 ranks
def test_the_classifier_learns_at_two_ranks_on_nvme(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = zdsl("run", str(CLASSIFIER), "--quiet", "--set", "steps=6", "--metrics", str(metrics),
                *on_nvme_in(tmp_path / "swap"))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 6 and losses[0] > 1.0            # 4 classes: about ln 4 = 1.39 untrained
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert all(r["peak_bytes"][rank]["nvme"] > 0 for r in rows for rank in ("0", "1"))
    # tokens/s counts labels: one per sample, 16 samples on each of 2 ranks per step
    assert abs(rows[-1]["tokens_per_s"] * rows[-1]["step_s"] - 32) < 1e-6


def broken_copy(folder: Path, function: str) -> Path:
    """classifier.zs in ``folder`` with its data from ``function`` of a data.py there (the model stays
    programs/classifier.py's)."""
    (folder / "data.py").write_text(
        "import torch\n"
        "def impure(seed, step, micro, rank, world, batch, features=16, classes=4):\n"
        "    return torch.randn(batch, features), torch.randint(classes, (batch,))\n"
        "def numbers(seed, step, micro, rank, world, batch, features=16, classes=4):\n"
        "    return [0.5] * batch\n")
    text = CLASSIFIER.read_text().replace('"classifier.py:build"', f'"{PROGRAMS / "classifier.py"}:build"')
    text = text.replace('python("classifier.py:batches"', f'python("data.py:{function}"')
    out = folder / "classifier.zs"
    out.write_text(text)
    return out


def test_a_function_that_is_not_pure_stops_zdsl_run_before_any_rank_starts(tmp_path):
    proc = zdsl("run", str(broken_copy(tmp_path, "impure")), *on_nvme_in(tmp_path / "swap"))
    assert proc.returncode == 1, proc.stderr
    assert ("zdsl: error: data python(\"" in proc.stderr and "two calls of impure(seed=0, step=0, micro=0, rank=0, "
            "world=2, batch=16) returned different inputs" in proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr and "step 1/" not in proc.stdout
    assert not (tmp_path / "swap").exists()


def test_a_function_returning_no_pair_is_an_error_at_the_data_line_in_zdsl_check(tmp_path):
    zs = broken_copy(tmp_path, "numbers")
    proc = zdsl("check", str(zs))
    assert proc.returncode == 1, proc.stderr
    line = next(i for i, text in enumerate(zs.read_text().splitlines(), 1) if text.startswith("data"))
    assert f"{zs}:{line}:1" in proc.stderr, proc.stderr
    assert "numbers(seed=0, step=0, micro=0, rank=0, world=1, batch=1) returned a list of 1 items (float)" \
        in proc.stderr and "Traceback" not in proc.stderr
