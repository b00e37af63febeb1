"""The recipes to copy (issue 21 item 10): programs/pretrain.zs, then programs/finetune.zs from its
exported weights, each for a few steps through the CLI, as a user would run them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import zdsl

pytestmark = pytest.mark.slow     # spawns ranks

PROGRAMS = Path(__file__).parents[2] / "programs"


def losses(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(program: str, *args, cwd):
    proc = zdsl("run", str(PROGRAMS / program), "--quiet", *args, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_finetune_learns_the_answers_with_the_embedding_frozen(tmp_path):
    run("finetune.zs", "--set", "steps=8", "--set", "lr=3e-3", "--set", "warmup=1", "--metrics", str(tmp_path / "m.jsonl"),
        "--export", str(tmp_path / "out"), "--format", "hf", cwd=tmp_path)
    rows = losses(tmp_path / "m.jsonl")
    assert len(rows) == 8 and rows[-1]["loss"] < rows[0]["loss"] - 0.5
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from zdsl.runtime.models.hf import load
    from zdsl.schedule import ModelSpec
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).config.vocab_size == 4096
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    # the frozen embedding is still its initial value (HF's init from the schedule's seed); the head trained
    initial = load(ModelSpec("hf", {"vocab": 4096}, path=str(PROGRAMS / "llama")), seed=0)
    assert torch.equal(exported["model.embed_tokens.weight"], initial.embedding.embed_tokens.weight.detach())
    assert not torch.equal(exported["lm_head.weight"], initial.head.lm_head.weight.detach())
