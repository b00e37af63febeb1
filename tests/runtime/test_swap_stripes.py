"""A swapper over several folders: each buffer's blocks striped over one file per folder (RAID-0).

The bits read back are those written; block i lies in folder i mod n at (i div n) * block, so the
files of one folder hold the one-folder file's bytes; a corrupt block names the file it is in;
a folder that cannot be used is named, and leaves no run folder behind in the others.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch
import trio

from zdsl.runtime.offload import swap as swap_mod
from zdsl.runtime.offload.swap import SwapError
from zdsl.runtime.offload.swap import Swapper
from zdsl.swap_folders import stripe_bytes

BLOCK = 16 * 1024


def _tensor(nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _blocks(data: bytes, block: int) -> list[bytes]:
    return [data[i:i + block] for i in range(0, len(data), block)]


@pytest.mark.parametrize("nbytes", [5 * BLOCK, 5 * BLOCK + 100, BLOCK - 4096, 2 * BLOCK + 4096])
@pytest.mark.parametrize("folders", [2, 3])
def test_striped_blocks_read_back_the_same_bits_and_lie_in_folder_i_mod_n(tmp_path, nbytes, folders):
    dirs = [tmp_path / f"d{k}" for k in range(folders)]
    x = _tensor(nbytes)
    with Swapper(dirs, block_bytes=BLOCK, queue_depth=3) as s, Swapper(tmp_path / "one", block_bytes=BLOCK) as one:
        s.write_sync("w", x)
        one.write_sync("w", x)
        out = torch.empty_like(x)
        s.read_sync("w", out)
        assert torch.equal(out, x)
        out.zero_()
        trio.run(s.read, "w", out)
        assert torch.equal(out, x)
        files = s.paths("w")
        assert [f.parent.parent for f in files] == [d.absolute() for d in dirs]
        expected = _blocks(one.path("w").read_bytes(), BLOCK)        # the one-folder layout, padded
        for k, f in enumerate(files):
            assert _blocks(f.read_bytes(), BLOCK) == expected[k::folders]
        assert [f.stat().st_size for f in files] == stripe_bytes(nbytes, BLOCK, folders)
        assert s.path("w", block=folders + 1) == files[1]


def test_a_corrupt_block_names_the_striped_file_it_is_in(tmp_path):
    x = _tensor(4 * BLOCK)
    with Swapper([tmp_path / "a", tmp_path / "b"], block_bytes=BLOCK) as s:
        s.write_sync("c", x)
        path = s.path("c", block=3)                 # folder b, its second block
        assert path.parent.parent == (tmp_path / "b").absolute()
        with open(path, "r+b") as f:
            f.seek(BLOCK + 7)
            byte = f.read(1)
            f.seek(BLOCK + 7)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(SwapError, match=rf"{path}: checksum mismatch in block 3 .*at offset {BLOCK} of this file"):
            s.read_sync("c", torch.empty_like(x))


def test_striped_writes_keep_every_folders_requests_in_flight_at_once(tmp_path, monkeypatch):
    """Consecutive blocks go to different folders: the first write to each file waits for one to the
    other (a layout that serialised the folders would break the barrier)."""
    real, met, barrier = swap_mod.pwrite_all, set(), threading.Barrier(2, timeout=30)

    def meeting(fd, view, off):
        if fd not in met:
            met.add(fd)
            barrier.wait()
        return real(fd, view, off)

    monkeypatch.setattr(swap_mod, "pwrite_all", meeting)
    with Swapper([tmp_path / "a", tmp_path / "b"], block_bytes=4096, queue_depth=4) as s:
        s.write_sync("x", _tensor(2 << 20))       # two workers (one per MiB)
        out = torch.empty(2 << 20, dtype=torch.uint8)
        s.read_sync("x", out)
        assert torch.equal(out, _tensor(2 << 20))


def test_reserve_adds_up_folders_on_one_filesystem(tmp_path, monkeypatch):
    class Small:
        f_frsize, f_bavail = 4096, 3       # 12 KiB free: each folder's half fits, both do not

    monkeypatch.setattr(swap_mod.os, "statvfs", lambda p: Small())
    with Swapper([tmp_path / "a", tmp_path / "b"], block_bytes=4096) as s:
        with pytest.raises(SwapError, match=r"swap folder .*a and .*b: disk full: needs 16384 bytes, 12288 bytes free"):
            s.reserve({"x": 4 * 4096})
        s.reserve({"y": 2 * 4096})


def test_a_folder_that_cannot_be_used_is_named_and_the_others_are_left_clean(tmp_path):
    good, blocked = tmp_path / "good", tmp_path / "blocked"
    blocked.write_text("a file where the folder should be")
    with pytest.raises(SwapError, match=rf"swap folder {blocked}/rank0: cannot create it: {blocked} is a file"):
        Swapper([good / "rank0", blocked / "rank0"])
    assert not (good / "rank0").exists()           # the first folder's run folder (and the folder it made) went
    gone = tmp_path / "gone"
    os.symlink(tmp_path / "unmounted", gone)
    with pytest.raises(SwapError, match=rf"{gone} is a link to {tmp_path / 'unmounted'}, which does not exist"):
        Swapper([good, gone])


def test_one_folder_named_twice_is_refused(tmp_path):
    with pytest.raises(SwapError, match="distinct folders"):
        Swapper([tmp_path / "a", tmp_path / "a"])
