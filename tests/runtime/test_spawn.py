"""The local rank spawner (runtime/dist/spawn.py): results by rank, a failure named by its rank
with its own traceback, and no rank outliving its parent."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zdsl.runtime.dist.spawn import RankFailed
from zdsl.runtime.dist.spawn import run_ranks

pytestmark = pytest.mark.slow     # spawns ranks

HERE = Path(__file__).parent


def _variables(rank, world, tag):
    return tag, rank, world, {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


def _rank_1_fails(rank, world):
    if rank == 1:
        raise ValueError("rank 1 broke")
    time.sleep(120)                  # as a peer waiting in a collective: stopped by the spawner


def _exit_without_a_result(rank, world):
    os._exit(0)                      # a clean status, but nothing returned


def _sleep(rank, world, folder):
    Path(folder, f"rank{rank}").touch()        # running (past the spawn's start-up)
    time.sleep(120)


def test_each_rank_runs_with_its_variables_and_returns_by_rank():
    got = run_ranks(_variables, 2, "x")
    assert [g[:3] for g in got] == [("x", 0, 2), ("x", 1, 2)]
    assert got[1][3] == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_a_failing_rank_is_named_with_its_traceback_and_its_peers_are_stopped():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_rank_1_fails, 2)
    assert info.value.rank == 1 and info.value.error == "ValueError: rank 1 broke"
    assert "Traceback" in str(info.value) and "_rank_1_fails" in str(info.value)
    assert time.monotonic() - start < 60          # rank 0 was stopped, not waited for


def test_a_rank_that_exits_cleanly_without_a_result_is_named():
    with pytest.raises(RankFailed) as info:
        run_ranks(_exit_without_a_result, 1)
    assert info.value.rank == 0 and str(info.value) == "rank 0 exited with status 0, without a result"


PARENT = f"""
import sys, time
from pathlib import Path
sys.path.insert(0, {str(HERE)!r})
from zdsl.runtime.dist.spawn import LocalRanks
import test_spawn
if __name__ == "__main__":
    folder = sys.argv[1]
    with LocalRanks(test_spawn._sleep, 2, (folder,)) as ranks:
        while len(list(Path(folder).glob("rank*"))) < 2:
            time.sleep(0.05)
        print(" ".join(str(p.pid) for p in ranks.procs.values()), flush=True)
        time.sleep(120)
"""


def test_no_rank_outlives_its_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2, parent.stderr.read()
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(_running(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
