"""`zdsl check` and `zdsl run` with data tokens("FILE"): a token file trains at 2 ranks, and every bad
file is a clear error (file, size or offset and value named) with no traceback."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_refused
from helpers import quickstart_with_data
from helpers import zdsl


def write_ids(path: Path, ids, dtype="<u2") -> None:
    np.asarray(ids).astype(dtype).tofile(path)


@pytest.mark.slow      # spawns 2 ranks
def test_a_token_file_trains_two_steps_at_two_ranks_and_keeps_its_check(tmp_path):
    write_ids(tmp_path / "train.bin", np.random.default_rng(0).integers(0, 256, 20_000))
    zs = quickstart_with_data(tmp_path, 'tokens("train.bin", dtype=uint16)', "tokens.zs")
    metrics = tmp_path / "m.jsonl"
    proc = zdsl("run", str(zs), "--quiet", "--set", "steps=2", "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    assert all(np.isfinite(m["loss"]) for m in lines)
    record = json.loads((tmp_path / "train.bin.zdsl-check.json").read_text())
    assert record["size"] == 40_000 and record["max"] == 255


def test_bad_token_files_are_positioned_errors_in_zdsl_check(tmp_path):
    (tmp_path / "odd.bin").write_bytes(bytes(4001))
    (tmp_path / "empty.bin").write_bytes(b"")
    write_ids(tmp_path / "short.bin", range(20))
    write_ids(tmp_path / "ok.bin", range(200))
    cases = {
        'tokens("odd.bin")': ["odd.bin holds 4001 bytes, not a whole number of uint16 tokens"],
        'tokens("empty.bin")': ["empty.bin is empty (0 bytes)"],
        'tokens("missing.bin")': ["token file not found:", "missing.bin"],
        'tokens("short.bin", dtype=uint16)': ["short.bin holds 20 tokens; context=32 needs at least 33"],
        'tokens("short.bin", dtype=int16)': ["unknown token dtype 'int16'"],
        'tokens("ok.bin", vocab=300)': ["data vocab 300 is larger than the model's vocab 256"],
    }
    for data, expected in cases.items():
        zs = quickstart_with_data(tmp_path, data, "tokens.zs")
        assert_refused(zs, expected)


def test_an_id_at_or_above_the_vocab_stops_zdsl_run_before_any_rank(tmp_path):
    ids = np.random.default_rng(1).integers(0, 256, 5000)
    ids[4321] = 300
    write_ids(tmp_path / "train.bin", ids)
    zs = quickstart_with_data(tmp_path, 'tokens("train.bin")', "tokens.zs")
    assert zdsl("check", str(zs)).returncode == 0      # the scan is the run's, once, before ranks start
    proc = zdsl("run", str(zs), "--quiet")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "rank 0" not in proc.stderr, proc.stderr
    assert "train.bin holds id 300 at token 4321 (byte offset 8642)" in proc.stderr
    assert "vocab 256" in proc.stderr
