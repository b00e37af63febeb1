"""data tokens("FILE", dtype=...): memory-mapped windows equal to a plain numpy reference, and the
one-time check of every id against the vocab, cached beside the file."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from zdsl.runtime.data.tokens import TokenFileError
from zdsl.runtime.data import make_batch
from zdsl.runtime.data.keys import sample_keys
from zdsl.runtime.data import tokens as tokens_module
from zdsl.runtime.data.tokens import CHECK_SUFFIX
from zdsl.runtime.data.tokens import check_record_paths
from zdsl.runtime.data.tokens import check_token_file
from zdsl.runtime.data.tokens import first_at_or_above
from zdsl.runtime.data.tokens import token_file_problem
from zdsl.schedule import DataSpec

CONTEXT = 16


def token_file(folder, dtype: str, count: int, vocab: int, seed: int = 0):
    ids = np.random.default_rng(seed).integers(0, vocab, count).astype(f"<u{2 if dtype == 'uint16' else 4}")
    path = folder / f"train.{dtype}.bin"
    ids.tofile(path)
    return str(path), ids


def spec(path, dtype, vocab, context=CONTEXT):
    return DataSpec("tokens", path, {"context": context, "vocab": vocab}, dtype)


def reference(path, dtype, seed, step, micro, rank, ranks, batch, context=CONTEXT):
    """nanoGPT's get_batch over np.memmap, with the window starts drawn from the keys of the step's
    global samples (micro * ranks + rank) * batch + i."""
    data = np.memmap(path, dtype=np.uint16 if dtype == "uint16" else np.uint32, mode="r")
    keys = sample_keys(seed, step, 0, (micro * ranks + rank) * batch, batch)
    starts = (keys % np.uint64(len(data) - context)).astype(np.int64)
    x = np.stack([data[s:s + context].astype(np.int64) for s in starts])
    y = np.stack([data[s + 1:s + 1 + context].astype(np.int64) for s in starts])
    return torch.from_numpy(x), torch.from_numpy(y)


@pytest.mark.parametrize("dtype,vocab", [("uint16", 50304), ("uint32", 100_000)])
def test_batches_equal_a_numpy_memmap_reference(tmp_path, dtype, vocab):
    path, ids = token_file(tmp_path, dtype, 5000, vocab)
    s = spec(path, dtype, vocab)
    for seed, step, micro, rank in [(0, 0, 0, 0), (7, 3, 1, 1), (123, 99, 0, 3)]:
        idx, targets = make_batch(s, seed, step, micro, rank, 4, 5)
        ref_x, ref_y = reference(path, dtype, seed, step, micro, rank, 4, 5)
        assert idx.dtype == targets.dtype == torch.int64 and idx.shape == (5, CONTEXT)
        assert torch.equal(idx, ref_x) and torch.equal(targets, ref_y)
    if dtype == "uint32":
        assert int(ids.max()) > 65535          # ids a uint16 reading would get wrong
        assert int(make_batch(s, 0, 0, 0, 0, 1, 64)[0].max()) > 65535


def test_ranks_see_slices_of_one_global_batch(tmp_path):
    path, _ = token_file(tmp_path, "uint16", 3000, 1000)
    s = spec(path, "uint16", 1000)
    whole = make_batch(s, 5, 2, 0, 0, 1, 8)[0]
    halves = torch.cat([make_batch(s, 5, 2, 0, r, 2, 4)[0] for r in range(2)])
    assert torch.equal(whole, halves)
    assert not torch.equal(make_batch(s, 5, 3, 0, 0, 1, 8)[0], whole)


@pytest.mark.parametrize("kind", ["tokens", "corpus", "synthetic"])
def test_a_step_sees_the_same_samples_however_ranks_and_micro_batches_split_it(tmp_path, kind):
    """8 samples a step: 2 ranks x 2 micro-batches x 2 rows, 4 ranks x 1 x 2, 1 rank x 2 x 4 and
    1 rank x 1 x 8 see the same rows (what lets a checkpoint resume at another rank count)."""
    path, _ = token_file(tmp_path, "uint16", 3000, 1000)
    s = spec(path, "uint16", 1000) if kind == "tokens" else \
        DataSpec(kind, "stdlib" if kind == "corpus" else None, {"context": CONTEXT, "vocab": 256})
    def step_rows(ranks, acc, batch):
        by_rank = [[make_batch(s, 7, 3, m, r, ranks, batch)[0] for r in range(ranks)] for m in range(acc)]
        return torch.cat([t for micro in by_rank for t in micro])
    whole = step_rows(1, 1, 8)
    for split in [(2, 2, 2), (4, 1, 2), (1, 2, 4), (2, 1, 4)]:
        assert torch.equal(step_rows(*split), whole), split
    assert not torch.equal(step_rows(1, 1, 8), make_batch(s, 7, 4, 0, 0, 1, 8)[0])


def test_every_window_start_is_reachable_including_the_last(tmp_path):
    path, ids = token_file(tmp_path, "uint16", CONTEXT + 1, 1000)      # exactly one window
    idx, targets = make_batch(spec(path, "uint16", 1000), 0, 0, 0, 0, 1, 3)
    assert torch.equal(idx[0], torch.from_numpy(ids[:-1].astype(np.int64)))
    assert torch.equal(targets[2], torch.from_numpy(ids[1:].astype(np.int64)))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_an_id_at_or_above_vocab_is_named_with_its_offset_and_value(tmp_path, dtype):
    path, ids = token_file(tmp_path, dtype, 10_000, 500)
    ids[7321] = 500                                  # the first bad id (== vocab)
    ids[9000] = 4000
    ids.tofile(path)
    with pytest.raises(TokenFileError) as exc:
        check_token_file(path, dtype, 500)
    width = ids.dtype.itemsize
    text = str(exc.value)
    assert path in text and "id 500 at token 7321" in text and f"byte offset {7321 * width}" in text
    assert "vocab 500" in text
    assert check_token_file(path, dtype, 4001) == 4000           # a larger vocab fits
    problem = token_file_problem(spec(path, dtype, 500))
    assert problem is not None and "token 7321" in problem


def test_the_first_offending_offset_is_found_across_chunks():
    data = np.zeros(1000, dtype=np.uint16)
    data[[12, 517, 999]] = [3, 9, 9]
    assert first_at_or_above(data, 9, chunk=100) == (517, 9)
    assert first_at_or_above(data, 3, chunk=7) == (12, 3)
    assert first_at_or_above(data, 10, chunk=100) is None


def test_odd_byte_length_and_empty_files_are_errors_naming_the_file(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(TokenFileError, match=r"odd.bin holds 3 bytes, not a whole number of uint16"):
        check_token_file(str(odd), "uint16", 10)
    six = tmp_path / "six.bin"
    six.write_bytes(bytes(6))
    with pytest.raises(TokenFileError, match=r"six.bin holds 6 bytes, not a whole number of uint32"):
        check_token_file(str(six), "uint32", 10)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(TokenFileError, match=r"empty.bin is empty"):
        check_token_file(str(empty), "uint16", 10)
    short = tmp_path / "short.bin"
    np.arange(8, dtype=np.uint16).tofile(short)
    with pytest.raises(TokenFileError, match=r"holds 8 tokens; context=8 needs at least 9"):
        make_batch(spec(str(short), "uint16", 10, context=8), 0, 0, 0, 0, 1, 1)


def test_the_check_is_cached_beside_the_file_and_redone_when_it_changes(tmp_path, monkeypatch):
    path, ids = token_file(tmp_path, "uint16", 4000, 300)
    scans = []
    real = tokens_module.scan_max
    monkeypatch.setattr(tokens_module, "scan_max", lambda data, *a: scans.append(len(data)) or real(data, *a))
    assert check_token_file(path, "uint16", 300) == int(ids.max())
    record = json.loads(open(path + CHECK_SUFFIX).read())
    assert record["max"] == int(ids.max()) and record["size"] == 8000 and record["dtype"] == "uint16"
    assert len(scans) == 1
    check_token_file(path, "uint16", 300)
    check_token_file(path, "uint16", 1000)        # another vocab: the cached max answers it
    assert len(scans) == 1
    ids[17] = 299                                 # same size, new contents (and mtime)
    ids.tofile(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    check_token_file(path, "uint16", 300)
    assert len(scans) == 2
    check_token_file(path, "uint16", 300, CONTEXT)
    assert len(scans) == 2
    check_token_file(path, "uint32", 1 << 32)     # read as another dtype: its own verdict
    assert len(scans) == 3


def test_where_the_files_folder_cannot_take_the_verdict_zdsls_cache_keeps_it(tmp_path, monkeypatch):
    path, _ = token_file(tmp_path, "uint16", 2000, 100)
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path / "cache"))
    beside, cached = check_record_paths(path)
    beside.mkdir()                  # no record can be written there (even by root, unlike chmod)
    check_token_file(path, "uint16", 100)
    assert cached.exists() and cached.is_relative_to(tmp_path / "cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["cache", beside.name, "train.uint16.bin"])
    scans = []
    monkeypatch.setattr(tokens_module, "scan_max", lambda data, *a: scans.append(1) or 0)
    check_token_file(path, "uint16", 100)
    assert scans == []


def test_each_batch_asks_the_kernel_for_the_next_steps_windows(tmp_path, monkeypatch):
    path, _ = token_file(tmp_path, "uint32", 4000, 1000)
    s = spec(path, "uint32", 1000)
    make_batch(s, 3, 5, 1, 1, 2, 4)                  # opened and checked before recording
    hints = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: hints.append((offset, length, advice)))
    make_batch(s, 3, 5, 1, 1, 2, 4)
    keys = sample_keys(3, 6, 0, (1 * 2 + 1) * 4, 4)   # step 6, the same global samples
    starts = (keys % np.uint64(4000 - CONTEXT)).astype(np.int64)
    assert hints == [(int(a) * 4, (CONTEXT + 1) * 4, os.POSIX_FADV_WILLNEED) for a in starts]


def test_sample_keys_are_the_splitmix_chain_over_seed_step_micro_then_sample():
    """The keys every source draws from, against the hash written out with numpy scalars."""
    from zdsl.runtime.data.keys import _splitmix64

    def reference(seed, step, micro, first, count):
        key = np.uint64(seed & 0xFFFFFFFF)
        for part in (step, micro):
            key = _splitmix64(np.array([key ^ np.uint64(part & 0xFFFFFFFFFFFF)], dtype=np.uint64))[0]
        return _splitmix64(np.arange(first, first + count, dtype=np.uint64) ^ key)

    rng = np.random.default_rng(0)
    for seed, step in [(0, 0), (2**32 - 1, 2**48 - 1), (2**63 - 1, 12345)] + \
            [(int(a), int(b)) for a, b in rng.integers(0, 2**62, (20, 2))]:
        for micro, first, count in [(0, 0, 1), (3, 8, 5), (63, 1 << 20, 2)]:
            assert np.array_equal(sample_keys(seed, step, micro, first, count),
                                  reference(seed, step, micro, first, count))


RANK_CODE = """
import sys, time
from pathlib import Path
from zdsl.runtime.data import tokens
folder, path, ranks = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
real = tokens.scan_max
def counted(data, *rest):
    with open(folder / "scans", "a") as log:
        log.write("scan\\n")
    time.sleep(0.5)                                  # long enough for the others to arrive meanwhile
    return real(data, *rest)
tokens.scan_max = counted
(folder / f"ready{sys.argv[4]}").touch()
while len(list(folder.glob("ready*"))) < ranks:      # start together, as ranks under torchrun do
    time.sleep(0.01)
print(tokens.check_token_file(path, "uint16", 1000))
"""


@pytest.mark.slow      # spawns 3 processes
def test_ranks_started_together_scan_the_file_once(tmp_path):
    import subprocess
    import sys
    path, ids = token_file(tmp_path, "uint16", 100_000, 1000)
    procs = [subprocess.Popen([sys.executable, "-c", RANK_CODE, str(tmp_path), path, "3", str(r)],
                              stdout=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert [int(o) for o in outs] == [int(ids.max())] * 3
    assert (tmp_path / "scans").read_text().count("scan") == 1
