"""Resumable data order (issue 21 item 8): a run resumed from a checkpoint, at another rank count or
accumulation, sees exactly the samples the uninterrupted run would have seen next."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import zdsl

pytestmark = pytest.mark.slow     # spawns ranks

QUICK = str(Path(__file__).parents[2] / "programs" / "quickstart.zs")
MODEL = dict(layers=2, width=64, heads=4, vocab=256, context=32)


def run(*args):
    proc = zdsl("run", QUICK, "--quiet", *args)
    assert proc.returncode == 0, proc.stderr
    return proc


def moved_apart(a: dict, b: dict) -> float:
    """How far two trainings' updates from the same init differ, relative to the update."""
    from zdsl.runtime.models.gpt import GPT
    init = {n: p.detach() for n, p in GPT(**MODEL, seed=0).named_parameters()}
    da = torch.cat([(a[k] - init[k]).flatten() for k in init])
    db = torch.cat([(b[k] - init[k]).flatten() for k in init])
    return float((da - db).norm() / db.norm())


def seen(ranks: int, accumulate: int, batch: int, steps: range) -> list[tuple[int, int]]:
    """(step, window start) of every row the runs' data gives, in order (corpus("stdlib"), seed 0)."""
    from zdsl.runtime.data import make_batch
    from zdsl.schedule import DataSpec
    spec = DataSpec("corpus", "stdlib", {"context": 32})
    from zdsl.runtime.data.corpus import corpus_tokens
    corpus = corpus_tokens("stdlib").numpy().tobytes()
    rows = []
    for step in steps:
        for m in range(accumulate):
            for r in range(ranks):
                for row in make_batch(spec, 0, step, m, r, ranks, batch)[0].numpy():
                    rows.append((step, corpus.find(row.astype(np.uint8).tobytes())))   # where its window starts
    return rows


def test_the_samples_before_and_after_a_resume_at_another_split_are_the_uninterrupted_ones():
    full = seen(2, 1, 4, range(4))
    before, after = seen(2, 1, 4, range(2)), seen(1, 2, 4, range(2, 4))
    assert sorted(before + after) == sorted(full)
    assert len(set(before + after)) == len(before + after) == 32      # no sample twice, none skipped


def test_resumed_on_one_rank_accumulating_two_continues_the_two_rank_run(tmp_path):
    ck, full, resumed, other = (tmp_path / n for n in ("ck", "full.st", "resumed.st", "other.st"))
    run("--set", "steps=4", "--export", str(full))
    run("--set", "steps=2", "--checkpoint-every", "2", "--checkpoint-dir", str(ck))
    index = json.loads(next(ck.glob("step-*/index.json")).read_text())
    assert index["data_position"]["next_step"] == 2 and index["data_position"]["samples_per_step"] == 8
    proc = run("--set", "steps=4", "--set", "ranks=1", "--set", "accumulate=2", "--resume", str(ck),
               "--export", str(resumed))
    assert "re-cut" in proc.stdout and "not the ones" not in proc.stdout
    assert moved_apart(load_file(str(resumed)), load_file(str(full))) < 1e-5
    # the control: another global batch is said, and does train on other samples
    proc = run("--set", "steps=4", "--set", "ranks=1", "--resume", str(ck), "--export", str(other))
    assert "global batch (ranks x batch x accumulate) 8 -> 4" in proc.stdout
    assert moved_apart(load_file(str(other)), load_file(str(full))) > 1e-3
