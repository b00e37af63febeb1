"""programs/hf_finetune_loop.py: a Hugging Face fine-tune in the user's own loop, run as a user
would, on one rank in this process (``--ranks 1``). It must learn (its own label-smoothed loss
falls over the small set it cycles through) and its export must load with ``from_pretrained``,
no key missing or unexpected, and score the set better than the model it started from."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
PROGRAM = Path(__file__).parents[2] / "programs" / "hf_finetune_loop.py"


def test_the_hf_finetune_program_learns_and_exports(tmp_path):
    spec = importlib.util.spec_from_file_location("hf_finetune_loop", PROGRAM)
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    losses = program.train(steps=8, export=tmp_path / "out", ranks=1)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    torch.manual_seed(0)        # the program's initial model, built as it builds it
    initial = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(PROGRAM.parent / "llama"))
    ids, targets = program.batches(0, 0, 0, 0, 1, 4)
    with torch.no_grad():
        before, after = (F.cross_entropy(m(ids).logits.reshape(-1, program.VOCAB), targets.reshape(-1)).item()
                         for m in (initial, loaded))
    assert before == pytest.approx(losses[0], abs=0.2)      # the program's start (its loss is label-smoothed)
    assert after < before - 0.3, (before, after)
