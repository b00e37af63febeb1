"""A user's script started as a plain `python train.py`, for a schedule of `ranks 1`.

Guards: initialize joins a group of its own when no launcher set one up, trains, and leaves it
(the script ends with status 0 and its own output); a schedule of more ranks says how to launch it.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from api_models import HERE, schedule

pytestmark = pytest.mark.slow     # a fresh Python with torch: seconds

SCRIPT = """\
import sys
import torch.distributed as dist
import torch.nn.functional as F
import zdsl
sys.path.insert(0, {here!r})
from api_models import batches, mlp
with zdsl.initialize({zs!r}, model=mlp()) as engine:
    for step in range(3):
        x, y = batches(0, step, 0, 0, 1, 4)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        print("loss", loss.item())
print("group left:", not dist.is_initialized(), "steps:", engine.global_step)
"""


def run_script(tmp_path, ranks: int) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(here=str(HERE), zs=str(schedule(tmp_path, ranks=ranks))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)


def test_python_train_py_trains_a_one_rank_schedule_in_a_group_of_its_own(tmp_path):
    proc = run_script(tmp_path, 1)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("loss ") == 3
    assert "group left: True steps: 3" in proc.stdout


def test_python_train_py_of_a_two_rank_schedule_says_how_to_launch_it(tmp_path):
    proc = run_script(tmp_path, 2)
    assert proc.returncode == 1
    assert ("ZdslApiError: the schedule trains on 2 ranks (`ranks 2`) but this script runs as 1; start it with "
            "torchrun --nproc-per-node 2") in proc.stderr
