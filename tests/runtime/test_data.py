"""Built-in data: deterministic batches from corpora and synthetic streams."""
from __future__ import annotations

import pytest
import torch

from zdsl.schedule import DataSpec
from zdsl.runtime.data.corpus import CorpusError
from zdsl.runtime.data import make_batch
from zdsl.runtime.data import make_batches
from zdsl.runtime.data import vocab_size
from zdsl.runtime.data.corpus import corpus_tokens

SYN = DataSpec("synthetic", None, {"vocab": 50, "context": 12})
STDLIB = DataSpec("corpus", "stdlib", {"context": 32})


@pytest.mark.parametrize("spec", [SYN, STDLIB])
def test_a_batch_depends_only_on_seed_step_micro_and_sample(spec):
    a = make_batch(spec, 0, 3, 1, 1, 2, 4)
    b = make_batch(spec, 0, 3, 1, 1, 2, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    idx, targets = a
    context = spec.args["context"]
    assert idx.shape == targets.shape == (4, context) and idx.dtype == targets.dtype == torch.int64
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    for other in [(1, 3, 1, 1), (0, 4, 1, 1), (0, 3, 0, 1), (0, 3, 1, 0)]:
        assert not torch.equal(make_batch(spec, *other, 2, 4)[0], idx), other


def test_samples_are_numbered_globally_so_any_split_sees_the_same_global_batch():
    whole = make_batch(SYN, 5, 2, 0, 0, 1, 8)[0]
    halves = torch.cat([make_batch(SYN, 5, 2, 0, r, 2, 4)[0] for r in range(2)])
    quarters = torch.cat([make_batch(SYN, 5, 2, 0, r, 4, 2)[0] for r in range(4)])
    assert torch.equal(whole, halves) and torch.equal(whole, quarters)


def test_make_batches_is_the_same_function():
    assert torch.equal(make_batches(SYN, 0, 1, 0, 1, 4, ranks=2)[0], make_batch(SYN, 0, 1, 0, 1, 2, 4)[0])


def test_stdlib_corpus_is_real_python_source_bytes_read_once():
    tokens = corpus_tokens("stdlib")
    assert tokens is corpus_tokens("stdlib")          # cached
    assert tokens.dtype == torch.uint8 and tokens.numel() > 1_000_000
    assert b"def " in bytes(tokens[:200_000].tolist())
    assert vocab_size(STDLIB) == 256
    idx, _ = make_batch(STDLIB, 0, 0, 0, 0, 1, 2)
    assert int(idx.max()) < 256


def test_synthetic_tokens_stay_in_the_vocab_and_are_learnable_progressions():
    idx, targets = make_batch(SYN, 0, 0, 0, 0, 1, 16)
    assert int(idx.min()) >= 0 and int(idx.max()) < 50
    step = (idx[:, 1] - idx[:, 0]) % 50
    assert torch.equal((idx[:, 1:] - idx[:, :-1]) % 50, step[:, None].expand(-1, 11))


def test_a_corpus_from_a_file_or_a_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("zzzz " * 20)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 50)       # binary files are skipped in a folder
    folder = DataSpec("corpus", str(tmp_path), {"context": 8})
    tokens = corpus_tokens(str(tmp_path))
    assert tokens.numel() == 240 + 100
    idx, _ = make_batch(folder, 0, 0, 0, 0, 1, 3)
    assert set(bytes(idx.flatten().tolist())) <= set(b"helo wrdz")
    one = DataSpec("corpus", str(tmp_path / "a.txt"), {"context": 8})
    assert set(bytes(make_batch(one, 0, 0, 0, 0, 1, 3)[0].flatten().tolist())) <= set(b"helo wrd")


def test_bad_data_gets_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="no such file"):
        make_batch(DataSpec("corpus", str(tmp_path / "missing"), {"context": 8}), 0, 0, 0, 0, 1, 1)
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(CorpusError, match="needs at least 10"):
        make_batch(DataSpec("corpus", str(tmp_path / "small.txt"), {"context": 8}), 0, 0, 0, 0, 1, 1)
    (tmp_path / "bin").write_bytes(b"\0" * 100)
    with pytest.raises(CorpusError, match="not a text file"):
        make_batch(DataSpec("corpus", str(tmp_path / "bin"), {"context": 8}), 0, 0, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="context"):
        make_batch(DataSpec("synthetic", None, {"vocab": 8}), 0, 0, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="rank 2"):
        make_batch(SYN, 0, 0, 0, 2, 2, 1)
