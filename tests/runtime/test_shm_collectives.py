"""Same-host 2-rank collectives through shared memory (runtime/dist/shm.py).

Each test spawns two real gloo ranks. The shared-memory path must give gloo's bits,
fail with a named error (not hang) when its peer dies mid-collective, fall back to gloo
when the ranks cannot share memory, and leave nothing behind in /dev/shm.
"""
from __future__ import annotations

import os
import signal

import pytest

from zdsl.runtime.dist.spawn import LocalRanks, run_ranks

pytestmark = pytest.mark.slow     # every test spawns 2 ranks: deselect with -m 'not slow'

SLOT = 4096                    # small slots: several pieces and slot reuse even at these sizes
SIZES = (2 * 1237, 2 * 5003 + 2, 2 * 12289)     # element counts; no nice multiples
DTYPES = ("float32", "bfloat16", "float64")


def _join(rank: int, timeout_s: float | None = None):
    import datetime

    import torch
    import torch.distributed as dist

    from zdsl.runtime.dist import collectives, shm
    torch.set_num_threads(1)
    shm.SLOT_BYTES = SLOT
    collectives.GLOO_NATIVE_BELOW = 0          # these tensors are small: take the chosen path anyway
    timeout = {} if timeout_s is None else dict(timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", rank=rank, world_size=2, **timeout)
    return torch, dist, collectives, shm


def _results(collectives, torch, n: int, dtype, rank: int, path: str) -> dict:
    """The three collectives along ``path`` ("shm", or gloo's paths), on inputs seeded by rank."""
    collectives.GLOO_ALL_GATHER = "shm" if path == "shm" else "broadcast"
    collectives.GLOO_REDUCE_SCATTER = "shm" if path == "shm" else "exchange"
    collectives.GLOO_ALL_REDUCE = "shm" if path == "shm" else "native"
    g = torch.Generator().manual_seed(1000 * rank + n)
    full = (torch.randn(n, generator=g) * 1e3).to(dtype)
    shard = torch.randn(n // 2, generator=g).to(dtype)
    gathered = torch.full((n,), float("nan"), dtype=dtype)
    scattered = torch.full((n // 2,), float("nan"), dtype=dtype)
    summed = full.clone()
    then = []
    work = collectives.all_gather(gathered, shard, async_op=True)
    work.get_future().then(lambda f: then.append("gathered"))
    scatter_work = collectives.reduce_scatter(scattered, full.clone(), async_op=True)
    collectives.all_reduce(summed)
    work.wait()
    scatter_work.wait()
    return dict(gathered=gathered, scattered=scattered, summed=summed, then=then)


def _bits_rank(rank: int, world: int) -> dict:
    torch, dist, collectives, shm = _join(rank)
    out = {}
    for dtype in DTYPES:
        for n in SIZES:
            ours = _results(collectives, torch, n, getattr(torch, dtype), rank, "shm")
            gloo = _results(collectives, torch, n, getattr(torch, dtype), rank, "gloo")
            for key in ("gathered", "scattered", "summed"):
                a, b = ours[key], gloo[key]
                same = a.view(torch.uint8).equal(b.view(torch.uint8))
                out[(dtype, n, key)] = same
            out[(dtype, n, "then")] = ours["then"] == ["gathered"]
    out["pair"] = shm.pair_of(None) is not None
    out["pid"] = os.getpid()
    dist.barrier()
    return out


def _left_in_shm(pids) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if any(f"zdsl-shm-{pid}-" in f for pid in pids)]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_shared_memory_gives_gloos_bits_and_leaves_nothing_behind():
    results = run_ranks(_bits_rank, 2)
    for r, got in enumerate(results):
        assert got["pair"], f"rank {r} did not use shared memory"
        wrong = [k for k, same in got.items() if isinstance(k, tuple) and not same]
        assert wrong == [], f"rank {r}: shared memory differs from gloo (or a callback did not run) in {wrong}"
    assert _left_in_shm([got["pid"] for got in results]) == []


def _dies_rank(rank: int, world: int, pids_file: str) -> None:
    torch, dist, collectives, shm = _join(rank)
    collectives.GLOO_ALL_GATHER = collectives.GLOO_REDUCE_SCATTER = "shm"
    n = 2 * 5003
    collectives.all_gather(torch.empty(n), torch.ones(n // 2))          # the pair is set up and works
    pair = shm.pair_of(None)
    assert pair is not None
    with open(f"{pids_file}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        class DieAfterTheFirstPiece:     # the peer dies with the reduce-scatter half done
            def release(self):
                os.kill(os.getpid(), signal.SIGKILL)
        pair.peer.free = DieAfterTheFirstPiece()
    collectives.reduce_scatter(torch.empty(n // 2), torch.ones(n))        # rank 0: raises, rank 1: dies


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_peer_that_dies_mid_collective_is_an_error_naming_it_not_a_hang(tmp_path):
    import time
    pids_file = str(tmp_path / "pid")
    with LocalRanks(_dies_rank, 2, (pids_file,)) as ranks:
        deadline = time.monotonic() + 60
        while any(p.exitcode is None for p in ranks.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = {r: p.exitcode for r, p in ranks.procs.items()}
        failure = ranks.failure(0)
    assert codes == {0: 1, 1: -signal.SIGKILL}, codes          # neither is still waiting
    assert failure.error is not None and "reduce_scatter through shared memory" in failure.error
    assert "peer rank 1" in failure.error and "is gone" in failure.error, failure.error
    pids = [open(f"{pids_file}.{r}").read() for r in (0, 1)]
    assert _left_in_shm(pids) == []


def _late_rank(rank: int, world: int) -> str | None:
    import time
    torch, dist, collectives, shm = _join(rank, timeout_s=2)
    n = 2 * 5003
    collectives.all_gather(torch.empty(n), torch.ones(n // 2))          # the pair is set up and works
    if rank == 1:
        time.sleep(4)                    # alive, but never comes to the reduce-scatter
        return None
    try:
        collectives.reduce_scatter(torch.empty(n // 2), torch.ones(n))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_peer_that_does_not_come_is_an_error_after_the_groups_timeout():
    error = run_ranks(_late_rank, 2)[0]
    assert error == "reduce_scatter through shared memory: peer rank 1 did not send its piece within the " \
                    "group's timeout of 2 s"


def _other_host_rank(rank: int, world: int) -> dict:
    import socket
    socket.gethostname = lambda: f"host{rank}"       # as if the ranks ran on two machines
    torch, dist, collectives, shm = _join(rank)
    got = _results(collectives, torch, 2 * 5003, torch.float32, rank, "shm")
    want = _results(collectives, torch, 2 * 5003, torch.float32, rank, "gloo")
    same = all(got[k].equal(want[k]) for k in ("gathered", "scattered", "summed"))
    return dict(pair=shm.pair_of(None) is not None, same=same, then=got["then"])


def test_ranks_on_different_hosts_keep_gloo():
    for got in run_ranks(_other_host_rank, 2):
        assert got == dict(pair=False, same=True, then=["gathered"])


def _held_rank(rank: int, world: int) -> list[list[int]]:
    """How many more owners the tensors have than before, as each collective's wait() returns: the
    worker must drop a collective's closure before completing it, or the buffer the executor then
    frees is still referred to and its block is never given back to the host pool for reuse."""
    torch, dist, collectives, shm = _join(rank)
    from zdsl.runtime.state.host_pool import _use_count
    n = 2 * 5003
    full, shard = torch.randn(n), torch.randn(n // 2)
    gathered, scattered = torch.empty(n), torch.empty(n // 2)
    counts = lambda: [_use_count(t) for t in (full, shard, gathered, scattered)]   # noqa: E731
    before, extra = counts(), []
    for issue in (lambda: collectives.all_gather(gathered, shard, async_op=True),
                  lambda: collectives.reduce_scatter(scattered, full, async_op=True),
                  lambda: collectives.all_reduce(gathered, async_op=True)):
        issue().wait()
        extra.append([a - b for a, b in zip(counts(), before)])
    dist.destroy_process_group()
    return extra


def test_a_finished_collective_holds_none_of_its_tensors():
    for extra in run_ranks(_held_rank, 2):
        assert extra == [[0, 0, 0, 0]] * 3, extra


def _routing_rank(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from zdsl.runtime.dist import collectives, shm
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)       # the runtime's defaults, untouched
    pieces = {}
    for n in (2, 2 * 1024):                                         # 8 bytes, 8 KiB: far under 1 MiB
        collectives.all_gather(torch.empty(n), torch.ones(n // 2))
        collectives.reduce_scatter(torch.empty(n // 2), torch.ones(n))
        collectives.all_reduce(torch.ones(n))
        pieces[n] = shm.pair_of(None).pieces
    dist.barrier()
    return pieces


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_two_ranks_small_collectives_go_through_shared_memory_too():
    """Gloo's own collectives below 1 MiB run several times slower in some pairs of processes than
    in others, and shared memory is as fast even at 8 bytes (benchmarks/collectives.py): every
    size goes there."""
    for r, pieces in enumerate(run_ranks(_routing_rank, 2)):
        assert pieces[2] >= 3 and pieces[2 * 1024] >= pieces[2] + 3, f"rank {r}: {pieces}"
