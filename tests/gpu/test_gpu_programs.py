"""Every program in programs/ trains on one GPU: ``zdsl run PROGRAM --set ranks=1 --set device=cuda``
(``ranks N on cuda`` is how a schedule asks for GPUs; ``--set device=cuda`` changes only the device)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROGRAMS = sorted((Path(__file__).resolve().parents[2] / "programs").glob("*.zs"))
# capacity.zs is about a model larger than host memory (2.5e9 parameters through NVMe); the smoke
# run checks the CUDA path, so it runs that schedule with 2 of its 40 layers
SMALLER = {"capacity": ["--set", "model.layers=2"]}


def swap_here(program: Path, folder: Path) -> list[str]:
    """``--set`` options that move the program's NVMe offloads into ``folder``."""
    from zdsl.driver import compile_file
    placement = compile_file(str(program), {}, simulate=False).schedule.placement
    sets = []
    for state, p in placement.items():
        if p.tier == "nvme":
            sets += ["--set", f'offload.{state}=nvme("{folder}", block={p.block_bytes}, depth={p.queue_depth})']
    return sets


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.stem)
def test_every_program_trains_on_one_gpu(tmp_path, program):
    from test_run_cli import zdsl
    metrics = tmp_path / "metrics.jsonl"
    proc, _ = zdsl("run", str(program), "--set", "ranks=1", "--set", "device=cuda", "--set", "steps=2",
                   *SMALLER.get(program.stem, []), *swap_here(program, tmp_path / "swap"),
                   "--metrics", str(metrics), timeout=1200)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["peak_bytes"]["0"]["device"] > 0        # it used the GPU's memory
