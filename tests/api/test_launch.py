"""A user's script started as a plain `python train.py` (a schedule of `ranks 1`), and as
`zdsl launch --ranks 2 train.py` (issue 56).

Guards: initialize joins a group of its own when no launcher set one up, trains, and leaves it
(the script ends with status 0 and its own output); a schedule of more ranks says how to launch it.
Under `zdsl launch` the script trains to torchrun's losses to the bit; a script that raises on
one rank ends every rank with that rank and its message named; SIGTERM, SIGHUP or SIGINT (Ctrl-C) to the
launcher, or the launcher killed, ends every rank (their pids checked); a rank stuck in its own code is named with
the last call it made, and the one waiting for it with its call; a schedule that cannot run here
is refused by the pre-flight in every rank, with zdsl run's reason, before any rank trains (ranks
that do not fit memory: with how many would, in launch's words), or trains with --ignore-limits;
a group initialize cannot join is one error naming rank, address and timeout, not torch's traceback.
A deferred engine's load_checkpoint that fails on one rank fails on every rank at once (initialize
joined the group), not on that rank alone while the others wait out the timeout.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from api_models import HERE, mlp, schedule

pytestmark = pytest.mark.slow     # a fresh Python with torch: seconds

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "ZDSL_ERROR_FILE", "ZDSL_LAUNCH_TIMEOUT", "ZDSL_IGNORE_LIMITS")

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

# A two-rank loop; argv: MODE FOLDER [TIMEOUT]. Each rank leaves its pid in FOLDER/pid.RANK first.
LAUNCHED = """\
import os, sys, time
from pathlib import Path
import torch.nn.functional as F
import zdsl
sys.path.insert(0, {here!r})
from api_models import batches, mlp
mode, folder = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ["RANK"])
(folder / f"pid.{{rank}}").write_text(str(os.getpid()))
timeout = {{"timeout_s": float(sys.argv[3])}} if len(sys.argv) > 3 else {{}}
if rank == 1 and mode == "late":
    time.sleep(300)                          # never calls initialize
engine = zdsl.initialize({zs!r}, model=mlp(), **timeout)
for step in range(3):
    x, y = batches(0, step, 0, rank, 2, 4)
    loss = F.cross_entropy(engine(x), y)
    engine.backward(loss)
    if step == 1 and rank == 1 and mode == "raise":
        raise ValueError("rank 1's own bug")
    if step == 1 and rank == 1 and mode == "stuck":
        time.sleep(300)                      # in its own code: never calls engine.step()
    engine.step()
    with open(folder / f"losses.{{rank}}", "a") as f:          # the ranks' stdout interleaves
        f.write(f"{{step}} {{loss.item()!r}}\\n")
    if mode == "wait":
        (folder / f"ready.{{rank}}").write_text("")
        while True:
            time.sleep(1)
engine.close()
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(extra)
    return env


def run_script(tmp_path, ranks: int) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(here=str(HERE), zs=str(schedule(tmp_path, ranks=ranks))))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=clean_env(), timeout=300)


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


def test_a_master_addr_that_does_not_resolve_is_one_error_naming_rank_address_and_timeout(tmp_path):
    script = tmp_path / "joins.py"
    script.write_text(f"import sys, zdsl\nsys.path.insert(0, {str(HERE)!r})\nfrom api_models import mlp\n"
                      f"zdsl.initialize({str(schedule(tmp_path, ranks=2))!r}, model=mlp(), timeout_s=1)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                                        MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29999"))
    assert proc.returncode == 1, proc.stderr
    assert ("ZdslApiError: rank 1: zdsl.initialize(): could not join the group of 2 ranks at "
            "MASTER_ADDR='no-such-host.invalid', MASTER_PORT='29999' within timeout_s=1 s: ") in proc.stderr
    assert "check that MASTER_ADDR names the host of rank 0" in proc.stderr
    assert "distributed_c10d.py" not in proc.stderr and "During handling" not in proc.stderr   # no torch traceback


# -- zdsl launch ---------------------------------------------------------------------------

def launched_script(tmp_path: Path, zs: Path | None = None) -> Path:
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED.format(here=str(HERE), zs=str(zs or schedule(tmp_path, ranks=2))))
    return script


def launch(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zdsl.cli", "launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env(),
                            preexec_fn=sigint_ignored, **popen)


def sigint_ignored() -> None:
    """As a non-interactive shell starts a job in the background (``cmd &``): the launcher must
    handle Ctrl-C itself, whatever it inherits, as torchrun does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def losses(folder: Path) -> list[list[str]]:
    """Each rank's losses, as the launched script writes them."""
    return [(folder / f"losses.{r}").read_text().split("\n") if (folder / f"losses.{r}").exists() else []
            for r in range(2)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                     # a zombie not yet reaped by its parent is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rank_pids(folder: Path) -> list[int]:
    return [int((folder / f"pid.{r}").read_text()) for r in range(2)]


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def wait_for(paths: list[Path], proc: subprocess.Popen, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the ranks never got ready"
        time.sleep(0.1)


def test_zdsl_launch_trains_to_torchrun_losses(tmp_path):
    script = launched_script(tmp_path)
    ours, theirs = tmp_path / "launch", tmp_path / "torchrun"
    ours.mkdir(), theirs.mkdir()
    code, out, err = finish(launch("--ranks", "2", str(script), "train", str(ours)))
    assert code == 0, err
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(script), "train", str(theirs)], capture_output=True, text=True,
                              env=clean_env(), timeout=300)
    assert torchrun.returncode == 0, torchrun.stderr
    assert [len(rank) for rank in losses(ours)] == [4, 4]            # 3 steps and the last newline
    assert losses(ours) == losses(theirs)


def test_a_script_that_raises_on_rank_1_ends_every_rank_naming_it(tmp_path):
    code, out, err = finish(launch("--ranks", "2", str(launched_script(tmp_path)), "raise", str(tmp_path)))
    assert code == 1, err
    assert "zdsl: error: rank 1: ValueError: rank 1's own bug" in err
    assert 'raise ValueError("rank 1\'s own bug")' in err            # its traceback, as Python prints it
    assert "zdsl: the other ranks stopped too: rank 0" in err
    assert gone_within(rank_pids(tmp_path), 0) == []


STOPPED_SAYS = {"SIGTERM": "stopped by SIGTERM", "SIGHUP": "stopped by SIGHUP", "SIGINT": "interrupted"}


@pytest.mark.parametrize("how", ["SIGTERM", "SIGHUP", "SIGINT", "SIGKILL"])
def test_the_launcher_stopped_or_killed_ends_every_rank(tmp_path, how):
    proc = launch("--ranks", "2", str(launched_script(tmp_path)), "wait", str(tmp_path))
    pids: list[int] = []
    try:
        wait_for([tmp_path / "ready.0", tmp_path / "ready.1"], proc)
        pids = rank_pids(tmp_path)
        proc.send_signal(getattr(signal, how))
        code = proc.wait(timeout=60)
        if how in STOPPED_SAYS:              # the launcher stops them (Ctrl-C too), and says so
            assert code == 128 + getattr(signal, how) and gone_within(pids, 0) == []
            assert f"zdsl: {STOPPED_SAYS[how]}; all ranks stopped" in proc.communicate(timeout=60)[1]
        else:                                # each rank's guard sees its launcher gone
            assert code == -signal.SIGKILL
            assert gone_within(pids, 15) == []
    finally:
        for pid in [p for p in pids if alive(p)]:        # a test that failed leaves no rank behind
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_a_rank_stuck_in_its_own_code_is_named_with_its_last_call(tmp_path):
    code, _, err = finish(launch("--ranks", "2", str(launched_script(tmp_path)), "stuck", str(tmp_path), "3"))
    assert code == 1, err
    assert ("zdsl: error: rank 1 stopped making progress in its own code, after its call engine.backward(loss) "
            "(step 1, micro-batch 0) returned: it made no progress for") in err
    assert ("zdsl: rank 0: engine.step() (step 1, micro-batch 0): another rank made no call of the engine "
            "within 3 s") in err
    assert gone_within(rank_pids(tmp_path), 0) == []


def test_launch_timeout_is_initializes_default_and_the_script_s_own_wins(monkeypatch):
    from zdsl.runtime.run.script_rank import launch_timeout
    monkeypatch.delenv("ZDSL_LAUNCH_TIMEOUT", raising=False)
    assert launch_timeout(None) == 120.0 and launch_timeout(7.0) == 7.0
    monkeypatch.setenv("ZDSL_LAUNCH_TIMEOUT", "3")
    assert launch_timeout(None) == 3.0 and launch_timeout(7.0) == 7.0


def test_a_rank_that_never_calls_is_named(tmp_path):
    code, _, err = finish(launch("--ranks", "2", "--timeout", "3", str(launched_script(tmp_path)), "late",
                                 str(tmp_path)))
    assert code == 1, err
    assert ("zdsl: error: rank 1 stopped making progress in its own code, before its first call of the engine "
            "(zdsl.initialize()): it made no progress for") in err
    assert gone_within(rank_pids(tmp_path), 0) == []


def test_the_preflight_refuses_a_schedule_this_machine_cannot_run_in_every_rank(tmp_path):
    import torch
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a CUDA device per rank")
    zs = schedule(tmp_path, ranks=2)
    zs.write_text(zs.read_text().replace("ranks 2 on cpu", "ranks 2 on cuda"))
    code, out, err = finish(launch("--ranks", "2", str(launched_script(tmp_path, zs)), "train", str(tmp_path)))
    assert code == 1, err
    assert losses(tmp_path) == [[], []]
    assert "zdsl: error: `ranks 2 on cuda` puts 2 ranks on this node, a CUDA device each, but torch sees" in err
    assert "rank 1 (failed after it)" in err and "Traceback" not in err


# A two-rank loop on a machine whose available memory, as the pre-flight reads it, is argv[1] bytes.
SMALL_MACHINE = """\
import os, sys
import torch.nn.functional as F
import zdsl
import zdsl.planner.machine_fit as machine_fit
sys.path.insert(0, {here!r})
from api_models import batches, mlp
machine_fit.available_memory = lambda *args, **kw: int(sys.argv[1])
with zdsl.initialize({zs!r}, model=mlp()) as engine:
    x, y = batches(0, 0, 0, int(os.environ["RANK"]), 2, 4)
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()
print("trained", engine.global_step)
"""


@pytest.mark.parametrize("ignore_limits", [False, True])
def test_ranks_that_do_not_fit_memory_are_refused_with_how_many_fit_or_forced(tmp_path, ignore_limits):
    from zdsl.planner.machine_fit import Machine, TorchFloor, schedule_fit
    from zdsl.runtime.api.given import as_unit_model
    from zdsl.runtime.api.setup import compile_for
    zs = schedule(tmp_path, ranks=2)
    plenty = Machine(available=1 << 50, cores=64)
    per_rank = schedule_fit(compile_for(str(zs), None, as_unit_model(mlp())),
                            floor=TorchFloor(0, 0, "test"), machine=plenty, local_ranks=2).needs.ram_per_rank
    script = tmp_path / "small.py"
    script.write_text(SMALL_MACHINE.format(here=str(HERE), zs=str(zs)))
    forced = ["--ignore-limits"] if ignore_limits else []
    code, out, err = finish(launch("--ranks", "2", *forced, str(script), str(per_rank * 3 // 2)))   # one rank fits
    assert "2 ranks do not fit this machine's memory" in err and "Traceback" not in err
    if ignore_limits:
        assert code == 0, err
        assert "(going on anyway: --ignore-limits)" in err and out.count("trained 1") == 2
    else:
        assert code == 1 and "trained" not in out
        assert ("at most 1 ranks fit (zdsl launch --ranks 1, with `ranks 1` in the schedule or "
                "initialize(overrides={'ranks': '1'})); no rank went on to train "
                "(zdsl launch --ignore-limits trains anyway)") in err


# A rank of a two-rank deferred engine (no data statement) resuming from argv[1], as torchrun starts it.
DEFERRED_LOAD = """\
import sys
import zdsl
sys.path.insert(0, {here!r})
from api_models import batches, mlp
engine = zdsl.initialize({zs!r}, model=mlp(), timeout_s=3)
engine.load_checkpoint(sys.argv[1])
x, y = batches(0, 0, 0, engine.rank, 2, 4)
engine(x)
"""


def test_a_deferred_load_that_fails_on_one_rank_fails_on_every_rank_at_once(tmp_path, one_rank_group):
    import torch.nn.functional as F
    from api_models import batches
    from test_loop_schedule import bare

    import zdsl
    from zdsl.runtime.dist.spawn import free_port
    with zdsl.initialize(bare(tmp_path), model=mlp()) as engine:      # a checkpoint for rank 0's load
        x, y = batches(0, 0, 0, 0, 1, 4)
        loss = F.cross_entropy(engine(x), y)          # engine(x) first: it compiles the engine
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
    script = tmp_path / "resume.py"
    script.write_text(DEFERRED_LOAD.format(here=str(HERE), zs=str(bare(tmp_path, ranks=2))))
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(script), str(tmp_path / ("ckpt" if r == 0 else "nothing"))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(2)]
    try:
        errs = [proc.communicate(timeout=120)[1] for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rank, (proc, err) in enumerate(zip(ranks, errs)):     # rank 0's own folder is fine: it has rank 1's error
        assert proc.returncode == 1, (rank, err)
        assert f"CheckpointError: {tmp_path / 'nothing'}: no complete checkpoint to resume from" in err, (rank, err)
