"""`zdsl tune`: plan every combination, measure the best, write a winner that re-checks.

Two short measured tunes end to end (one run of one candidate; one round of two on the tiny
ZeRO-3 schedule), 2 ranks and 3 steps a run; the rest is the planner half, which is instant. The
rounds' logic on synthetic measurements is tests/compiler/test_tune_verdicts.py. Whole file: about
half a minute on a quiet 2-core machine.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL, zdsl

from zdsl.tune.search import TuneUsageError

from zdsl.tune.search import combinations

from zdsl.tune.search import parse_vary

from zdsl.tune.search import predict

from zdsl.tune.search import split_values

from zdsl.tune.write import write_schedule_text

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

ROOT = Path(__file__).parents[2]
QUICK = str(ROOT / "programs" / "quickstart.zs")
ZERO3 = str(ROOT / "programs" / "zero3.zs")


def test_tiny_tune_measures_prints_and_writes_a_schedule_that_checks(tmp_path):
    out = tmp_path / "best.zs"
    proc = zdsl("tune", QUICK, "--vary", "prefetch=1,2", "--measure", "1", "--steps", "3", "--warmup", "1",
                "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    table = proc.stdout
    for column in ("combination", "predicted", "measured", "peak device", "verdict"):
        assert column in table, table
    assert "prefetch=1" in table and "prefetch=2" in table
    assert "best (measured)" in table and "not measured" in table
    assert "ms" in table.split("best (measured)")[0].splitlines()[-1]   # the winner's row has times
    assert out.is_file()
    checked = zdsl("check", str(out))
    assert checked.returncode == 0, checked.stderr


def test_tune_in_rounds_prints_median_spread_rounds_and_verdicts(tmp_path):
    """A budget smaller than one round: the first round still runs every candidate, nothing is decided."""
    zs, out = tmp_path / "small.zs", tmp_path / "best.zs"
    zs.write_text(SMALL)
    proc = zdsl("tune", str(zs), "--vary", "prefetch=0..1", "--measure", "2", "--budget", "1", "--steps", "3",
                "--warmup", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "zdsl tune: round 1: " in proc.stderr and "fastest median prefetch=" in proc.stderr
    assert "stopped after 1 round(s)" in proc.stderr and "the budget (1 s) would end during round 2" in proc.stderr
    table = proc.stdout
    assert "1 interleaved round(s) of 3 steps (first 1 not timed)" in " ".join(table.split())
    for column in ("combination", "predicted", "measured", "spread ms", "rounds", "step/pred", "peak device",
                   "verdict"):
        assert column in table, table
    rows = [ln for ln in table.splitlines() if ln.startswith("\u2502") and "prefetch=" in ln]
    assert len(rows) == 2, table
    for row in rows:
        cells = [c.strip() for c in row.split("\u2502") if c.strip()]
        assert cells[3].endswith(" ms") and ".." in cells[4] and cells[5] == "1", cells   # median, spread, rounds
        assert float(cells[6]) > 0, cells                                  # the median step over the prediction
    assert "best (measured)" in table and "undecided" in table
    assert out.is_file() and zdsl("check", str(out)).returncode == 0


def test_bad_vary_key_is_a_usage_error():
    proc = zdsl("tune", QUICK, "--vary", "prefetchh=1,2", "--measure", "0")
    assert proc.returncode == 2
    assert "prefetchh" in proc.stderr and "did you mean 'prefetch'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("vary", ["prefetch=one,2", "prefetch=", "bucket=64Mib", "prefetch"])
def test_bad_vary_values_are_usage_errors(vary):
    proc = zdsl("tune", QUICK, "--vary", vary, "--measure", "0")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "zdsl tune: error" in proc.stderr


def test_split_values_keeps_tuples_and_pipe_separated_lists():
    assert split_values("1,2,4") == ["1", "2", "4"]
    assert split_values("(0.9,0.95),(0.9,0.999)") == ["(0.9,0.95)", "(0.9,0.999)"]
    assert split_values("all|gather/forward, scatter/backward") == ["all", "gather/forward, scatter/backward"]
    with pytest.raises(TuneUsageError):
        parse_vary(["prefetch=1", "prefetch=2"])


def test_over_budget_combinations_are_rejected_never_ranked():
    vary = parse_vary(["prefetch=0,4"])
    cands = predict(ZERO3, {"memory.device": "2800KiB"}, combinations(vary))
    by = {c.combo["prefetch"]: c for c in cands}
    assert by["0"].rejected is None and by["0"].predicted_s > 0
    assert by["4"].rejected and "exceeds the budget" in by["4"].rejected


def test_winner_text_keeps_comments_and_reproduces_the_graph(tmp_path):
    out = tmp_path / "z3.zs"
    text, how = write_schedule_text(ZERO3, {"prefetch": "1", "bucket": "64KiB"}, str(out))
    assert how == "edited"
    assert "# zero3.zs" in text and "bucket 64KiB" in text and "prefetch 1" in text
    out.write_text(text)
    assert zdsl("check", str(out)).returncode == 0


def test_a_winner_replaces_a_statement_wrapped_over_several_lines(tmp_path):
    """A statement may go on inside '(' or after a trailing ','; the edit replaces all its lines."""
    src = tmp_path / "wrapped.zs"
    text = Path(ZERO3).read_text().replace(
        "optimizer adamw(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, clip=1.0)",
        "optimizer adamw(lr=3e-3,\n                # the paper's betas\n                betas=(0.9, 0.95),\n"
        "                weight_decay=0.1, clip=1.0)\n\n# between statements")
    assert text.count("\n                ") == 3
    src.write_text(text)
    out = tmp_path / "tuned.zs"
    written, how = write_schedule_text(str(src), {"optimizer": "adamw(lr=0.01)"}, str(out))
    assert how == "edited", written
    assert "optimizer adamw(lr=0.01)" in written and "# between statements" in written
    assert "was: optimizer adamw(lr=3e-3, # the paper's betas betas" not in written
    assert "#                weight_decay=0.1, clip=1.0)" in written
    out.write_text(written)
    assert zdsl("check", str(out)).returncode == 0


def test_winner_from_an_override_the_text_cannot_take_is_printed(tmp_path):
    out = tmp_path / "q.zs"
    text, how = write_schedule_text(QUICK, {"lr": "0.01", "prefetch": "2"}, str(out))
    assert how == "printed" and "lr=0.01" in text
    out.write_text(text)
    assert zdsl("check", str(out)).returncode == 0


def test_planning_half_imports_no_torch(tmp_path):
    """Without --measure the whole tune (plan, table, winner) runs without torch: measured runs are
    subprocesses, so the tuner itself never needs it."""
    code = ("import contextlib, io, sys\nfrom zdsl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    rc = main(['tune', {QUICK!r}, '--vary', 'prefetch=0,1', 'bucket=0,64KiB', '--measure', '0',"
            f" '--out', {str(tmp_path / 'w.zs')!r}])\n"
            "print(rc, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "0 []"
    assert (tmp_path / "w.zs").is_file()
