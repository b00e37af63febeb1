"""Checkpoint storage: round trip, re-cut across rank counts, export, damage, retention, SIGKILL."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zdsl.model.layout import flat_layout
from zdsl.runtime.checkpoint import (CheckpointError, LazyShard, apply_retention, check_checkpoint, checkpoint_path,
                                     export, inspect, latest_complete, list_checkpoints, load_for_rank,
                                     owned_shard, read_index, remove_incomplete, state_dict_aliases, unit_metas, unit_prefixes, write_index, write_rank_shards)
from zdsl.model.units import UnitSpec
from zdsl.model.units import gpt_units
from zdsl.runtime.io import checksum

CFG = dict(layers=2, width=32, heads=2, vocab=64, context=16)
KINDS = ("param", "exp_avg", "exp_avg_sq")


def layouts_for(units, ranks, bucket=0):
    return [flat_layout(u.numel, ranks, bucket) for u in units]


@pytest.fixture(scope="module")
def model():
    """GPT-shaped units and full flat fp32 state per (unit, kind), deterministic."""
    units = gpt_units(**CFG)
    g = torch.Generator().manual_seed(0)
    full = {(i, k): torch.randn(u.numel, generator=g) for i, u in enumerate(units) for k in KINDS}
    return units, full


def save(root, step, units, full, ranks, bucket=0, tag="t", rng=True, threads=True):
    """Write a checkpoint of ``full`` as ``ranks`` ranks would (one thread per rank), then the index."""
    layouts = layouts_for(units, ranks, bucket)

    def rank_shards(r):
        shards = {f"u{i}.{k}": owned_shard(full[i, k], layouts[i], r) for i in range(len(units)) for k in KINDS}
        if rng:
            shards["rng.cpu"] = torch.full((16,), r, dtype=torch.uint8)
        return shards

    records = [None] * ranks

    def work(r):
        records[r] = write_rank_shards(root, step, r, ranks, rank_shards(r), tag=tag)

    if threads:
        ts = [threading.Thread(target=work, args=(r,)) for r in range(1, ranks)]
        for t in ts:
            t.start()
        work(0)
        # Rank 0 knows only its own record; the others' come from their done markers.
        path = write_index(root, step, {"units": unit_metas(units, layouts), "schedule_hash": "abc",
                                        "data_position": {"step": step, "sample": 8 * step},
                                        "loss_scaler": {"scale": 1024.0, "growth_tracker": 3}},
                           records[:1], tag=tag, timeout_s=10)
        for t in ts:
            t.join()
    else:
        for r in range(ranks):
            work(r)
        path = write_index(root, step, {"units": unit_metas(units, layouts)}, records, tag=tag)
    return path, layouts


def full_from_shards(shards_by_rank, layouts, units, kind):
    """Reassemble full tensors from every rank's shards (strip padding)."""
    out = {}
    for i, lay in enumerate(layouts):
        buf = torch.zeros(lay.padded_numel)
        for r, shards in enumerate(shards_by_rank):
            for p, (b, e) in enumerate(lay.owned_full_ranges(r)):
                sb, se = lay.shard_range(p)
                buf[b:e] = shards[f"u{i}.{kind}"][sb:se]
        out[i] = buf[:units[i].numel]
    return out


def test_round_trip_same_ranks(tmp_path, model):
    units, full = model
    path, layouts = save(tmp_path, 5, units, full, 2, bucket=1000)
    assert path == checkpoint_path(tmp_path, 5) and path.name == "step-000005"
    index = read_index(path)
    assert (index.step, index.ranks, index.schedule_hash) == (5, 2, "abc")
    assert index.data_position == {"step": 5, "sample": 40} and index.loss_scaler["scale"] == 1024.0
    assert [u.prefix for u in index.units] == ["embedding", "blocks.0", "blocks.1", "head"]
    assert any(u.parts > 1 for u in index.units)
    for r in range(2):
        got = load_for_rank(path, r, 2, layouts)
        for i, lay in enumerate(layouts):
            for k in KINDS:
                assert torch.equal(got[f"u{i}.{k}"], owned_shard(full[i, k], lay, r))
        assert torch.equal(got["rng.cpu"], torch.full((16,), r, dtype=torch.uint8))
    # Plain safetensors: the reference reader opens our streamed files.
    with safe_open(str(path / "rank-00001-of-00002.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("u1.param"), owned_shard(full[1, "param"], layouts[1], 1))
    assert latest_complete(tmp_path) == path


@pytest.mark.parametrize("io", ["default", "small blocks", "buffered", "zlib crc32"])
def test_recut_2_to_4_to_1(tmp_path, model, monkeypatch, io):
    """Exact re-cut. Small blocks: 100-byte checksum blocks and 8 KiB transfers, so slices start and
    end mid-block and reads span many transfers; buffered: the fallback without O_DIRECT."""
    if io == "small blocks":
        monkeypatch.setattr("zdsl.runtime.checkpoint.stformat.CRC_BLOCK", 100)
        monkeypatch.setattr("zdsl.runtime.io.directio.BOUNCE", 8192)
    if io == "buffered":
        monkeypatch.setattr("zdsl.runtime.io.directio.open_direct",
                            lambda path, flags, mode=0o644: (os.open(path, flags, mode), False))
    if io == "zlib crc32":                  # what a machine without the crc32c package writes
        monkeypatch.setattr("zdsl.runtime.io.checksum.DEFAULT", checksum.CRC32)
    units, full = model
    save(tmp_path / "a", 1, units, full, 2, bucket=700)
    lay4 = layouts_for(units, 4, bucket=2000)
    loaded4 = [load_for_rank(checkpoint_path(tmp_path / "a", 1), r, 4, lay4) for r in range(4)]
    for k in KINDS:
        got = full_from_shards(loaded4, lay4, units, k)
        for i in range(len(units)):
            assert torch.equal(got[i], full[i, k])
    assert "rng.cpu" in loaded4[1] and "rng.cpu" not in loaded4[3]   # rank 3 did not exist in the 2-rank run

    # Save as the 4-rank run would (from its loaded shards), then load on one rank.
    records = [write_rank_shards(tmp_path / "b", 2, r, 4, loaded4[r]) for r in range(4)]
    write_index(tmp_path / "b", 2, {"units": unit_metas(units, lay4)}, records)
    lay1 = layouts_for(units, 1)
    one = load_for_rank(checkpoint_path(tmp_path / "b", 2), 0, 1, lay1)
    # Into preallocated buffers (garbage inside: padding must come out zero), same and other layouts.
    into = {f"u{i}.{k}": torch.full((lay.shard_numel,), 7.0) for i, lay in enumerate(lay1) for k in KINDS}
    got = load_for_rank(checkpoint_path(tmp_path / "b", 2), 0, 1, lay1, into=into)
    assert all(got[k] is into[k] and torch.equal(into[k], one[k]) for k in into)
    into4 = {k: torch.full_like(v, 7.0) for k, v in loaded4[3].items() if k.startswith("u")}
    load_for_rank(checkpoint_path(tmp_path / "b", 2), 3, 4, lay4, into=into4)
    for i, lay in enumerate(lay4):
        for k in KINDS:      # owned_shard zero-pads: the last rank's padding is checked here
            assert torch.equal(into4[f"u{i}.{k}"], owned_shard(full[i, k], lay, 3))
    assert any(lay.padded_numel > lay.numel for lay in lay4)
    with pytest.raises(CheckpointError, match="destination"):
        load_for_rank(checkpoint_path(tmp_path / "b", 2), 0, 1, lay1, into={"u0.param": torch.zeros(3)})
    for i, lay in enumerate(lay1):
        for k in KINDS:
            assert torch.equal(one[f"u{i}.{k}"][:units[i].numel], full[i, k])
            assert not one[f"u{i}.{k}"][units[i].numel:].any()      # new padding is zero


def expected_gpt_keys(units):
    prefix = {"embedding": "embedding", "head": "head"}
    return [f"{prefix.get(u.name, u.name.replace('block.', 'blocks.'))}.{n}" for u in units for n, _ in u.params]


def test_export_loads_into_gpt(tmp_path, model):
    units, full = model
    path, _ = save(tmp_path, 3, units, full, 2, bucket=500)
    out = tmp_path / "model.safetensors"
    keys = export(tmp_path, out, "fp32")          # a root: the newest complete checkpoint is used
    sd = load_file(str(out))
    assert keys == expected_gpt_keys(units) and sorted(sd) == sorted(keys)
    for i, u in enumerate(units):
        off = 0
        for n, shape in u.params:
            numel = torch.Size(shape).numel()
            key = expected_gpt_keys([u])[u.params.index((n, shape))]
            assert sd[key].shape == torch.Size(shape) and sd[key].dtype == torch.float32
            assert torch.equal(sd[key].reshape(-1), full[i, "param"][off:off + numel])
            off += numel
    gpt_mod = pytest.importorskip("zdsl.runtime.models.gpt")
    gpt = gpt_mod.GPT(**CFG)
    assert unit_prefixes(gpt) == ["embedding", "blocks.0", "blocks.1", "head"]
    assert state_dict_aliases(gpt, read_index(path).units) == {}
    gpt.load_state_dict(sd, strict=True)
    assert torch.equal(gpt.embedding.wte.weight.reshape(-1), full[0, "param"][:CFG["vocab"] * CFG["width"]])

    out16 = tmp_path / "model-bf16.safetensors"
    export(path, out16, "bf16")
    sd16 = load_file(str(out16))
    assert all(t.dtype == torch.bfloat16 for t in sd16.values())
    assert torch.equal(sd16["head.ln_f.weight"], sd["head.ln_f.weight"].to(torch.bfloat16))


def _damage_cases(path):
    f1 = path / "rank-00001-of-00002.safetensors"
    return {
        "missing index": (lambda: (path / "index.json").unlink(), "index.json"),
        "truncated index": (lambda: (path / "index.json").write_bytes((path / "index.json").read_bytes()[:100]),
                            "index.json"),
        "altered index": (lambda: (path / "index.json").write_text(
            (path / "index.json").read_text().replace('"numel": ', '"numel": 1', 1)),
            "index.json"),
        "missing shard": (lambda: f1.unlink(), f1.name),
        "truncated shard": (lambda: os.truncate(f1, f1.stat().st_size - 10), f1.name),
        "altered shard": (lambda: _flip_byte(f1, f1.stat().st_size // 2), f1.name),
    }


def _flip_byte(path, pos):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("case", ["missing index", "truncated index", "altered index", "missing shard",
                                  "truncated shard", "altered shard"])
def test_damage_refused_and_fallback(tmp_path, model, case, monkeypatch):
    monkeypatch.setattr("zdsl.runtime.checkpoint.stformat.CRC_BLOCK", 4096)   # several blocks per tensor
    units, full = model
    good, layouts = save(tmp_path, 1, units, full, 2, threads=False)
    bad, _ = save(tmp_path, 2, units, full, 2, threads=False)
    damage, culprit = _damage_cases(bad)[case]
    damage()
    with pytest.raises(CheckpointError, match=culprit.replace(".", r"\.")):
        check_checkpoint(bad)
    with pytest.raises(CheckpointError, match=culprit.replace(".", r"\.")):
        load_for_rank(bad, 1, 2, layouts)
    with pytest.raises(CheckpointError, match=culprit.replace(".", r"\.")):   # partial reads check too
        for r in range(4):
            load_for_rank(bad, r, 4, layouts_for(units, 4, bucket=3000))
    messages = []
    assert latest_complete(tmp_path, report=messages.append) == good
    assert culprit in messages[0] and "step-000002" in messages[0]
    assert "falling back to checkpoint step-000001" in messages[-1]
    table = inspect(tmp_path, verify=True)
    assert "step-000002  unusable" in table and culprit in table and "step-000001  complete" in table


def test_write_index_waits_for_all_ranks_and_ignores_stale_markers(tmp_path, model):
    units, full = model
    lay = layouts_for(units, 2)
    shards = {f"u{i}.param": owned_shard(full[i, "param"], lay[i], 1) for i in range(len(units))}
    write_rank_shards(tmp_path, 7, 1, 2, shards, tag="old-attempt")
    rec0 = write_rank_shards(tmp_path, 7, 0, 2, shards, tag="new")
    with pytest.raises(CheckpointError, match="rank-00001-of-00002.done"):
        write_index(tmp_path, 7, {"units": unit_metas(units, lay)}, [rec0], tag="new", timeout_s=0.2)
    assert latest_complete(tmp_path, report=lambda m: None) is None


def test_zero_copy_paths(tmp_path, monkeypatch):
    """Tensors laid out congruent to their memory: written and read by DMA without the bounce copy,
    padding tensors skipped, the reference reader still opens the file, damage still caught."""
    from zdsl.runtime.io import directio
    from zdsl.runtime.checkpoint import stformat
    monkeypatch.setattr(directio, "ZERO_COPY_MIN", 1)
    monkeypatch.setattr(stformat, "ZERO_COPY_MIN", 1)
    monkeypatch.setattr(directio, "BOUNCE", 8192)        # many transfers per tensor
    monkeypatch.setattr(stformat, "CRC_BLOCK", 3 * 4096)
    copied = []
    copy_in = directio.Sink._copy_in
    monkeypatch.setattr(directio.Sink, "_copy_in", lambda self, src: (copied.append(len(src)), copy_in(self, src)))
    numels, page_offsets = [10007, 40000, 3, 9000], [64, 0, 4000, 2048]
    src = {}
    for i, (n, off) in enumerate(zip(numels, page_offsets)):
        t = directio.aligned_bytes(4 * n, congruent_to=off).view(torch.float32)
        t.copy_(torch.arange(n, dtype=torch.float32) + 1000 * i)
        src[f"u{i}.param"] = t
    lay = [flat_layout(n, 1) for n in numels]
    rec = write_rank_shards(tmp_path, 1, 0, 1, src)
    assert any(k.startswith("__pad.") for k in rec.tensors)
    assert sum(copied) < sum(4 * n for n in numels) // 4          # the bulk went straight from memory
    specs = [UnitSpec(f"u{i}", [("w", (n,))]) for i, n in enumerate(numels)]
    path = write_index(tmp_path, 1, {"units": unit_metas(specs, lay)}, [rec])
    with safe_open(str(path / rec.name), "pt") as f:
        assert torch.equal(f.get_tensor("u1.param"), src["u1.param"])
    reads = []
    read_into = directio.Source.read_into
    monkeypatch.setattr(directio.Source, "read_into", lambda *a: reads.append(read_into(*a)) or reads[-1])
    into = {k: directio.aligned_bytes(4 * t.numel(), congruent_to=t.data_ptr() % 4096).view(torch.float32)
            for k, t in src.items()}
    got = load_for_rank(path, 0, 1, lay, into=into)
    assert sorted(got) == sorted(src) and all(torch.equal(got[k], src[k]) for k in src)
    assert reads == [True, True, False, True]                    # all but the 12-byte tensor
    fresh = load_for_rank(path, 0, 1, lay)                       # into new tensors: DMA, no copy either
    assert all(torch.equal(fresh[k], src[k]) for k in src)
    _flip_byte(path / rec.name, path.joinpath(rec.name).stat().st_size - 9000 * 4 + 5)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_for_rank(path, 0, 1, lay, into=into)


def test_checksum_algorithm_recorded(tmp_path, model, monkeypatch):
    """A file written with CRC-32C and read where the crc32c package is missing: a clear error."""
    pytest.importorskip("crc32c")
    units, full = model
    path, layouts = save(tmp_path, 1, units, full, 1, threads=False)
    assert read_index(path).files[0].tensors["u0.param"].algo == "crc32c"
    monkeypatch.setattr("zdsl.runtime.io.checksum.CRC32C", None)
    with pytest.raises(CheckpointError, match="pip install crc32c"):
        load_for_rank(path, 0, 1, layouts)
    assert load_for_rank(path, 0, 1, layouts, verify=False)["u0.param"].numel() == layouts[0].shard_numel


def test_bad_shards_refused_without_debris(tmp_path):
    with pytest.raises(CheckpointError, match="flat 1-D"):
        write_rank_shards(tmp_path, 1, 0, 1, {"u0.param": torch.zeros(2, 2)})
    with pytest.raises(CheckpointError, match="cannot be stored"):
        write_rank_shards(tmp_path, 1, 0, 1, {"u0.param": torch.zeros(4, dtype=torch.complex64)})
    with pytest.raises(CheckpointError, match="fetched"):
        write_rank_shards(tmp_path, 1, 0, 1, {"u0.param": LazyShard((4,), torch.float32, lambda: torch.zeros(3))})
    assert not [p for p in checkpoint_path(tmp_path, 1).iterdir()]


def test_retention_keeps_last_complete(tmp_path, model):
    units, full = model
    for step in (1, 2, 3, 4):
        save(tmp_path, step, units, full, 1, threads=False)
    # A killed save at step 5 (no index) must not count as one of the kept.
    write_rank_shards(tmp_path, 5, 0, 1, {"u0.param": owned_shard(full[0, "param"], layouts_for(units, 1)[0], 0)})
    deleted = apply_retention(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step-000001", "step-000002"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4, 5]
    assert latest_complete(tmp_path, report=lambda m: None) == checkpoint_path(tmp_path, 4)
    with pytest.raises(CheckpointError):
        apply_retention(tmp_path, keep=0)
    assert [p.name for p in remove_incomplete(tmp_path)] == ["step-000005"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]


CHILD = """
import sys, time, torch
from zdsl.model.layout import flat_layout
from zdsl.runtime.checkpoint import LazyShard
from zdsl.runtime.checkpoint import unit_metas
from zdsl.runtime.checkpoint import write_index
from zdsl.runtime.checkpoint import write_rank_shards
from zdsl.model.units import UnitSpec
root, n = sys.argv[1], int(sys.argv[2])
units, lay = [UnitSpec("big", [("w", (n,))])], [flat_layout(n, 2)]
shard = lay[0].shard_numel
def stall():                      # called mid-file, after the first tensor went to disk
    print("mid-write", flush=True)
    time.sleep(60)
    return torch.zeros(shard)
def save(step):
    recs = []
    for r in range(2):
        shards = {"u0.param": torch.full((shard,), float(step))}
        if step == 2:
            shards["u0.exp_avg"] = LazyShard((shard,), torch.float32, stall)
        recs.append(write_rank_shards(root, step, r, 2, shards))
    write_index(root, step, {"units": unit_metas(units, lay)}, recs)
save(1)
print("saved", flush=True)
save(2)
"""


def _line(child, timeout):
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    return child.stdout.readline().strip() if ready else b""


def test_sigkill_mid_write_keeps_previous(tmp_path):
    """A process killed while writing a checkpoint (a subprocess: fork would share torch's thread pools)."""
    n = 8 << 20                                    # 32 MiB of fp32 per save, 16 MiB per rank file and tensor
    # Unbuffered: a buffered reader could swallow both lines at once and leave select() waiting.
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(n)], stdout=subprocess.PIPE,
                             bufsize=0)
    step2 = checkpoint_path(tmp_path, 2)
    try:
        assert _line(child, 60) == b"saved", "the child did not save step 1"
        assert _line(child, 60) == b"mid-write", "the child did not reach the middle of step 2"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert list(step2.glob(".rank-*.tmp-*")), "the kill did not land mid-write"
    messages = []
    found = latest_complete(tmp_path, report=messages.append)
    assert found == checkpoint_path(tmp_path, 1)
    assert "step-000002 refused" in messages[0] and "index.json" in messages[0]
    got = load_for_rank(found, 0, 1, [flat_layout(n, 1)])
    assert got["u0.param"].numel() == n and bool((got["u0.param"] == 1).all())
    # The next save at that step (a resumed run) replaces the debris and completes.
    lay = [flat_layout(n, 2)]
    recs = [write_rank_shards(tmp_path, 2, r, 2, {"u0.param": torch.zeros(lay[0].shard_numel)}, tag="resumed")
            for r in range(2)]
    write_index(tmp_path, 2, {"units": unit_metas([UnitSpec("big", [("w", (n,))])], lay)}, recs, tag="resumed")
    assert not list(step2.glob(".rank-*.tmp-*"))
    assert latest_complete(tmp_path) == step2


def test_lazy_shards_fetched_one_at_a_time(tmp_path, model):
    """State living off host (NVMe, device) is fetched right before it is written."""
    units, full = model
    lay = layouts_for(units, 1)
    fetched = []

    def fetch(i):
        fetched.append(i)
        return owned_shard(full[i, "exp_avg"], lay[i], 0)
    shards = {f"u{i}.exp_avg": LazyShard((lay[i].shard_numel,), torch.float32, lambda i=i: fetch(i))
              for i in range(len(units))}
    shards.update({f"u{i}.param": owned_shard(full[i, "param"], lay[i], 0) for i in range(len(units))})
    rec = write_rank_shards(tmp_path, 1, 0, 1, shards)
    assert fetched == list(range(len(units)))
    write_index(tmp_path, 1, {"units": unit_metas(units, lay)}, [rec])
    got = load_for_rank(checkpoint_path(tmp_path, 1), 0, 1, lay, kinds=["exp_avg"])
    assert sorted(got) == sorted(f"u{i}.exp_avg" for i in range(len(units)))
    assert torch.equal(got["u2.exp_avg"][:units[2].numel], full[2, "exp_avg"])


def test_cli_errors_name_the_file_without_traceback(tmp_path, model, capsys):
    from zdsl.runtime.checkpoint.export_cli import main as export_main
    from zdsl.runtime.checkpoint.inspect import main as inspect_main
    assert export_main([str(tmp_path / "nowhere"), "-o", str(tmp_path / "m.safetensors")]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    units, full = model
    path, _ = save(tmp_path, 4, units, full, 2, threads=False)
    (path / "index.json").write_text("{")
    assert inspect_main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "index.json" in err and "Traceback" not in err


def test_export_writes_tied_aliases(tmp_path, model):
    """A model that lists a tied weight twice in its state dict gets both keys, for a strict load."""
    nn = torch.nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.out = nn.Linear(4, 8, bias=False)
            self.out.weight = self.emb.weight           # tied, registered twice

        def units(self):
            return [self.emb, self.out]
    m = Tiny()
    specs = [UnitSpec("emb", [("weight", (8, 4))]), UnitSpec("out", [])]
    lay = [flat_layout(32, 2), flat_layout(0, 2)]
    metas = unit_metas(specs, lay, unit_prefixes(m))
    aliases = state_dict_aliases(m, metas)
    assert aliases == {"out.weight": "emb.weight"}
    w = torch.randn(32)
    recs = [write_rank_shards(tmp_path, 1, r, 2, {"u0.param": owned_shard(w, lay[0], r),
                                                   "u1.param": owned_shard(torch.zeros(0), lay[1], r)})
            for r in range(2)]
    write_index(tmp_path, 1, {"units": metas, "aliases": aliases}, recs)
    export(tmp_path, tmp_path / "tiny.safetensors")
    sd = load_file(str(tmp_path / "tiny.safetensors"))
    Tiny().load_state_dict(sd, strict=True)
    assert torch.equal(sd["out.weight"].reshape(-1), w) and torch.equal(sd["emb.weight"], sd["out.weight"])
