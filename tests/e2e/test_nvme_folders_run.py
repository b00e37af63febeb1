"""``zdsl run`` with each state on its own NVMe folders, one of them striped over two: the losses of
the one-folder run, to the bit, and every folder left as it was found."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import zdsl

NVME = Path(__file__).parents[2] / "programs" / "nvme.zs"

pytestmark = pytest.mark.slow       # spawns ranks


def losses(tmp_path: Path, name: str, parameters: str, optimizer: str) -> list[float]:
    metrics = tmp_path / f"{name}.jsonl"
    proc = zdsl("run", str(NVME), "--quiet", "--set", "steps=3", "--metrics", str(metrics),
                "--set", f"offload.parameters={parameters}", "--set", f"offload.optimizer={optimizer}")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_each_state_on_its_own_folders_trains_to_the_one_folder_bits(tmp_path):
    one = tmp_path / "one"
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder in (one, a, b, c):
        folder.mkdir()
    reference = losses(tmp_path, "one", f'nvme("{one}")', f'nvme("{one}")')
    apart = losses(tmp_path, "apart", f'nvme("{a}", "{b}", block=64KiB, depth=4)', f'nvme("{c}", depth=2)')
    assert apart == reference and len(reference) == 3
    assert all(list(folder.iterdir()) == [] for folder in (one, a, b, c))
