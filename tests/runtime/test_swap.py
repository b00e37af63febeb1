"""The NVMe swapper: bitwise round trips, detected corruption, clear disk-full errors, clean folders."""

import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch
import trio

from zdsl.runtime.offload import swap as swap_mod
from zdsl.runtime.io import checksum
from zdsl.runtime.io.aligned import aligned_empty
from zdsl.runtime.offload.swap import Swapper
from zdsl.runtime.offload.swap import SwapError

BLOCK = 64 * 1024


@pytest.fixture
def swapper(tmp_path):
    with Swapper(tmp_path / "swap", block_bytes=BLOCK, queue_depth=4) as s:
        yield s


def _tensor(nbytes, dtype=torch.float32, seed=0):
    """Random bytes viewed as `dtype` (NaN patterns included: compare with `_same`)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype)


def _same(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


SIZES = [4, 4092, 4096, 4100, BLOCK, BLOCK + 4, 3 * BLOCK + 1000]


@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip_async_bitwise(swapper, nbytes):
    x = _tensor(nbytes)
    out = torch.empty_like(x)

    async def main():
        await swapper.write("p[0]", x)
        await swapper.read("p[0]", out)

    trio.run(main)
    assert _same(x, out)
    assert swapper.path("p[0]").stat().st_size % 4096 == 0  # padded in the file


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_round_trip_sync_dtypes_and_aligned_zero_copy(swapper, dtype):
    x = _tensor(2 * BLOCK + 8, dtype)
    swapper.write_sync("a", x)
    out = torch.empty_like(x)
    swapper.read_sync("a", out)
    assert _same(x, out)
    # aligned source and destination take the zero-copy path
    src = aligned_empty(x.numel() * x.element_size())
    src.copy_(x.view(torch.uint8))
    dst = aligned_empty(src.numel())
    swapper.write_sync("b", src)
    swapper.read_sync("b", dst)
    assert torch.equal(src, dst)


def test_unaligned_source_and_rewrite_with_other_size(swapper):
    base = _tensor(BLOCK * 2 + 4096)
    x = base[3:-5]  # data pointer not 4 KiB aligned
    swapper.write_sync("u", x)
    out = torch.empty_like(x)
    swapper.read_sync("u", out)
    assert _same(x, out)
    y = _tensor(100, seed=2)
    swapper.write_sync("u", y)
    small = torch.empty_like(y)
    swapper.read_sync("u", small)
    assert _same(y, small)
    assert swapper.bytes_written == x.numel() * 4 + 100


def test_read_errors_name_the_buffer(swapper):
    with pytest.raises(SwapError, match="nothing was written"):
        swapper.read_sync("missing", torch.empty(4))
    swapper.write_sync("a", torch.ones(10))
    with pytest.raises(SwapError, match="40 were written"):
        swapper.read_sync("a", torch.empty(11))
    with pytest.raises(SwapError, match="contiguous"):
        swapper.write_sync("b", torch.ones(4, 4).t())


def test_corruption_is_detected_with_file_and_block(swapper):
    x = _tensor(3 * BLOCK)
    swapper.write_sync("c", x)
    path = swapper.path("c")
    with open(path, "r+b") as f:  # flip one byte in block 1
        f.seek(BLOCK + 123)
        byte = f.read(1)
        f.seek(BLOCK + 123)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = torch.empty_like(x)
    with pytest.raises(SwapError, match=rf"{path.name}.*checksum mismatch in block 1"):
        swapper.read_sync("c", out)
    with pytest.raises(SwapError, match="checksum mismatch in block 1"):
        trio.run(swapper.read, "c", out)


def test_enospc_on_write_names_path_needed_and_free(swapper, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swap_mod.os, "pwritev", full)
    with pytest.raises(SwapError) as info:
        swapper.write_sync("big", _tensor(2 * BLOCK))
    message = str(info.value)
    assert str(swapper.run_dir) in message and "disk full" in message
    assert "needs" in message and "bytes free" in message
    with pytest.raises(SwapError, match="did not complete"):  # nothing half-written is read back
        swapper.read_sync("big", torch.empty(2 * BLOCK // 4))


def test_preflight_quota_names_path_needed_and_free(swapper, monkeypatch):
    real = os.statvfs

    class Tiny:
        def __init__(self, st):
            self.f_frsize = 4096
            self.f_bavail = 2  # 8 KiB free

    monkeypatch.setattr(swap_mod.os, "statvfs", lambda p: Tiny(real(p)))
    with pytest.raises(SwapError) as info:
        swapper.write_sync("w", _tensor(3 * 4096))
    message = str(info.value)
    assert "disk full" in message and "needs 12288" in message and "8192 bytes free" in message
    assert "w-0.swap" in message
    with pytest.raises(SwapError, match="needs 20480 bytes, 8192 bytes free"):
        swapper.reserve({"a": 4096, "b": 16384})


def test_folders_are_private(tmp_path):
    folder = tmp_path / "new" / "swap"
    with Swapper(folder) as s:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700  # created by us: private too
        assert stat.S_IMODE(s.run_dir.stat().st_mode) == 0o700
        s.write_sync("x", torch.ones(3))
        assert stat.S_IMODE(s.path("x").stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with Swapper(shared) as s:  # an existing folder (a scratch root) keeps its mode; the run folder is private
        assert stat.S_IMODE(shared.stat().st_mode) == 0o755
        assert stat.S_IMODE(s.run_dir.stat().st_mode) == 0o700


def test_close_removes_everything_also_on_error(tmp_path):
    folder = tmp_path / "swap"
    s = Swapper(folder)
    s.write_sync("x", torch.ones(1000))
    run = s.run_dir
    assert any(run.iterdir())
    s.close()
    s.close()  # idempotent
    assert not run.exists() and not folder.exists()  # the swapper made the folder: it goes too
    with pytest.raises(SwapError, match="closed"):
        s.write_sync("x", torch.ones(3))
    with pytest.raises(RuntimeError, match="boom"):
        with Swapper(folder) as s2:
            s2.write_sync("y", torch.ones(10))
            assert s2._finalizer.atexit  # the same cleanup runs at interpreter exit
            raise RuntimeError("boom")
    assert not folder.exists()


def test_close_keeps_a_folder_it_did_not_make_or_that_holds_more(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    with Swapper(folder) as s:
        s.write_sync("x", torch.ones(10))
    assert folder.exists() and list(folder.iterdir()) == []  # the user's folder stays, emptied of ours
    made = tmp_path / "made"
    with Swapper(made) as s:
        (made / "notes.txt").write_text("a user's file")
        s.write_sync("x", torch.ones(10))
    assert [p.name for p in made.iterdir()] == ["notes.txt"]  # never a file zdsl did not write
    other = tmp_path / "shared"
    with Swapper(other) as first, Swapper(other) as second:
        first.write_sync("x", torch.ones(10))
        second.write_sync("x", torch.ones(10))
        first.close()                     # made the folder, but the other run is still in it
        assert second.run_dir.exists()
    assert other.exists()                 # the second did not make it: an empty folder, no files
    assert list(other.iterdir()) == []


@pytest.mark.slow                 # spawns ranks
def test_a_clean_nvme_run_leaves_the_swap_folder_as_it_found_it(tmp_path):
    folder = tmp_path / "swap"            # the schedule's folder: kept, but no rank<N> folders in it
    program = Path(__file__).parents[2] / "programs" / "nvme.zs"
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "run", str(program), "--quiet", "--set", "steps=1",
                           "--set", f'offload.parameters=nvme("{folder}")',
                           "--set", f'offload.optimizer=nvme("{folder}")'],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_stale_run_of_a_dead_process_is_removed_and_logged(tmp_path):
    folder = tmp_path / "swap"
    folder.mkdir()
    # a fake run folder whose owner pid is dead and whose lock nobody holds
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = folder / f"run-{dead.pid}-abcd"
    stale.mkdir()
    (stale / "owner.lock").write_text(f"{dead.pid} {socket.gethostname()}\n")
    (stale / "p-0.swap").write_bytes(b"x" * 8192)
    other_host = folder / "run-1-ffff"  # another machine's run on a shared folder: not ours to judge
    other_host.mkdir()
    (other_host / "owner.lock").write_text("1 some-other-host\n")
    with structlog.testing.capture_logs() as logs:
        with Swapper(folder) as live:
            assert not stale.exists()
            assert other_host.exists()
            with Swapper(folder) as s:
                assert live.run_dir.exists(), "a live run (lock held) must never be removed"
                assert s.run_dir != live.run_dir
    events = [e for e in logs if e["event"] == "swap.stale_run_removed"]
    assert [e["path"] for e in events] == [str(stale)]
    assert events[0]["dead_pid"] == dead.pid and events[0]["bytes"] >= 8192


def test_killed_run_leaves_folder_that_next_start_cleans(tmp_path):
    # A separate interpreter, not os.fork(): forking a process that already runs threads (torch's,
    # trio's) can deadlock the child on a lock another thread held.
    folder = tmp_path / "swap"
    script = ("import os, sys, torch\n"
              "from zdsl.runtime.offload.swap import Swapper\n"
              "s = Swapper(sys.argv[1])\n"
              "s.write_sync('x', torch.ones(5000))\n"
              "print(s.run_dir, flush=True)\n"
              "os._exit(0)\n")       # dies without any cleanup, like SIGKILL
    out = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    run_dir = Path(out.strip().splitlines()[-1])
    assert run_dir.exists() and (run_dir / "owner.lock").exists()
    with Swapper(folder) as s:
        assert not run_dir.exists()
        assert [p.name for p in folder.iterdir()] == [s.run_dir.name]


def test_refused_o_direct_falls_back_to_buffered_io_with_a_warning(tmp_path, monkeypatch):
    # tmpfs refused O_DIRECT before Linux 6.6 (open fails with EINVAL); newer kernels accept it,
    # so the refusal is simulated to test the fallback everywhere.
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(swap_mod.os, "open", no_direct)
    with structlog.testing.capture_logs() as logs:
        with Swapper(tmp_path / "swap", block_bytes=BLOCK) as s:
            for name in ("t", "u"):
                x = _tensor(BLOCK + 12)
                s.write_sync(name, x)
                out = torch.empty_like(x)
                s.read_sync(name, out)
                assert _same(x, out)
                assert s.direct(name) is False
    assert [e["event"] for e in logs].count("swap.buffered_io") == 1  # warned once, not per file


def test_works_on_tmpfs():
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm here")
    folder = shm / f"zdsl-test-{os.getpid()}"
    try:
        with Swapper(folder, block_bytes=BLOCK) as s:
            x = _tensor(BLOCK + 12)
            trio.run(s.write, "t", x)
            out = torch.empty_like(x)
            trio.run(s.read, "t", out)
            assert _same(x, out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_block_checksum_catches_a_flip_anywhere(swapper):
    def check(t):
        return swapper._checksum(memoryview(t.numpy()))

    block = _tensor(4096 * 3 + 4, torch.uint8)
    base = check(block)
    assert check(block) == base
    for pos in (0, 1000, 3075, 6200, 9300, block.numel() - 1):  # spread over the block, and its last byte
        flipped = block.clone()
        flipped[pos] ^= 1
        assert check(flipped) != base, pos


def test_zlib_fallback_checksum_detects_corruption(swapper, monkeypatch):
    monkeypatch.setattr(swapper, "_checksum", checksum.CRC32)   # what a machine without crc32c uses
    x = _tensor(2 * BLOCK)
    swapper.write_sync("z", x)
    out = torch.empty_like(x)
    swapper.read_sync("z", out)
    assert _same(x, out)
    with open(swapper.path("z"), "r+b") as f:
        f.seek(7)
        f.write(b"\x00" if x.view(torch.uint8)[7] else b"\x01")
    with pytest.raises(SwapError, match="stored crc32 .*corrupt"):
        swapper.read_sync("z", out)


def test_cancelled_write_is_never_read_back(swapper):
    x = _tensor(64 * BLOCK)

    async def main():
        with trio.move_on_after(0):
            await swapper.write("c", x)

    trio.run(main)
    with pytest.raises(SwapError, match="did not complete"):
        swapper.read_sync("c", torch.empty_like(x))


def test_aligned_memory_and_pool():
    from zdsl.runtime.io.aligned import AlignedPool

    for n in (0, 1, 4096, 10_000):
        t = aligned_empty(n, pin=False)
        assert t.numel() == n and t.data_ptr() % 4096 == 0
    pool = AlignedPool(BLOCK, 3, pin=False)
    bufs = [pool.acquire() for _ in range(3)]
    assert {b.data_ptr() % 4096 for b in bufs} == {0} and len({b.data_ptr() for b in bufs}) == 3
    for b in bufs:
        pool.release(b)
    with pool.buffer() as b:
        assert b.numel() == BLOCK
    assert pool.nbytes == 3 * BLOCK


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="no transparent huge pages in this kernel")
def test_large_aligned_buffers_ask_for_huge_pages():
    # Direct I/O into 2 MiB pages is far faster than into 4 KiB ones (runtime/io/aligned.py): a buffer
    # of at least one huge page is advised so (smaps flag "hg"); a smaller one cannot hold one.
    big, small = aligned_empty(4 << 20, pin=False), aligned_empty(1 << 20, pin=False)
    assert "hg" in _vm_flags(big.data_ptr())
    assert "hg" not in _vm_flags(small.data_ptr())
    # the staging pool lies in whole huge pages, starting on one
    from zdsl.runtime.io.aligned import HUGE_PAGE, AlignedPool
    pool = AlignedPool(BLOCK, 3, pin=False)
    first = pool.acquire()
    assert first.data_ptr() % HUGE_PAGE == 0 and "hg" in _vm_flags(first.data_ptr())


def test_only_buffers_of_a_huge_page_or_more_move_in_place(swapper, monkeypatch):
    # A smaller one cannot lie in a huge page of its own: its blocks go through the staging pool.
    staged = []
    borrow = swapper.pool.buffer

    def counting():
        staged.append(1)
        return borrow()
    monkeypatch.setattr(swapper.pool, "buffer", counting)
    for nbytes, expect_staged in ((1 << 20, 16), (2 << 20, 0)):
        src = aligned_empty(nbytes, pin=False)
        src.copy_(_tensor(nbytes).view(torch.uint8))
        dst = aligned_empty(nbytes, pin=False)
        staged.clear()
        swapper.write_sync("x", src)
        swapper.read_sync("x", dst)
        assert torch.equal(src, dst) and len(staged) == 2 * expect_staged, nbytes


def test_concurrent_transfers_share_the_queue_depth(tmp_path):
    # More transfers at once than staging buffers, unaligned (staged) and aligned (zero-copy),
    # async and sync at the same time: all bytes come back, nothing deadlocks.
    import threading

    with Swapper(tmp_path / "swap", block_bytes=BLOCK, queue_depth=2) as s:
        data = {f"t{i}": _tensor(3 * BLOCK + 400 * i, seed=i)[1:] for i in range(6)}
        outs = {k: torch.empty_like(v) for k, v in data.items()}
        side = _tensor(5 * BLOCK + 7, torch.uint8, seed=99)
        side_out = torch.empty_like(side)

        def sync_side():
            s.write_sync("side", side)
            s.read_sync("side", side_out)

        async def main():
            async with trio.open_nursery() as n:
                for k, v in data.items():
                    n.start_soon(s.write, k, v)
            async with trio.open_nursery() as n:
                for k in data:
                    n.start_soon(s.read, k, outs[k])

        thread = threading.Thread(target=sync_side)
        thread.start()
        trio.run(main)
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert all(_same(data[k], outs[k]) for k in data)
        assert _same(side, side_out)
