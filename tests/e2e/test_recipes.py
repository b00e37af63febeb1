"""The recipes to copy: programs/pretrain.zs, then programs/finetune.zs from the
weights it exported, each for a few steps through the CLI, as the recipes' comments tell a user to."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import sized
from helpers import zdsl

pytestmark = pytest.mark.slow     # spawns ranks

PROGRAMS = Path(__file__).parents[2] / "programs"


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(program: str, *args, cwd):
    proc = zdsl("run", str(PROGRAMS / program), "--quiet", *args, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_pretrain_then_finetune_from_its_export(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sized(PROGRAMS / "pretrain.zs")
    run("pretrain.zs", "--set", "steps=4", "--set", "warmup=1", "--metrics", str(tmp_path / "pre.jsonl"),
        "--export", "pre", "--format", "hf", cwd=tmp_path)
    rows = metrics(tmp_path / "pre.jsonl")
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]
    assert [r["val_loss"] is not None for r in rows] == [False, False, False, True]    # after the last step
    pre = load_file(str(tmp_path / "pre" / "model.safetensors"))

    run("finetune.zs", "--set", 'model=hf("pre")', "--set", "steps=8", "--set", "lr=3e-3", "--set", "warmup=1",
        "--metrics", str(tmp_path / "ft.jsonl"), "--export", "ft", "--format", "hf", cwd=tmp_path)
    rows = metrics(tmp_path / "ft.jsonl")
    assert len(rows) == 8 and rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "ft")).config.vocab_size == 4096
    ft = load_file(str(tmp_path / "ft" / "model.safetensors"))
    # the frozen embedding is the pretrained one, bit for bit; what trained moved
    assert torch.equal(ft["model.embed_tokens.weight"], pre["model.embed_tokens.weight"])
    assert not torch.equal(ft["lm_head.weight"], pre["lm_head.weight"])
