"""What `zdsl run` refuses before any rank starts, and what `zdsl plan` says about this machine.

The decision (zdsl/planner/machine_fit.py) is tested on a fake machine; the CLI is tested with a fake
torch floor in a private cache (ZDSL_CACHE), so no assertion depends on this host's measured size.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import zdsl

from zdsl.planner.machine_fit import (FolderRoom, Machine, Needs, SwapNeed, TorchFloor, free_bytes, judge, most_ranks,
                               needs_of, schedule_fit)

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

ROOT = Path(__file__).parents[2]
QUICK = ROOT / "programs" / "quickstart.zs"
NVME = ROOT / "programs" / "nvme.zs"
MiB, GiB = 1 << 20, 1 << 30
FLOOR = TorchFloor(150 * MiB, 80 * MiB, "test")
HUGE_FLOOR = 4 * GiB          # 1000 ranks x 4 GiB: more memory than any test machine has


def schedule_with(tmp_path: Path, source: Path, **replace: str) -> Path:
    text = source.read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    out = tmp_path / source.name
    out.write_text(text)
    return out


@pytest.fixture
def fake_floor(tmp_path, monkeypatch):
    """A private cache holding a torch floor of HUGE_FLOOR bytes per process (nothing is measured)."""
    from zdsl.planner.machine_fit import floor_cache
    cache = tmp_path / "cache"
    monkeypatch.setenv("ZDSL_CACHE", str(cache))
    path = floor_cache(importlib.metadata.version("torch"), platform.python_version())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"private": HUGE_FLOOR, "shared": 80 * MiB}))
    return {"ZDSL_CACHE": str(cache)}


# -- the decision, on a fake machine ----------------------------------------------------

def test_ranks_that_do_not_fit_memory_are_refused_with_how_many_fit():
    needs = Needs(ranks=1000, ram_per_rank=2 * MiB, nvme_per_rank=0)
    fit = judge(needs, Machine(available=24 * GiB, cores=256), FLOOR)
    per = FLOOR.private + 2 * MiB
    most = (24 * GiB - FLOOR.shared) // per       # k * per + shared <= available
    assert not fit.fits and fit.ranks_fitting == most == 161
    [memory] = fit.refusals
    assert "1000 ranks do not fit this machine's memory" in memory
    assert "at most 161 ranks fit" in memory and "--set ranks=161" in memory
    assert "24.00 GiB is available" in memory


def test_ranks_that_fit_pass_and_mild_oversubscription_only_warns():
    machine = Machine(available=24 * GiB, cores=2)
    fit = judge(Needs(2, 3 * MiB, 0), machine, FLOOR)
    assert fit.fits and not fit.warnings
    fit = judge(Needs(16, 3 * MiB, 0), machine, FLOOR)     # 8 per core: slower, allowed
    assert fit.fits and len(fit.warnings) == 1 and "16 ranks share 2 cores" in fit.warnings[0]
    fit = judge(Needs(17, 3 * MiB, 0), machine, FLOOR)     # over 8 per core: refused
    assert not fit.fits and "17 ranks on 2 cores" in fit.refusals[0] and "at most 16 ranks" in fit.refusals[0]


def test_ranks_fitting_follows_the_per_rank_size_at_each_count():
    # ZeRO-3: 16 GiB of model states cut over k ranks; fewer ranks each hold more
    needs = Needs(ranks=64, ram_per_rank=16 * GiB // 64, nvme_per_rank=0)
    floor = TorchFloor(1 * GiB, 0, "test")
    fit = judge(needs, Machine(available=24 * GiB, cores=64), floor, ram_at=lambda k: 16 * GiB // k)
    assert fit.ranks_fitting == 8                 # k GiB of floors + 16 GiB of states <= 24 GiB
    nothing = judge(Needs(2, 40 * GiB, 0), Machine(24 * GiB, 2), floor)
    assert nothing.ranks_fitting == 0 and "not even one rank fits" in nothing.refusals[0]


def test_most_ranks_is_the_largest_count_that_fits():
    assert [most_ranks(lambda k, n=n: k <= n, 99) for n in (0, 1, 37, 99, 200)] == [0, 1, 37, 99, 99]


def test_swap_folder_without_room_is_refused_naming_folder_needed_and_free():
    needs = Needs(ranks=2, ram_per_rank=MiB, nvme_per_rank=100 * MiB,
                  swap=(SwapNeed("/scratch/swap", 100 * MiB, ("optimizer",)),))
    fit = judge(needs, Machine(24 * GiB, 2), FLOOR, {"/scratch/swap": FolderRoom(150 * MiB)})
    [swap] = fit.refusals
    assert "/scratch/swap" in swap and f"{150 * MiB} bytes) free" in swap and f"({200 * MiB} bytes" in swap
    assert judge(needs, Machine(24 * GiB, 2), FLOOR, {"/scratch/swap": FolderRoom(200 * MiB)}).fits


class FakeStat:
    def __init__(self, free: int):
        self.f_frsize, self.f_bavail = 4096, free // 4096


def test_free_bytes_asks_the_nearest_folder_that_exists(tmp_path):
    asked = []

    def statvfs(path):
        asked.append(path)
        return FakeStat(8192)

    assert free_bytes(tmp_path / "not" / "yet", statvfs) == 8192
    assert asked == [tmp_path]


def test_the_plan_of_nvme_knows_its_swap_folder_and_bytes(tmp_path):
    from zdsl.driver import compile_file
    compiled = compile_file(str(NVME), {}, simulate=True)
    needs = needs_of(compiled.graph, compiled.sim.memory.to_json())
    assert [n.folder for n in needs.swap] == ["/tmp/zdsl_nvme"] and needs.nvme_per_rank % 4096 == 0
    assert needs.nvme_per_rank >= compiled.sim.memory.to_json()["nvme"]["peak"] > 0
    fit = schedule_fit(compiled, floor=FLOOR, machine=Machine(24 * GiB, 2),
                       statvfs=lambda path: FakeStat(needs.nvme_per_rank))   # room for one rank of two
    [swap] = fit.refusals
    assert "/tmp/zdsl_nvme" in swap and f"({2 * needs.nvme_per_rank} bytes" in swap


@pytest.mark.parametrize("ranks,width,outbox", [(2, 256, True), (4, 256, False), (2, 64, True)])
def test_a_rank_whose_collectives_go_through_shared_memory_needs_its_outbox(tmp_path, ranks, width, outbox):
    # 2 CPU ranks' collectives go through a shared-memory outbox per rank (runtime/dist/shm.py),
    # width 256's blocks (3 MiB) and width 64's (0.2 MiB) alike; 4 ranks' do not.
    from zdsl.driver import compile_file
    from zdsl.schedule import SHARED_MEMORY_OUTBOX
    src = tmp_path / "s.zs"
    src.write_text(f'schedule s\nmodel gpt(layers=2, width={width}, heads=4, vocab=256, context=32)\n'
                   f'data synthetic(vocab=256, context=32)\ntrain steps=1, batch=2\n'
                   f'optimizer adamw(lr=1e-3)\nranks {ranks} on cpu\nzero 3\n')
    compiled = compile_file(str(src), {}, simulate=True)
    memory = compiled.sim.memory.to_json()
    planned = memory["host"]["peak"] + memory["device"]["peak"]
    assert needs_of(compiled.graph, memory).ram_per_rank == planned + (SHARED_MEMORY_OUTBOX if outbox else 0)


# -- zdsl run: refused before any rank starts -------------------------------------------

def run_args(*argv):
    from zdsl.runtime.run.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.fixture
def launches(monkeypatch):
    """Replace the launcher's process starting where zdsl run calls it: records each launch instead
    (a stale patch would start the forced run's 1000 ranks for real)."""
    from zdsl.runtime.run import cli
    calls = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "launch_local", lambda child, ranks, **kw: calls.append(ranks) or 0)
    return calls


def test_run_of_1000_ranks_is_refused_before_any_rank_starts(tmp_path, fake_floor, launches):
    program = schedule_with(tmp_path, QUICK, **{"ranks     2 on cpu": "ranks 1000 on cpu"})
    code, err = run_args(str(program))
    assert code == 1 and launches == []
    assert "zdsl: error: 1000 ranks do not fit this machine's memory" in err
    assert "at most" in err and "--ignore-limits" in err and "no rank was started" in err
    code, err = run_args(str(program), "--ignore-limits")      # forced: preflight lets it through
    assert code == 0 and launches == [1000]
    assert "starting anyway" in err


def test_run_cli_refuses_1000_ranks_with_no_traceback(tmp_path, fake_floor):
    program = schedule_with(tmp_path, QUICK, **{"ranks     2 on cpu": "ranks 1000 on cpu"})
    proc = zdsl("run", str(program), env=fake_floor)
    assert proc.returncode == 1, proc.stderr
    assert "zdsl: error: 1000 ranks do not fit" in proc.stderr and "no rank was started" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_under_another_launcher_a_misfit_only_warns(tmp_path, fake_floor, monkeypatch, capsys):
    from zdsl.driver import compile_file
    from zdsl.runtime.run.cli import build_parser
    from zdsl.runtime.run.preflight import preflight
    compiled = compile_file(str(QUICK), {}, simulate=False)
    args = build_parser().parse_args([str(QUICK)])
    monkeypatch.delenv("ZDSL_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "10000000")   # 10^7 x 2 MiB planned: more than any machine here
    assert preflight(compiled, args, {}) is None
    err = capsys.readouterr().err
    assert "zdsl: warning: 10000000 ranks do not fit" in err and "error" not in err


def test_run_refuses_a_swap_folder_on_a_full_filesystem(tmp_path):
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tiny)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        folder = tiny / "swap"
        proc = zdsl("run", str(NVME), "--set", f'offload.parameters=nvme("{folder}")',
                    "--set", f'offload.optimizer=nvme("{folder}")')
        assert proc.returncode == 1, proc.stderr
        assert f"zdsl: error: the swap folder {folder} has" in proc.stderr and "bytes) free" in proc.stderr
        assert "no rank was started" in proc.stderr and "Traceback" not in proc.stderr
        assert not folder.exists()
    finally:
        subprocess.run(["umount", str(tiny)], check=True)


# -- checkpoints: a folder to save in, and one that can be written -------------------------
# (the ranks' fit is not the question here: a fake floor, and --ignore-limits)

def test_checkpoint_every_without_a_folder_is_a_usage_error(fake_floor, launches):
    code, err = run_args(str(QUICK), "--checkpoint-every", "10", "--ignore-limits")
    assert code == 2 and launches == []
    assert "zdsl: error: --checkpoint-every 10 needs a folder" in err and "--checkpoint-dir DIR" in err
    assert 'checkpoint every 10 steps -> "DIR"' in err


def test_an_unwritable_checkpoint_folder_is_found_before_any_rank_starts(tmp_path, fake_floor, launches):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code, err = run_args(str(QUICK), "--checkpoint-every", "2", "--checkpoint-dir", str(blocker / "ck"),
                         "--ignore-limits")
    assert code == 2 and launches == []
    assert f"zdsl: error: cannot write checkpoints to {blocker / 'ck'} (from --checkpoint-dir)" in err
    # the schedule's own statement is checked the same way, and named as the source
    program = schedule_with(tmp_path, QUICK, **{"zero      3": f'zero      3\ncheckpoint every 2 steps -> "{blocker}/ck"'})
    code, err = run_args(str(program), "--ignore-limits")
    assert code == 2 and launches == [] and "the schedule's `checkpoint` statement" in err


def test_a_writable_checkpoint_folder_is_made_and_left_empty(tmp_path, fake_floor, launches):
    ck = tmp_path / "new" / "ck"
    code, _ = run_args(str(QUICK), "--checkpoint-every", "2", "--checkpoint-dir", str(ck), "--ignore-limits")
    assert code == 0 and launches == [2]
    assert ck.is_dir() and list(ck.iterdir()) == []       # the probe file is gone


# -- zdsl plan shows the same comparison -------------------------------------------------

def test_plan_shows_whether_the_schedule_fits_this_machine(tmp_path, fake_floor):
    from zdsl.cli import main
    program = schedule_with(tmp_path, QUICK, **{"ranks     2 on cpu": "ranks 1000 on cpu"})
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["plan", str(program)]) == 0
    assert "does NOT fit this machine" in out.getvalue() and "1000 ranks do not fit" in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["plan", str(program), "--json"]) == 0
    fit = json.loads(out.getvalue())["machine_fit"]
    assert fit["fits"] is False and fit["ranks"] == 1000 and fit["torch_floor"]["private"] == HUGE_FLOOR
    assert fit["ram_needed"] > fit["ram_available"] and 0 <= fit["ranks_fitting"] < 1000


# -- a model file imports the modules beside it ------------------------------------------

def test_a_model_file_imports_a_module_beside_it(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(ROOT / "programs" / "my_model.py", folder / "zdsl_beside_net.py")
    (folder / "beside_model.py").write_text("from zdsl_beside_net import build  # a module next to this file\n")
    program = schedule_with(tmp_path, ROOT / "programs" / "user_model.zs",
                            **{'"my_model.py:build"': f'"{folder / "beside_model.py"}:build"'})
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    for command in (["check", str(program)], ["plan", str(program)],
                    ["run", str(program), "--quiet", "--set", "steps=1"]):
        proc = zdsl(*command, cwd=elsewhere)
        assert proc.returncode == 0, (command, proc.stderr)
        assert "ModuleNotFoundError" not in proc.stderr


def test_measuring_the_torch_floor_leaves_no_folder_behind(tmp_path, monkeypatch):
    """The measuring process ends with os._exit (gloo's teardown can abort it), past its temporary
    folder's clean-up: it removes the folder itself."""
    from zdsl.runtime.run.preflight import measure_floor
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    floor = measure_floor()
    assert floor["private"] > 0 and list(tmp_path.iterdir()) == []
