"""Signals and hangs, as a job scheduler, a closed terminal or a stuck rank deliver them.

No rank outlives its launcher, whatever signal ends it (SIGKILL included); SIGTERM and
SIGHUP stop the run cleanly with 143 and 129; a rank that stops answering is the one
named, with the op, and zdsl says that it stopped it; a failed run prints no summary;
``--quiet`` prints the result in one line. Every deadline below is for "eventually"
(processes gone, a run over): generous, and never what a test asserts.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zdsl.runtime.dist.spawn import free_port
from zdsl.runtime.run import launch
from zdsl.runtime.proc.board import BOARD_SLOTS
from zdsl.runtime.proc.board import FIRST_LANE
from zdsl.runtime.proc.board import STEP_DONE
from zdsl.runtime.proc.board import map_board
from zdsl.runtime.run.launch import Watch
from zdsl.runtime.run.launch import describe_culprit
from zdsl.runtime.run.launch import peer_lost_text
from zdsl.runtime.run.launch import report_failure

ROOT = Path(__file__).parents[2]
QUICK = ROOT / "programs" / "quickstart.zs"
LONG = ("--set", "steps=100000")        # a run that is still training when the signal comes
STARTUP_S = 240                          # ranks import torch and compile: slow on a loaded host


def start(*args, env=None, program=QUICK) -> subprocess.Popen:
    e = dict(os.environ, **(env or {}))
    e.pop("RANK", None)
    return subprocess.Popen([sys.executable, "-m", "zdsl.cli", "run", str(program), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


def alive(pid: int) -> bool:
    state = launch.process_state(pid)
    return state not in ("", "Z", "X")


def rank_env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)


def training_ranks(launcher: subprocess.Popen, ranks: int = 2, step: int = 1) -> dict[int, int]:
    """rank -> pid, once every rank has finished ``step`` steps (read from its progress board)."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()
        found = {}
        for pid in children(launcher.pid):
            try:
                env = rank_env(pid)
                board = map_board(Path(env["ZDSL_ERROR_FILE"]).with_suffix(".progress"))
            except (OSError, KeyError, ValueError):
                continue
            if board[STEP_DONE] >= step - 1:
                found[int(env["RANK"])] = pid
        if len(found) == ranks:
            return found
        time.sleep(0.2)
    raise AssertionError("the ranks never started training")


def all_gone(pids, deadline_s: float = 30.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def kill_all(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "zdsl: stopped by SIGTERM"),
                                             (signal.SIGHUP, 129, "zdsl: stopped by SIGHUP")])
def test_sigterm_or_sighup_to_the_launcher_stops_every_rank(sig, code, said):
    launcher = start("--quiet", *LONG)
    ranks = training_ranks(launcher)
    try:
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=120)
        assert launcher.returncode == code, err
        assert [line for line in err.splitlines() if "stop" in line] == [f"{said}; all ranks stopped"], err
        assert "Traceback" not in err and out == ""                 # no result line for a stopped run
        assert all_gone(ranks.values()), "ranks outlived their launcher"
    finally:
        kill_all(ranks.values())


@pytest.mark.slow
def test_ranks_stop_on_their_own_when_the_launcher_is_killed():
    launcher = start("--quiet", *LONG)
    ranks = training_ranks(launcher)
    try:
        launcher.kill()                          # SIGKILL: the launcher can do nothing
        launcher.wait(timeout=60)
        assert all_gone(ranks.values()), "ranks outlived their launcher"
        _, err = launcher.communicate(timeout=60)   # the ranks held its stderr; they said why
        assert "its launcher" in err and "is gone" in err and "Traceback" not in err
    finally:
        kill_all(ranks.values())


@pytest.mark.slow
def test_a_stopped_rank_is_named_with_its_op_and_stopped_by_zdsl():
    launcher = start("--timeout", "5", *LONG)
    ranks = training_ranks(launcher)
    try:
        os.kill(ranks[1], signal.SIGSTOP)
        out, err = launcher.communicate(timeout=180)
        assert launcher.returncode == 1
        first = err.splitlines()[0]
        assert first.startswith("zdsl: error: rank 1 stopped making progress"), err
        assert "op #" in first and "SIGSTOP" in first and "zdsl killed it" in first
        assert "rank 0:" in err and "rank 1 left or stopped answering" in err   # the rank that waited
        assert "rank 1 was killed by signal" not in err                      # not as if someone else had
        assert "zdsl run: quickstart" not in out and "median step" not in out  # no success summary
        assert "Traceback" not in err
        assert all_gone(ranks.values())
    finally:
        kill_all(ranks.values())


@pytest.mark.slow
def test_a_hung_rank_is_named_with_the_op_it_hangs_in():
    proc = start("--timeout", "5", env={"ZDSL_FAULT": "1:9:hang"})     # op 9: a forward, on the compute lane
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    first = err.splitlines()[0]
    assert first.startswith("zdsl: error: rank 1 stopped making progress in step 1, in op #9 compute.forward"), err
    assert "zdsl stopped it" in first
    assert "zdsl run: quickstart" not in out and "median step" not in out
    assert "Traceback" not in err


@pytest.mark.slow
def test_quiet_prints_the_result_in_one_line():
    proc = start("--quiet", "--set", "steps=3")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert re.fullmatch(r"zdsl: quickstart: 3 steps, loss \d+\.\d\d -> \d+\.\d\d, median step \d+ ms\n", out), out


@pytest.mark.slow
def test_sigterm_to_a_rank_under_another_launcher_stops_it_cleanly(tmp_path):
    """As torchrun runs ranks: RANK set, no zdsl launcher. SIGTERM to one stops it with 143 and a
    line; its peer says which rank left, in zdsl's words, not gloo's."""
    metrics = tmp_path / "m.jsonl"
    procs = []
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for rank in range(2):
        procs.append(subprocess.Popen([sys.executable, "-m", "zdsl.cli", "run", str(QUICK), *LONG, "--quiet",
                                       "--metrics", str(metrics)], env=dict(env, RANK=str(rank)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + STARTUP_S
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)
        _, err1 = procs[1].communicate(timeout=60)
        _, err0 = procs[0].communicate(timeout=120)
        assert procs[1].returncode == 143 and err1.strip() == "zdsl: rank 1: stopped by SIGTERM", err1
        assert procs[0].returncode == 1
        assert err0.startswith("zdsl: error: rank 0: ") and "rank 1 left or stopped answering" in err0, err0
        assert "Traceback" not in err0 + err1 and "gloo" not in err0
    finally:
        kill_all(p.pid for p in procs)


# -- the launcher's diagnosis, on boards written by hand ------------------------------------------

class FakeProc:
    def __init__(self, pid=0):
        self.pid = pid


def board(step=-1, step_done=-1, last_done=-1, issued=0, running=()):
    row = [0, step, step_done, last_done, issued, -1] + [-1] * (BOARD_SLOTS - 6)
    for i, op in enumerate(running):
        row[FIRST_LANE + i] = op
    return row


def watch_of(*boards, culprits=None, waited_by=None):
    w = Watch([FakeProc(), FakeProc()], [memoryview(bytearray(8 * len(b))).cast("q") for b in boards], 5.0)
    w.seen = [tuple(b) for b in boards]
    w.culprits, w.waited_by = culprits or {}, waited_by
    return w


def quick_graph():
    from zdsl.driver import compile_file
    return compile_file(str(QUICK), {}, simulate=False).graph


def test_the_culprit_is_described_by_the_op_it_runs_else_the_collective_it_did_not_issue():
    g = quick_graph()
    w = watch_of(board(step=3, step_done=2, last_done=4, issued=8 * 13 + 5, running=[9]),
                 board(step=3, step_done=2, issued=8 * 13 + 9), culprits={0: "it made no progress for 5 s"})
    text = describe_culprit(0, w, g)
    assert text.startswith("rank 0 stopped making progress in step 4, in op #9 compute.forward (forward, unit 2")
    assert "the last op it finished: #4 comm.all_gather" in text and text.endswith("; zdsl stopped it")
    w.seen[0] = tuple(board(step=3, step_done=2, last_done=6, issued=8 * 13 + 5))
    # the 6th collective of a step is op #13 (0, 1, 4, 7, 8, then 13)
    assert "in step 4, before op #13 comm.all_gather" in describe_culprit(0, w, g)
    step_op = next(op.id for op in g.ops if op.kind == "compute.step")
    w.seen[0] = tuple(board(step=3, step_done=3, last_done=step_op, issued=8 * 13))
    w.culprits[0] = "it was stopped (SIGSTOP or a debugger) for 5 s"
    assert describe_culprit(0, w, g).startswith(
        "rank 0 stopped making progress after step 4, before op #0 comm.all_gather (forward, unit 0, micro-batch 0) "
        f"of step 5 (the last op it finished: #{step_op} compute.step")
    assert describe_culprit(0, w, g).endswith("zdsl killed it")


def test_a_rank_zdsl_stopped_after_another_failed_is_not_blamed(tmp_path, capsys):
    # rank 1 was killed; rank 0, busy, was stopped by zdsl after the grace and said "stopped by SIGTERM"
    (tmp_path / "rank0.err").write_text("rank 0: stopped by SIGTERM")
    w = watch_of(board(), board())
    w.stopped, w.first_failure = {0}, (0.0, 1)
    report_failure(tmp_path, [143, -9], w)
    assert capsys.readouterr().err == ("zdsl: error: rank 1 was killed by signal SIGKILL\n"
                                       "zdsl: the other ranks stopped too: rank 0 (stopped by zdsl)\n")


def test_gloo_words_for_a_lost_peer_become_zdsls():
    op_error = ("rank 0: op #24 comm.reduce_scatter (backward, unit 2, micro-batch 0) failed: RuntimeError: "
                "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    assert peer_lost_text(op_error, "rank 1") == (
        "rank 0: op #24 comm.reduce_scatter (backward, unit 2, micro-batch 0) failed: "
        "the collective failed because rank 1 left or stopped answering")
    assert peer_lost_text("rank 0: DistStoreError: Timed out after 11 seconds", "a peer") == (
        "rank 0: a peer left or stopped answering (DistStoreError: Timed out after 11 seconds)")
    outside_ops = "rank 0: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:590] Connection reset by peer"
    assert peer_lost_text(outside_ops, "rank 1") == (
        "rank 0: rank 1 left or stopped answering (RuntimeError: Connection reset by peer)")
    own = "rank 1: op #7 comm.all_gather (forward) failed: RuntimeError: injected fault"
    assert peer_lost_text(own, "rank 0") == own
    # 2 cpu ranks' collectives go through shared memory (runtime/dist/shm.py): its words too
    shm = ("rank 0: op #7 comm.all_gather (forward, unit 3, micro-batch 0) failed: SharedMemoryError: "
           "all_gather through shared memory: peer rank 1 (pid 3266) is gone")
    assert peer_lost_text(shm, "rank 1") == (
        "rank 0: op #7 comm.all_gather (forward, unit 3, micro-batch 0) failed: "
        "the collective failed because rank 1 left or stopped answering")


def test_a_rank_that_saw_its_shared_memory_peer_go_is_not_blamed(tmp_path, capsys):
    # rank 1 raised in op #7; rank 0, in the same all-gather, saw its process gone
    (tmp_path / "rank0.err").write_text("rank 0: op #7 comm.all_gather (forward) failed: SharedMemoryError: "
                                        "all_gather through shared memory: peer rank 1 (pid 9) is gone")
    (tmp_path / "rank1.err").write_text("rank 1: op #7 comm.all_gather (forward) failed: RuntimeError: injected fault")
    w = watch_of(board(), board())
    w.first_failure = (0.0, 0)                      # rank 0's exit reached the launcher first
    report_failure(tmp_path, [1, 1], w)
    assert capsys.readouterr().err.startswith("zdsl: error: rank 1: op #7 comm.all_gather (forward) failed: "
                                              "RuntimeError: injected fault\n")


def test_a_failed_run_prints_no_summary_and_quiet_one_line(capsys):
    from zdsl.runtime.run.progress import Reporter
    from zdsl.runtime.run.train import StepMetrics

    def reporter(show):
        r = Reporter("q", 3, show=show)
        for step, loss in enumerate((5.0, 4.0, 3.25)):
            r.history.append(StepMetrics(step, loss, 0.02, 1000.0, False, None, {0: {"device": 1}}))
        return r

    reporter(True).close(finished=False)
    reporter(False).close(finished=False)
    assert capsys.readouterr().out == ""
    reporter(False).close()
    assert capsys.readouterr().out == "zdsl: q: 3 steps, loss 5.00 -> 3.25, median step 20 ms\n"
    reporter(True).close()
    assert "zdsl run: q" in capsys.readouterr().out
