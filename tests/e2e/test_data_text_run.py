"""`zdsl check` and `zdsl run` with data text(FOLDER, tokenizer=...): the launcher tokenises once and
2 ranks train on the cached token file; bad text or tokenizers are positioned errors with no traceback."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_refused
from helpers import quickstart_with_data
from helpers import zdsl


pytest.importorskip("tokenizers")


def train_tokenizer(path: Path, words: int, eos: str | None = "<|endoftext|>") -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]"] + ([eos] if eos else [])
    tok.train_from_iterator([" ".join(f"w{i}" for i in range(words))],
                            trainers.WordLevelTrainer(special_tokens=special, vocab_size=words + 2))
    tok.save(str(path))
    return path


def documents(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    for d in range(4):
        (folder / "docs").mkdir(exist_ok=True)
        (folder / "docs" / f"{d}.txt").write_text(" ".join(f"w{i}" for i in rng.integers(0, 200, 500)))
    return folder / "docs"


@pytest.mark.slow      # spawns 2 ranks
def test_a_text_folder_trains_two_steps_at_two_ranks_tokenised_once(tmp_path):
    documents(tmp_path)
    train_tokenizer(tmp_path / "tokenizer.json", 200)
    zs = quickstart_with_data(tmp_path, 'text("docs", tokenizer="tokenizer.json")', "text.zs")
    cache = tmp_path / "cache"
    for run in range(2):
        metrics = tmp_path / f"m{run}.jsonl"
        proc = zdsl("run", str(zs), "--quiet", "--set", "steps=2", "--metrics", str(metrics),
                    env={"ZDSL_CACHE": str(cache)})
        assert proc.returncode == 0, proc.stderr
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [m["step"] for m in lines] == [0, 1] and all(np.isfinite(m["loss"]) for m in lines)
        made = sorted((cache / "text").glob("*.tokens"))
        assert len(made) == 1 and np.fromfile(made[0], dtype="<u2").size == 4 * 501
        if run == 0:
            stamp = made[0].stat().st_mtime_ns
    assert made[0].stat().st_mtime_ns == stamp           # the second run read the cache


def test_bad_text_data_are_positioned_errors_in_zdsl_check(tmp_path):
    documents(tmp_path)
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.bin").write_bytes(b"\0" * 100)
    train_tokenizer(tmp_path / "tokenizer.json", 200)
    train_tokenizer(tmp_path / "big.json", 400)
    train_tokenizer(tmp_path / "no_eos.json", 20, eos=None)
    (tmp_path / "bad.json").write_text("{not json")
    cases = {
        'text("docs", tokenizer="missing.json")': ["tokenizer not found:", "missing.json"],
        'text("binary", tokenizer="tokenizer.json")': ["no text files in", "binary"],
        'text("nowhere", tokenizer="tokenizer.json")': ["text not found:", "nowhere"],
        'text("docs", tokenizer="big.json")': ["produces ids up to 401 (402 ids) but the model's vocab is 256"],
        'text("docs", tokenizer="no_eos.json")': ["has no end-of-text token"],
        'text("docs", tokenizer="bad.json")': ["is not a tokenizer.json file"],
        'text("docs")': ["text needs a tokenizer"],
    }
    for data, expected in cases.items():
        zs = quickstart_with_data(tmp_path, data, "text.zs")
        assert_refused(zs, expected, env={"ZDSL_CACHE": str(tmp_path / "cache")})
