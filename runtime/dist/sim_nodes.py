"""Nodes simulated on one machine, for benchmarks/hierarchy.py: ``ZDSL_SIM_NODES=P:RATE``.

A SIMULATION, not a network: the ranks run on one host as always, and a collective whose group
spans nodes of ``P`` consecutive ranks completes ``bytes / RATE`` seconds after it would have,
``bytes`` being what a ring sends from each rank over the group ((n-1)/n of the full tensor, an
all-reduce twice that; ``zdsl/planner/levels.py`` counts the same). The delays of one rank queue
behind each other (its one port to the other nodes), so ``RATE`` plays the part of a machine
profile's ``cluster_link`` and a plan with it prices the same wait. Unset (the default) the
collectives are untouched.
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from zdsl import env


def setting() -> tuple[int, float] | None:
    """(ranks per simulated node, bytes a second across nodes), or None where unset; a bad value
    is a ValueError naming the variable."""
    raw = env.get("ZDSL_SIM_NODES")
    if not raw:
        return None
    try:
        per_node, rate = raw.split(":")
        out = int(per_node), float(rate)
    except ValueError:
        out = (0, 0.0)
    if out[0] < 1 or out[1] <= 0:
        raise ValueError(f"ZDSL_SIM_NODES={raw!r}: write RANKS_PER_NODE:BYTES_PER_SECOND, e.g. 2:5e7")
    return out


class _Link:
    """One rank's port to the other nodes: when its last simulated transfer ends."""

    def __init__(self, rate: float):
        self.rate, self.free_at, self.lock = rate, 0.0, threading.Lock()

    def book(self, nbytes: float) -> float:
        """The time (perf_counter) a transfer of ``nbytes`` started now ends, behind the earlier ones."""
        with self.lock:
            self.free_at = max(time.perf_counter(), self.free_at) + nbytes / self.rate
            return self.free_at


def members(group) -> list[int]:
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def slowed(pending_cls, all_gather, reduce_scatter, all_reduce):
    """The three collectives, each delayed as the module docstring says where ZDSL_SIM_NODES is
    set; unchanged otherwise. ``pending_cls``: the collectives' work wrapper (a Future inside)."""
    found = setting()
    if found is None:
        return all_gather, reduce_scatter, all_reduce
    per_node, rate = found
    link = _Link(rate)

    def delayed(collective, rings: int, full_of):
        def run(*args, group=None, async_op: bool = False, **kwargs):
            ranks = members(group)
            work = collective(*args, group=group, async_op=async_op, **kwargs)
            if len({r // per_node for r in ranks}) < 2:
                return work
            n = len(ranks)
            end = link.book(rings * full_of(*args) * (n - 1) / n)
            if not async_op:
                time.sleep(max(0.0, end - time.perf_counter()))
                return work
            try:
                future = work.get_future()
            except RuntimeError:            # gloo's reduce-scatter has none: waited for in a thread
                return _Late(work, end)
            return pending_cls(_after(future, end))
        return run
    nbytes = lambda t: t.numel() * t.element_size()       # noqa: E731
    return (delayed(all_gather, 1, lambda out, inp: nbytes(out)),
            delayed(reduce_scatter, 1, lambda out, inp: nbytes(inp)),
            delayed(all_reduce, 2, lambda tensor: nbytes(tensor)))


class _Late:
    """A collective's work that has no future, completing no sooner than ``end``."""

    def __init__(self, work, end: float):
        self.work, self.end = work, end

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.end and self.work.is_completed()

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        time.sleep(max(0.0, self.end - time.perf_counter()))
        return True

    def get_future(self):
        raise RuntimeError("getFuture not implemented (the delayed work of a collective without one)")


def _after(future: torch.futures.Future, end: float) -> torch.futures.Future:
    """A future that completes with ``future``'s result (or error), at ``end`` at the earliest."""
    out: torch.futures.Future[object] = torch.futures.Future()

    def done(f: torch.futures.Future) -> None:
        def finish() -> None:
            try:
                out.set_result(f.value())
            except Exception as e:  # noqa: BLE001 - the collective's own error, passed on
                out.set_exception(e)
        threading.Timer(max(0.0, end - time.perf_counter()), finish).start()
    future.add_done_callback(done)
    return out
