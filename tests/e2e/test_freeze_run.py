"""``freeze`` through `zdsl run`: checkpoints of partly frozen units resume to the bit and re-cut
into another freeze list or stage, a checkpoint exports every parameter, a fine-tune from a
checkpoint without freeze keeps the frozen parameters as loaded, and `zdsl plan` shows the saving."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import zdsl

pytestmark = pytest.mark.slow     # spawns ranks

QUICK = str(Path(__file__).parents[2] / "programs" / "quickstart.zs")
MODEL = dict(layers=2, width=64, heads=4, vocab=256, context=32)
FREEZE = 'freeze=embedding.*, "*.bias", "*.ln_1.weight"'   # a whole unit and parts of every block


def run(*args, ok=True):
    proc = zdsl("run", QUICK, "--quiet", "--set", "steps=4", *args)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def frozen_keys(state: dict) -> set[str]:
    return {k for k in state if k.startswith("embedding.") or k.endswith(".bias") or k.endswith("ln_1.weight")}


def test_checkpoints_of_frozen_units_resume_recut_and_export(tmp_path):
    ck, full, resumed = tmp_path / "ck", tmp_path / "full.safetensors", tmp_path / "resumed.safetensors"
    run("--set", FREEZE, "--checkpoint-every", "2", "--checkpoint-dir", str(ck), "--export", str(full))
    run("--set", FREEZE, "--resume", str(ck / "step-000002"), "--export", str(resumed))
    a, b = load_file(str(full)), load_file(str(resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from zdsl.runtime.models.gpt import GPT
    init = {n: p.detach() for n, p in GPT(**MODEL, seed=0).named_parameters()}
    assert {k for k in init if torch.equal(init[k], a[k])} == frozen_keys(init)

    exported = tmp_path / "exported.safetensors"
    proc = zdsl("export", str(ck / "step-000004"), "-o", str(exported))
    assert proc.returncode == 0, proc.stderr
    c = load_file(str(exported))
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)
    GPT(**MODEL, seed=0).load_state_dict(c, strict=True)

    # the same checkpoint continues under another freeze list and stage (shards re-cut by name order)
    other = tmp_path / "other.safetensors"
    run("--set", "freeze=embedding.*", "--set", "zero=1", "--resume", str(ck / "step-000002"), "--export", str(other))
    d = load_file(str(other))
    assert torch.equal(d["embedding.wte.weight"], init["embedding.wte.weight"])
    assert not torch.equal(d["blocks.0.attn.c_attn.bias"], init["blocks.0.attn.c_attn.bias"])


def test_fine_tuning_from_a_checkpoint_keeps_the_frozen_parameters_as_loaded(tmp_path):
    ck, tuned, loaded = tmp_path / "ck", tmp_path / "tuned.safetensors", tmp_path / "loaded.safetensors"
    run("--set", "steps=2", "--checkpoint-every", "2", "--checkpoint-dir", str(ck))
    assert zdsl("export", str(ck / "step-000002"), "-o", str(loaded)).returncode == 0
    run("--set", FREEZE, "--resume", str(ck / "step-000002"), "--export", str(tuned))
    before, after = load_file(str(loaded)), load_file(str(tuned))
    frozen = frozen_keys(before)
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert not any(torch.equal(before[k], after[k]) for k in before if k not in frozen)


def test_plan_shows_the_saving_and_a_bad_pattern_is_positioned():
    proc = zdsl("plan", QUICK, "--set", FREEZE)
    assert proc.returncode == 0, proc.stderr
    assert "freeze:" in proc.stdout and "parameters frozen" in proc.stdout and "not sent" in proc.stdout
    proc = zdsl("check", QUICK, "--set", "freeze=embeding.*")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "matches no parameter" in proc.stderr + proc.stdout and "embedding.wte.weight" in proc.stderr + proc.stdout
