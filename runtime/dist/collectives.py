"""Collectives on flat buffers, across torch versions and backends.

torch 2.13 names the flat collectives ``all_gather_single`` and
``reduce_scatter_single``; 2.11 has ``all_gather_into_tensor`` and
``reduce_scatter_tensor``. We use the new names where they exist and the old
ones otherwise, so callers never see a deprecation warning or a missing name.

On NCCL the flat collectives are the fastest there are and are used as they
are. On gloo they are not (``benchmarks/collectives.py`` measures it): gloo's
flat all-gather and reduce-scatter run 1.5-3.5x slower than its own
broadcast and all-reduce moving the same bytes. So on gloo:

* at 2 ranks of one host, on CPU tensors, all three go through shared memory
  at any size (``runtime/dist/shm.py``; ``"shm"``, the default): no socket,
  no kernel copies, no gloo thread; each rank copies its peer's part into
  its outbox once and reads the peer's straight into its result (73 MiB: 2x
  faster than the paths below; 256 KiB reduce-scatter 0.5 ms against gloo's
  own 2.1; 8 bytes as fast as gloo's). Where it cannot serve (other hosts,
  more ranks, no /dev/shm, CUDA tensors) the paths below are used unchanged;
* all-gather = one async broadcast per rank, each rooted at the rank that
  owns that chunk of ``out`` (the same bytes on the wire, no reduction);
* reduce-scatter at 2 ranks = an exchange (``GLOO_REDUCE_SCATTER =
  "exchange"``): each rank broadcasts the half its peer owns straight into
  the peer's ``out`` and adds its own half there in the completion callback
  (gloo's thread, not the caller's): half the bytes of an all-reduce, and
  0.5x its time for a 12 MiB layer here;
* at more ranks, a reduction of the whole input whose result this rank
  keeps only its slice of (an in-place all-reduce, or one reduce per
  destination rank), the slice copied out in the completion callback.

Below ``GLOO_NATIVE_BELOW`` (1 MiB of full tensor) gloo's own are as fast
as these two paths or faster (one message each way; latency-bound) and are
used where shared memory cannot serve.

Both give the bits the flat collectives give at 2 ranks (a + b == b + a);
at more ranks the summation order is gloo's and may differ in the last ulp,
as any two reduction algorithms do. ``benchmarks/collectives.py`` and the
tests set ``GLOO_ALL_GATHER`` / ``GLOO_REDUCE_SCATTER`` / ``GLOO_ALL_REDUCE`` to
``"native"`` to compare with torch's own.

``reduce_scatter`` may overwrite its input: the runtime only reduce-scatters
gradients it is done with (the lowering never reads them again before the
next backward writes them; ``tests/runtime/test_collectives.py`` checks every
program's graph for it).

Where a backend refuses a flat reduce-scatter altogether, the fallback is an
all-reduce as above; it is logged once and counted in ``FALLBACKS``.

``group`` is a process group of some of the ranks (``runtime/dist/group.py``: a node, a shard
group, the replicas of a shard) or None, the default group of every rank. A subgroup of this rank
alone (a node of one rank) is served by a copy: its result, with no call into the backend.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode as _get_dispatch_mode

from zdsl.runtime.dist import shm
from zdsl.runtime.dist.affinity import loop_policy_error

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# What gloo runs: the measured winners. Benchmarks and tests set the others to compare them
# (all-gather: shm, broadcast or native; reduce-scatter: shm, exchange, all_reduce, reduce or
# native; all-reduce: shm or native). shm is for 2 ranks of one host and is broadcast /
# exchange / native where it cannot serve; exchange is for 2 ranks and is all_reduce at more.
GLOO_ALL_GATHER = "shm"
GLOO_REDUCE_SCATTER = "shm"
GLOO_ALL_REDUCE = "shm"
GLOO_NATIVE_BELOW = 1 << 20     # bytes of full tensor: below it gloo's own where shm cannot serve


def check_settings() -> None:
    """Raise ValueError naming a bad ZDSL_GLOO_LOOP_POLICY (runtime/dist/affinity.py), the one
    variable the collectives read: called before a run or a calibration joins its group, since
    importing never fails on it."""
    error = loop_policy_error()
    if error:
        raise ValueError(error)

# Collectives the backend lacked, served by a fallback: name -> times used.
FALLBACKS: dict[str, int] = {}
_no_native_reduce_scatter: set[str] = set()
_lock = threading.Lock()


class Pending:
    """Collectives in flight as one work: ``wait()`` (raises their error), ``is_completed()``,
    ``get_future()``; what to do after them runs in the completing thread."""

    def __init__(self, future: torch.futures.Future):
        self._future = future

    @classmethod
    def of(cls, works: list, then=None) -> "Pending":
        futures = [w.get_future() for w in works]
        if len(futures) == 1:
            future = futures[0]
        else:
            future = torch.futures.collect_all(futures).then(_raise_first_error)
        if then is not None:
            def after(done: torch.futures.Future):
                done.value()                # a failed collective: its error, not ``then``
                return then()
            future = future.then(after)
        return cls(future)

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self, timeout=None) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


def _raise_first_error(collected: torch.futures.Future) -> None:
    for f in collected.value():
        f.value()                       # raises that collective's error


def _finish(pending: Pending, async_op: bool):
    if async_op:
        return pending
    pending.wait()
    return None


def _count(name: str) -> None:
    with _lock:
        FALLBACKS[name] = FALLBACKS.get(name, 0) + 1


def _backend(group) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # not initialised: let the collective itself raise the clear error
        return "?"


def all_gather(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``inp`` into ``out`` (rank-major, one flat tensor)."""
    if _alone(group):
        return _finish(_copied(out, inp), async_op)
    backend = _backend(group)
    pair = _shm_pair(group, backend, GLOO_ALL_GATHER, out, inp)
    if pair is not None:
        return _finish(Pending(pair.all_gather(out, inp)), async_op)
    if backend != "gloo" or GLOO_ALL_GATHER == "native" or _small(out):
        return _all_gather(out, inp, group=group, async_op=async_op)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = out.view(world, -1)
    chunks[rank].copy_(inp)
    works = [dist.broadcast(chunks[i], src=_global_rank(group, i), group=group, async_op=True)
             for i in range(world)]
    return _finish(Pending.of(works), async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``inp`` over ranks and leave this rank's slice in ``out``. ``inp`` may be overwritten."""
    if _alone(group):
        return _finish(_copied(out, inp), async_op)
    backend = _backend(group)
    pair = _shm_pair(group, backend, GLOO_REDUCE_SCATTER, out, inp)
    if pair is not None:
        return _finish(Pending(pair.reduce_scatter(out, inp)), async_op)
    if backend == "gloo" and GLOO_REDUCE_SCATTER != "native" and not _small(inp):
        return _reduce_scatter_by(GLOO_REDUCE_SCATTER, out, inp, group, async_op)
    if backend not in _no_native_reduce_scatter:
        try:
            return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError) as exc:
            # only gloo lacks a native reduce-scatter: on NCCL such an error is a real failure
            if backend != "gloo" or ("support" not in str(exc).lower() and "implement" not in str(exc).lower()):
                raise
            _no_native_reduce_scatter.add(backend)
    _count("reduce_scatter->all_reduce")
    return _reduce_scatter_by("all_reduce", out, inp, group, async_op)


def _reduce_scatter_by(algorithm: str, out, inp, group, async_op: bool):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = inp.view(world, -1)
    if algorithm == "shm":              # where shared memory could not serve
        algorithm = "exchange"
    if algorithm == "exchange" and world == 2 and out.dtype == inp.dtype and out.is_contiguous():
        return _finish(_exchange(out, chunks, rank, group), async_op)
    if algorithm in ("all_reduce", "exchange"):
        works = [dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=group, async_op=True)]
    else:                               # one reduce per destination: each chunk summed at its owner
        works = [dist.reduce(chunks[i], dst=_global_rank(group, i), op=dist.ReduceOp.SUM, group=group,
                             async_op=True) for i in range(world)]
    return _finish(Pending.of(works, then=lambda: out.copy_(chunks[rank])), async_op)


def _exchange(out: torch.Tensor, chunks: torch.Tensor, rank: int, group) -> Pending:
    """2-rank reduce-scatter: rank r sends ``chunks[1 - r]`` into its peer's ``out`` (a broadcast
    from r, received into ``out`` by the peer), then ``out += chunks[r]``. Bits as the all-reduce's
    (peer's + mine == mine + peer's); ``out`` must not overlap ``chunks``."""
    works = [dist.broadcast(chunks[1 - src] if src == rank else out, src=_global_rank(group, src), group=group,
                            async_op=True) for src in range(2)]
    return Pending.of(works, then=lambda: out.add_(chunks[rank]))


def _shm_fits(out: torch.Tensor, inp: torch.Tensor) -> bool:
    """Whether shared memory can serve this pair of tensors (the group decides the rest). Not under
    a dispatch mode (the happens-before checker, runtime/exec/hb_check.py): it sees a collective
    by its c10d call, which only gloo's path makes."""
    return (out.device.type == "cpu" and inp.device.type == "cpu" and out.dtype == inp.dtype
            and out.is_contiguous() and inp.is_contiguous() and _get_dispatch_mode() is None)


def _shm_pair(group, backend: str, algorithm: str, out: torch.Tensor, inp: torch.Tensor) -> "shm.Pair | None":
    """The group's shared-memory pair where ``algorithm`` is ``"shm"`` and it can serve (gloo, CPU
    tensors; :func:`shm.pair_of`: 2 ranks of one host), at any size; else None."""
    if algorithm != "shm" or backend != "gloo" or not _shm_fits(out, inp):
        return None
    return shm.pair_of(group)


def _alone(group) -> bool:
    """A subgroup of this rank alone."""
    return group is not None and dist.get_world_size(group) == 1


def _copied(out: torch.Tensor, inp: torch.Tensor) -> Pending:
    """A one-rank collective, done: ``out`` holds ``inp``."""
    if out.data_ptr() != inp.data_ptr():
        out.copy_(inp)
    done: torch.futures.Future[None] = torch.futures.Future()
    done.set_result(None)
    return Pending(done)


def _small(full: torch.Tensor) -> bool:
    return full.numel() * full.element_size() < GLOO_NATIVE_BELOW


def _global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def all_reduce(tensor: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``tensor`` over ranks in place."""
    if _alone(group):
        return _finish(_copied(tensor, tensor), async_op)
    pair = _shm_pair(group, _backend(group), GLOO_ALL_REDUCE, tensor, tensor)
    if pair is not None:
        return _finish(Pending(pair.all_reduce(tensor)), async_op)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


GLOO_DEFAULT_THREADS = 2     # torch's ProcessGroupGloo default


def comm_slots() -> int:
    """Collectives the default group's backend runs at once: gloo takes them off a queue with its
    worker threads (two unless set), so one issued behind another starts as soon as either is
    free; NCCL runs a group's collectives one after another on its stream."""
    world = dist.group.WORLD
    if not dist.is_initialized() or world is None or dist.get_backend() != "gloo":
        return 1
    try:
        options = world._get_backend(torch.device("cpu")).options    # gloo's own Options subclass
        return max(1, int(getattr(options, "_threads")))
    except (AttributeError, RuntimeError, TypeError, ValueError):   # a torch without the private field
        return GLOO_DEFAULT_THREADS


# Nodes simulated on one machine for benchmarks/hierarchy.py (ZDSL_SIM_NODES): unset, unchanged.
from zdsl.runtime.dist import sim_nodes  # noqa: E402 (wraps the functions defined above)

all_gather, reduce_scatter, all_reduce = sim_nodes.slowed(Pending, all_gather, reduce_scatter, all_reduce)
