"""Every shipped program, one step on 2 gloo ranks under the CPU happens-before checker
(runtime/exec/hb_check.py), as if on CUDA: no race. capacity.zs runs at a tiny size; what the
schedules cover beyond the programs (every stage, fp16, ...) is tests/runtime/test_hb_check.py's.
``ZDSL_HB_CHECK=1 zdsl run`` runs the same checker: with the ZeRO-1 free path before its fix, the
run fails with the race's report and no traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_reference import spawn

PROGRAMS = Path(__file__).resolve().parents[2] / "programs"
TINY = {"capacity.zs": {"model.layers": "2", "model.width": "64", "model.heads": "2", "ranks": "2"}}


def check_programs(rank: int, world: int, names: list[str]) -> dict[str, str | None]:
    """In each rank: every program's first step under the checker; its race report, or None."""
    from zdsl.driver import compile_file
    from zdsl.runtime.exec.hb_check import HBRaceError
    from zdsl.runtime.run.hb_steps import check_steps
    out = {}
    for name in names:
        compiled = compile_file(str(PROGRAMS / name), {"steps": "1", **TINY.get(name, {})}, simulate=False)
        if not compiled.ok:
            out[name] = "does not compile: " + "; ".join(d.message for d in compiled.diagnostics)
            continue
        try:
            check_steps(compiled.graph, compiled.schedule, rank, world, steps=1)
            out[name] = None
        except HBRaceError as exc:          # the other rank finished the step too: go on together
            out[name] = str(exc)
    return out


@pytest.mark.slow        # about 30 s; the CLI run below and tests/runtime/test_hb_check.py are the fast part
def test_every_program_runs_a_step_on_two_ranks_with_no_race_as_if_on_cuda():
    names = sorted(p.name for p in PROGRAMS.glob("*.zs") if not p.name.startswith("."))   # not a test's scratch
    assert len(names) >= 10 and "capacity.zs" in names
    results = spawn(check_programs, 2, names)
    found = {name: text for by_rank in results for name, text in by_rank.items() if text is not None}
    assert not found, "\n".join(f"{name}: {text}" for name, text in found.items())


# in the ranks of the run below: the free path before commit 0a8a67d (no record_stream)
BEFORE_THE_FIX = """import os
if os.environ.get("RANK") is not None:
    from zdsl.runtime.exec import hb_check
    init = hb_check.HBChecker.__init__
    hb_check.HBChecker.__init__ = lambda self, graph, state=None, rank=0, record_streams=True: \\
        init(self, graph, state, rank, False)
"""


@pytest.mark.slow      # zdsl run starts 2 ranks
def test_zdsl_run_with_the_checker_fails_on_the_zero1_race_naming_rank_ops_lanes_and_buffer(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BEFORE_THE_FIX)
    env = dict(os.environ, ZDSL_HB_CHECK="1", PYTHONPATH=os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "run", str(PROGRAMS / "zero1.zs"), "--set", "steps=1",
                           "--quiet"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    assert "zdsl: error: rank " in proc.stderr and ": happens-before check:" in proc.stderr, proc.stderr
    assert "grad_shard[" in proc.stderr and "op #" in proc.stderr and "comm.reduce_scatter" in proc.stderr
    assert "on lane compute" in proc.stderr and "unit " in proc.stderr and "pool of the comm stream" in proc.stderr
    assert "Traceback" not in proc.stderr
