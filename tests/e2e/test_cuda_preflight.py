"""`ranks N on cuda` on a node with fewer than N CUDA devices: refused before any rank starts.

The decision is tested with a stubbed device count; the command end to end with CUDA_VISIBLE_DEVICES=""
(torch then sees no device on any machine, this CUDA-less one included). No test here starts a rank.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from helpers import zdsl

from zdsl.runtime.run.preflight import missing_cuda

QUICK = Path(__file__).parents[2] / "programs" / "quickstart.zs"      # ranks 2 on cpu


def on_cuda(tmp_path: Path, ranks: int = 2) -> Path:
    text = QUICK.read_text()
    assert "ranks     2 on cpu" in text
    out = tmp_path / "cuda.zs"
    out.write_text(text.replace("ranks     2 on cpu", f"ranks {ranks} on cuda"))
    return out


# -- the decision, on a stubbed count --------------------------------------------------------

@pytest.mark.parametrize("seen", [0, 1])
def test_fewer_devices_than_ranks_is_refused_with_the_count_and_a_fix(seen, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    problem = missing_cuda("cuda", 2, 2, count=lambda: seen)
    assert problem is not None
    assert f"torch sees {seen} CUDA device{'s' if seen == 0 else ''} here" in problem
    assert "`ranks 2 on cpu`" in problem and "--set 'ranks=2 on cpu'" in problem
    assert ("`ranks 1 on cuda`" in problem) == (seen == 1)      # the devices there are, where some are


@pytest.mark.parametrize("seen", [2, 3])
def test_a_device_per_rank_or_more_passes(seen):
    assert missing_cuda("cuda", 2, 2, count=lambda: seen) is None


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_schedule_not_on_cuda_never_counts_devices(device):
    def count():
        raise AssertionError("counted CUDA devices for a schedule not on cuda")
    assert missing_cuda(device, 2, 2, count=count) is None


def test_under_another_launcher_the_node_needs_a_device_per_rank_it_holds(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert missing_cuda("cuda", 2, 8, count=lambda: 2) is None            # 2 of 8 ranks here, 2 devices
    problem = missing_cuda("cuda", 4, 8, count=lambda: 1)
    assert "`ranks 8 on cuda` puts 4 ranks on this node" in problem and "sees 1 CUDA device here" in problem
    assert "(CUDA_VISIBLE_DEVICES='0')" in problem and "`ranks 8 on cpu`" in problem
    assert "ranks 1 on cuda" not in problem         # the other nodes' ranks are not this node's to cut


def test_under_torchrun_every_rank_stops_and_the_nodes_first_says_why(tmp_path, monkeypatch, capsys):
    import torch
    from zdsl.driver import compile_file
    from zdsl.runtime.run.cli import build_parser
    from zdsl.runtime.run.preflight import preflight
    program = on_cuda(tmp_path)
    compiled = compile_file(str(program), {}, simulate=False)
    args = build_parser().parse_args([str(program)])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("ZDSL_ERROR_FILE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank, spoke in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert preflight(compiled, args, {}) == 1
        err = capsys.readouterr().err
        assert ("zdsl: error: `ranks 2 on cuda` puts 2 ranks on this node" in err) == spoke
        assert "no rank was started" not in err        # they were: torchrun started them


# -- the command end to end ------------------------------------------------------------------

def test_run_refuses_before_any_rank_starts(tmp_path, monkeypatch):
    from zdsl.runtime.run import cli
    from zdsl.runtime.run.cli import main
    started = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(cli, "launch_local", lambda child, ranks, **kw: started.append(ranks) or 0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(on_cuda(tmp_path))])
    assert code == 1 and started == []
    assert "torch sees 0 CUDA devices here" in err.getvalue()


def test_run_cli_says_so_in_one_error_line_with_no_traceback(tmp_path):
    proc = zdsl("run", str(on_cuda(tmp_path, ranks=3)), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1, proc.stderr
    [error] = [line for line in proc.stderr.splitlines() if line.startswith("zdsl: error:")]
    assert "`ranks 3 on cuda` puts 3 ranks on this node, a CUDA device each" in error
    assert "torch sees 0 CUDA devices here (CUDA_VISIBLE_DEVICES='')" in error and "`ranks 3 on cpu`" in error
    assert "no rank was started" in proc.stderr
    assert "Traceback" not in proc.stderr and "rank 0" not in proc.stderr and "rank 1" not in proc.stderr
