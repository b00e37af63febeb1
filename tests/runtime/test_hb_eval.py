"""The happens-before checker (runtime/exec/hb_check.py) over a schedule with ``eval``: the
evaluation's forward graph runs between steps with an executor of its own, which on CUDA has lane
streams of its own. Under the checker it is ordered by that graph on the run's streams (the
checker's ``for_graph`` seam), so its gathers and frees are what CUDA would order, and training
and evaluation are checked against each other. Before, it ran with no seam: its ops were the
caller's work on the default stream, which waits for no collective, and every ``ZDSL_HB_CHECK=1``
run of a ZeRO-3 schedule with ``eval`` failed on its first evaluation."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCHEDULE = """schedule hb_eval
model     gpt(layers=2, width=32, heads=2, vocab=64, context=16)
data      synthetic(vocab=64, context=16)
train     steps={steps}, batch=2, precision=fp32, seed=0
optimizer adamw(lr=1e-3)
ranks     1 on cpu
zero      {stage}
eval      every 1 steps on synthetic(vocab=64, context=16) batches=2
"""


def compiled(tmp_path: Path, stage: int = 3, steps: int = 2):
    from zdsl.driver import compile_file
    path = tmp_path / "hb_eval.zs"
    path.write_text(SCHEDULE.format(stage=stage, steps=steps))
    out = compile_file(str(path), None, simulate=False)
    assert out.ok and out.eval_graph is not None, [d.message for d in out.diagnostics]
    assert any(op.is_collective for op in out.eval_graph.ops) == (stage == 3)     # ZeRO-3: it gathers
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_training_and_its_evaluation_have_no_race_as_if_on_cuda(tmp_path, one_rank_group, stage):
    from zdsl.runtime.run.hb_steps import check_steps
    c = compiled(tmp_path, stage)
    checker = check_steps(c.graph, c.schedule, steps=2, eval_graph=c.eval_graph)
    assert checker.clocks.races == []
    assert checker.step == 1


def test_the_evaluation_is_ordered_by_its_own_graph_on_the_runs_streams(tmp_path, one_rank_group):
    """Not vacuous: the evaluation's ops were run through the seam (its lanes stamped, its
    collectives' work on NCCL's stream recorded for its own ops, not the training graph's)."""
    from zdsl.runtime.exec.hb_check import HBChecker, streams_for
    from zdsl.runtime.run.hb_steps import check_steps
    c = compiled(tmp_path, 3, steps=1)
    seams = []
    made = HBChecker.for_graph

    def keep(self, graph, what):
        seams.append(made(self, graph, what))
        return seams[-1]
    HBChecker.for_graph = keep
    try:
        check_steps(c.graph, c.schedule, steps=1, eval_graph=c.eval_graph)
    finally:
        HBChecker.for_graph = made
    (seam,) = seams
    assert seam.graph is c.eval_graph and seam.what == "evaluation" and seam.timing is False
    assert seam.step == 1                                              # 2 eval batches
    gathers = [op.id for op in c.eval_graph.ops if op.is_collective]
    assert set(gathers) <= set(seam.work)
    assert streams_for(None, c.eval_graph, torch.device("cpu"), "evaluation") is None   # a plain CPU run


@pytest.mark.slow        # starts a rank (seconds of CPU to import torch); the cases above are the quick part
def test_zdsl_run_with_the_checker_and_eval_succeeds(tmp_path):
    """The same through ``zdsl run``: the run's checker reaches its evaluator."""
    (tmp_path / "hb_eval.zs").write_text(SCHEDULE.format(stage=3, steps=2))
    env = dict(os.environ, ZDSL_HB_CHECK="1")
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "run", "hb_eval.zs", "--quiet"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "val_loss" in proc.stdout, proc.stdout
