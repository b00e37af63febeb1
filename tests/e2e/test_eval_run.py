"""``zdsl run`` with ``eval every N steps on SOURCE batches=K``: val_loss in --metrics, the progress
lines, the summary and TensorBoard on exactly the steps that evaluate; a bad eval source stops the
run before any rank starts, with a positioned error or one naming the file."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from helpers import QUICKSTART
from helpers import zdsl

EVAL = 'every 2 steps on corpus("stdlib") batches=2'


@pytest.mark.slow      # spawns 2 ranks
def test_val_loss_on_the_steps_that_evaluate(tmp_path):
    pytest.importorskip("tensorboard")
    from test_tensorboard import scalars

    metrics, board = tmp_path / "m.jsonl", tmp_path / "tb"
    r = zdsl("run", str(QUICKSTART), "--set", "steps=5", "--set", f"eval={EVAL}", "--metrics", str(metrics),
             "--tensorboard", str(board))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(text) for text in metrics.read_text().splitlines()]
    val = {line["step"]: line["val_loss"] for line in lines if line["val_loss"] is not None}
    assert sorted(val) == [1, 3, 4]                       # after steps 2 and 4, and after the last
    assert all("val_loss" in line for line in lines)      # null on the others
    assert all(math.isfinite(v) and 0 < v < math.log(256) + 1 for v in val.values())
    assert val[4] < val[1], "the model learns: its validation loss falls"
    shown = [x for x in r.stdout.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in shown if "val_loss" in x] == ["2/5", "4/5", "5/5"]
    assert f"val_loss {val[4]:.4f}" in shown[-1]
    assert any("val_loss" in x and f"{val[4]:.4f} (step 5)" in x for x in r.stdout.splitlines())   # summary
    (tags,) = scalars(board).values()
    assert tags["loss/val"] == val                        # TensorBoard: the --metrics value, to the bit

    # checkpoints are unaffected: stopped after step 2 and resumed, the same values at the same steps
    ck, first, rest = tmp_path / "ck", tmp_path / "first.jsonl", tmp_path / "rest.jsonl"
    for args, out in ((("--set", "steps=2", "--checkpoint-every", "2", "--checkpoint-dir", str(ck)), first),
                      (("--set", "steps=5", "--resume", str(ck)), rest)):
        r = zdsl("run", str(QUICKSTART), "--quiet", "--set", f"eval={EVAL}", "--metrics", str(out), *args)
        assert r.returncode == 0, r.stderr
    resumed = [json.loads(text) for text in (first.read_text() + rest.read_text()).splitlines()]
    assert [(x["step"], x["loss"], x["val_loss"]) for x in resumed] == \
        [(x["step"], x["loss"], x["val_loss"]) for x in lines]


def test_a_missing_eval_source_stops_before_any_rank(tmp_path):
    program = tmp_path / "q.zs"
    program.write_text(QUICKSTART.read_text() + 'eval every 2 steps on tokens("val.bin")\n')
    r = zdsl("run", str(program), "--set", "steps=2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = len(program.read_text().splitlines())
    assert f"q.zs:{line}:" in r.stderr and "val.bin" in r.stderr and "not found" in r.stderr


def test_eval_ids_outside_the_vocab_stop_the_run_before_any_rank(tmp_path):
    """The eval source is prepared and checked as the training data is (runtime/run/preflight.py)."""
    ids = np.arange(4096, dtype=np.uint16) % 256
    ids[3000] = 300                                       # the quickstart's vocab is 256
    ids.tofile(tmp_path / "val.bin")
    program = tmp_path / "q.zs"
    program.write_text(QUICKSTART.read_text() + 'eval every 2 steps on tokens("val.bin")\n')
    r = zdsl("run", str(program), "--set", "steps=2", "--ignore-limits")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "zdsl: error: token file" in r.stderr and "val.bin holds id 300 at token 3000" in r.stderr
