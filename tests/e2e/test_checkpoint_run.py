"""Checkpoints through `zdsl run`: bitwise resume, resume at other rank counts and placements (with
the uninterrupted run's data order), damaged checkpoints refused with a fallback, retention, a rank
killed while saving."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import zdsl

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

ROOT = Path(__file__).parents[2]
QUICK = str(ROOT / "programs" / "quickstart.zs")
MODEL = dict(layers=2, width=64, heads=4, vocab=256, context=32)


def run(*args, env=None, ok=True, program=QUICK):
    proc = zdsl("run", str(program), "--quiet", *args, env=env)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def update_rel(a: dict, b: dict) -> float:
    from zdsl.runtime.models.gpt import GPT
    init = {n: p.detach() for n, p in GPT(**MODEL, seed=0).named_parameters()}
    da = torch.cat([(a[k] - init[k]).flatten() for k in init])
    db = torch.cat([(b[k] - init[k]).flatten() for k in init])
    return float((da - db).norm() / db.norm())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "full.safetensors"
    run("--set", "steps=6", "--export", str(out))
    return load_file(str(out))


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory) -> Path:
    """The checkpoints of quickstart's first 2 steps (saved every 2), made once: copy before writing."""
    ck = tmp_path_factory.mktemp("two") / "ck"
    run("--set", "steps=2", "--checkpoint-every", "2", "--checkpoint-dir", str(ck))
    return ck


def copy_of(ck: Path, into: Path) -> Path:
    return Path(shutil.copytree(ck, into / "ck"))


def test_interrupted_and_resumed_is_bitwise_equal(tmp_path, uninterrupted):
    ck, out = tmp_path / "ck", tmp_path / "resumed.safetensors"
    # rank 0 dies in step 5, while the save after step 4 may still be writing: whichever checkpoint
    # is complete must resume to exactly the uninterrupted parameters
    first = run("--set", "steps=6", "--checkpoint-every", "2", "--checkpoint-dir", str(ck),
                env={"ZDSL_FAULT": "0:2:kill:5"}, ok=False)
    assert first.returncode == 1 and "SIGKILL" in first.stderr
    proc = run("--set", "steps=6", "--resume", str(ck), "--export", str(out))
    assert "resumed at step 4" in proc.stdout or "resumed at step 2" in proc.stdout
    resumed = load_file(str(out))
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def test_resume_at_4_then_1_ranks(tmp_path, uninterrupted, saved_at_2):
    # the global batch stays 8 sequences, so the runs see the same data
    ck, out = copy_of(saved_at_2, tmp_path), tmp_path / "r.safetensors"
    run("--set", "steps=4", "--set", "ranks=4", "--set", "batch=2", "--resume", str(ck),
        "--checkpoint-every", "2", "--checkpoint-dir", str(ck))
    proc = run("--set", "steps=6", "--set", "ranks=1", "--set", "batch=8", "--resume", str(ck), "--export", str(out))
    assert "re-cut" in proc.stdout
    assert update_rel(load_file(str(out)), uninterrupted) < 1e-5


def test_resume_with_another_stage_and_offload(tmp_path, uninterrupted):
    ck, out = tmp_path / "ck", tmp_path / "r.safetensors"
    run("--set", "steps=3", "--checkpoint-every", "3", "--checkpoint-dir", str(ck))
    run("--set", "steps=6", "--set", "zero=1", "--set", "offload.optimizer=cpu", "--resume", str(ck),
        "--export", str(out))
    assert update_rel(load_file(str(out)), uninterrupted) < 1e-5


def test_damaged_newest_falls_back_and_retention_keeps_the_last(tmp_path):
    ck = tmp_path / "ck"
    run("--set", "steps=6", "--checkpoint-every", "2", "--checkpoint-dir", str(ck), "--keep", "2")
    assert sorted(p.name for p in ck.iterdir()) == ["step-000004", "step-000006"]
    shard = ck / "step-000006" / "rank-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run("--set", "steps=7", "--resume", str(ck))
    assert "rank-00001-of-00002.safetensors" in proc.stdout      # names the damaged file
    assert "resumed at step 4" in proc.stdout


def test_export_and_inspect_commands(tmp_path, saved_at_2):
    ck, out = saved_at_2, tmp_path / "model.safetensors"
    inspect = subprocess.run([sys.executable, "-m", "zdsl.cli", "inspect", str(ck)], capture_output=True,
                             text=True, timeout=120)
    assert inspect.returncode == 0 and "step" in inspect.stdout, inspect.stderr
    export = subprocess.run([sys.executable, "-m", "zdsl.cli", "export", str(ck), "-o", str(out), "--dtype", "bf16"],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    from zdsl.runtime.models.gpt import GPT
    model = GPT(**MODEL)
    model.load_state_dict({k: v.float() for k, v in load_file(str(out)).items()}, strict=True)


def test_export_of_a_user_model_with_a_tied_weight_loads_strictly(tmp_path):
    """A user's model whose state dict lists a weight twice (``lm_head.weight`` is the embedding's,
    as in HF's GPT-2) and holds buffers: the run's ``--export`` and ``zdsl export`` of its
    checkpoint both load with ``strict=True`` and hold the trained values."""
    sys.path.insert(0, str(Path(__file__).parent))
    from user_models import FACTORY, build

    program = tmp_path / "tied.zs"
    program.write_text(f'''schedule tied "a user's model with a tied weight"
model     "{FACTORY}"(vocab=64, context=16, hidden=32, layers=2, tied=true)
data      synthetic(vocab=64, context=16)
train     steps=3, batch=4, precision=fp32
optimizer adamw(lr=1e-2)
ranks     2 on cpu
zero      3
''')
    ck, live, exported = tmp_path / "ck", tmp_path / "live.safetensors", tmp_path / "exported.safetensors"
    run("--checkpoint-every", "3", "--checkpoint-dir", str(ck), "--export", str(live), program=program)
    export = subprocess.run([sys.executable, "-m", "zdsl.cli", "export", str(ck), "-o", str(exported)],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    torch.manual_seed(0)
    initial = build(tied=True).state_dict()
    for path in (live, exported):
        sd = load_file(str(path))
        model = build(tied=True)
        model.load_state_dict(sd, strict=True)
        assert model.lm_head.weight is model.embed.tokens.weight
        assert torch.equal(sd["lm_head.weight"], sd["embed.tokens.weight"])
        assert not torch.equal(sd["embed.tokens.weight"], initial["embed.tokens.weight"])   # trained
        assert torch.equal(sd["embed.position_ids"], initial["embed.position_ids"])
    live_sd, exported_sd = load_file(str(live)), load_file(str(exported))
    assert live_sd.keys() == exported_sd.keys() == initial.keys()
    assert all(torch.equal(live_sd[k], exported_sd[k]) for k in live_sd)


def metrics_losses(path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, Path(path).read_text().splitlines())}


def test_resume_with_another_optimizer_is_explained_and_fresh_optimizer_continues(tmp_path):
    """AdamW's checkpoint holds exp_avg and exp_avg_sq; SGD with momentum needs momentum. Without
    --fresh-optimizer the run says so and how to go on; with it, it continues from the
    checkpoint's weights (step 2's loss is the one the first run had at step 2) with SGD."""
    ck, first, second = tmp_path / "ck", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run("--set", "steps=3", "--checkpoint-every", "2", "--checkpoint-dir", str(ck), "--metrics", str(first))
    sgd = ("--set", "optimizer=sgd(lr=0.1, momentum=0.9)", "--set", "steps=4", "--resume", str(ck))
    refused = run(*sgd, ok=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    for words in ("holds the state of adamw(lr=0.003, weight_decay=0.1) (exp_avg, exp_avg_sq)",
                  "sgd(lr=0.1, momentum=0.9) needs momentum", "--set optimizer='adamw(lr=0.003, weight_decay=0.1)'",
                  "--fresh-optimizer"):
        assert words in refused.stderr, refused.stderr
    out = tmp_path / "sgd.safetensors"
    fresh = run(*sgd, "--fresh-optimizer", "--metrics", str(second), "--export", str(out))
    assert "--fresh-optimizer: the weights of" in fresh.stdout and "resumed at step 2" in fresh.stdout
    before, after = metrics_losses(first), metrics_losses(second)
    assert sorted(after) == [2, 3]
    assert after[2] == before[2]                      # the checkpoint's weights, exactly
    trained = load_file(str(out))
    saved = tmp_path / "ck.safetensors"
    subprocess.run([sys.executable, "-m", "zdsl.cli", "export", str(ck), "-o", str(saved)], check=True,
                   capture_output=True, timeout=120)
    assert any(not torch.equal(trained[k], v) for k, v in load_file(str(saved)).items())   # SGD trained on


def test_fallback_is_said_once_and_nothing_left_to_train_is_said(tmp_path):
    """A truncated newest checkpoint: the refusal and the fallback are said once (rank 0), with the
    prefix; resuming at the schedule's last step says there is nothing to train and exits 0, and
    --export still writes the checkpoint's weights."""
    ck, out, saved = tmp_path / "ck", tmp_path / "out.safetensors", tmp_path / "ck.safetensors"
    run("--set", "steps=4", "--checkpoint-every", "2", "--checkpoint-dir", str(ck))
    newest = ck / "step-000004" / "rank-00000-of-00002.safetensors"
    os.truncate(newest, 100)
    proc = run("--set", "steps=2", "--resume", str(ck), "--export", str(out))
    lines = proc.stdout.splitlines() + proc.stderr.splitlines()
    refused = [ln for ln in lines if "step-000004 refused" in ln]
    assert len(refused) == 1 and refused[0].startswith(f"zdsl: checkpoint step-000004 refused: {newest}: 100 bytes"), \
        lines
    assert [ln for ln in lines if "falling back" in ln] == \
        ["zdsl: falling back to checkpoint step-000002 (newer step-000004 not usable)"]
    assert any(ln.startswith("zdsl: ") and "already completed 2 steps" in ln and "nothing left to train" in ln
               for ln in lines), lines
    assert not any("resumed at step" in ln for ln in lines)
    subprocess.run([sys.executable, "-m", "zdsl.cli", "export", str(ck / "step-000002"), "-o", str(saved)],
                   check=True, capture_output=True, timeout=120)
    expected = load_file(str(saved))
    got = load_file(str(out))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def seen(ranks: int, accumulate: int, batch: int, steps: range) -> list[tuple[int, int]]:
    """(step, window start) of every row the runs' data gives, in order (corpus("stdlib"), seed 0)."""
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.data.corpus import corpus_tokens
    from zdsl.schedule import DataSpec
    spec = DataSpec("corpus", "stdlib", {"context": 32})
    corpus = corpus_tokens("stdlib").numpy().tobytes()
    rows = []
    for step in steps:
        for m in range(accumulate):
            for r in range(ranks):
                for row in make_batch(spec, 0, step, m, r, ranks, batch)[0].numpy():
                    rows.append((step, corpus.find(row.astype(np.uint8).tobytes())))   # where its window starts
    return rows


# Resumable data order: a resume at another split of the same global batch sees exactly the samples
# the uninterrupted run would have seen next.

def test_the_samples_before_and_after_a_resume_at_another_split_are_the_uninterrupted_ones():
    full = seen(2, 1, 4, range(4))
    before, after = seen(2, 1, 4, range(2)), seen(1, 2, 4, range(2, 4))
    assert sorted(before + after) == sorted(full)
    assert len(set(before + after)) == len(before + after) == 32      # no sample twice, none skipped


def test_resumed_on_one_rank_accumulating_two_continues_the_two_rank_run(tmp_path, saved_at_2):
    ck = copy_of(saved_at_2, tmp_path)
    full, resumed, other = (tmp_path / n for n in ("full.st", "resumed.st", "other.st"))
    run("--set", "steps=4", "--export", str(full))
    index = json.loads(next(ck.glob("step-*/index.json")).read_text())
    assert index["data_position"]["next_step"] == 2 and index["data_position"]["samples_per_step"] == 8
    proc = run("--set", "steps=4", "--set", "ranks=1", "--set", "accumulate=2", "--resume", str(ck),
               "--export", str(resumed))
    assert "re-cut" in proc.stdout and "not the ones" not in proc.stdout
    assert update_rel(load_file(str(resumed)), load_file(str(full))) < 1e-5
    # the control: another global batch is said, and does train on other samples
    proc = run("--set", "steps=4", "--set", "ranks=1", "--resume", str(ck), "--export", str(other))
    assert "global batch (ranks x batch x accumulate) 8 -> 4" in proc.stdout
    assert update_rel(load_file(str(other)), load_file(str(full))) > 1e-3


def test_a_fresh_run_onto_its_own_checkpoints_is_refused_before_it_trains(tmp_path, saved_at_2):
    ck = copy_of(saved_at_2, tmp_path)
    again = run("--set", "steps=4", "--checkpoint-every", "2", "--checkpoint-dir", str(ck), ok=False)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert f"{ck} already holds a complete checkpoint at step 2" in again.stderr
    assert f"--resume {ck}" in again.stderr and "step 1/" not in again.stdout   # nothing trained
    # the same folder with --resume continues, and another stride that saves no old step runs
    run("--set", "steps=4", "--checkpoint-every", "2", "--checkpoint-dir", str(ck), "--resume", str(ck))
    run("--set", "steps=3", "--checkpoint-every", "3", "--checkpoint-dir", str(ck))
