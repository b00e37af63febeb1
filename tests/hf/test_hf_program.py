"""programs/llama.zs, the teaching program for `model hf(...)`: it checks, plans and trains as its
comments say, and its export loads back into transformers. (The compiler's tests over every
programs/*.zs parse, lower and plan it too.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from zdsl.cli import main

PROGRAM = Path(__file__).resolve().parents[2] / "programs" / "llama.zs"


@pytest.mark.parametrize("command", ["check", "plan"])
def test_llama_program_checks_and_plans(command, capsys):
    assert main([command, str(PROGRAM)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "6 units" in out


@pytest.mark.slow
def test_llama_program_trains_and_exports(tmp_path):
    env = dict(os.environ)
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "run", str(PROGRAM), "--quiet", "--set", "steps=3",
                           "--export", "out", "--format", "hf"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "3 steps" in proc.stdout
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert model.config.num_hidden_layers == 4 and not model.config.tie_word_embeddings
