"""``eval`` with a Hugging Face model that has dropout: the evaluation runs with dropout off (the
model in eval mode, as transformers' own evaluation), and training, whose dropout draws random
numbers, keeps exactly the losses it has without evaluating."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hf_tiny import CONTEXT
from hf_tiny import save_tiny
from hf_tiny import transformers_model
from helpers import sized
from helpers import zdsl

pytestmark = pytest.mark.slow     # spawns ranks

EVAL_SOURCE = 'synthetic(vocab=200)'
SCHEDULE = f"""schedule hf_eval
model hf("model")
data corpus("stdlib", context={CONTEXT})
train steps=3, batch=2, seed=0
optimizer adamw(lr=1e-3)
ranks 2 on cpu
zero 3
"""


def run(folder, *args) -> list[dict]:
    r = zdsl("run", "s.zs", "--quiet", "--metrics", "m.jsonl", *args, cwd=folder)
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in (folder / "m.jsonl").read_text().splitlines()]


def test_eval_mode_and_training_bits_with_dropout(tmp_path):
    from zdsl.runtime.data import make_batch
    from zdsl.schedule import DataSpec

    save_tiny("gpt2", tmp_path / "model", resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    (tmp_path / "s.zs").write_text(SCHEDULE)
    sized(tmp_path / "s.zs")
    without = run(tmp_path)
    with_eval = run(tmp_path, "--set", f"eval=every 1 steps on {EVAL_SOURCE} batches=2",
                    "--export", "out", "--format", "hf")
    assert [x["loss"] for x in with_eval] == [x["loss"] for x in without]     # dropout drew the same numbers
    assert all(x["val_loss"] is not None for x in with_eval)

    model = transformers_model(tmp_path / "out").eval()     # the trained weights; dropout off
    data = DataSpec("synthetic", None, {"vocab": 200, "context": CONTEXT})
    logits, labels = [], []
    with torch.no_grad():
        for rank in range(2):
            for i in range(2):
                idx, targets = make_batch(data, 0, i, 0, rank, 2, 2)
                logits.append(model(input_ids=idx).logits.flatten(0, 1))
                labels.append(targets.flatten())
    ref = float(F.cross_entropy(torch.cat(logits).double(), torch.cat(labels)))
    assert abs(with_eval[-1]["val_loss"] - ref) <= 1e-6
