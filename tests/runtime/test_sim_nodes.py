"""ZDSL_SIM_NODES (runtime/dist/sim_nodes.py): benchmarks/hierarchy.py's nodes simulated on one
machine. A collective over ranks of two simulated nodes completes its ring's bytes / RATE after
the real one, queued behind the rank's earlier ones; one within a node, or with the variable
unset, is untouched. The real collectives are stood in for by ones that complete at once."""
from __future__ import annotations

import time

import pytest
import torch

from zdsl.runtime.dist import sim_nodes
from zdsl.runtime.dist.collectives import Pending


def done(*args, group=None, async_op=False):
    future = torch.futures.Future()
    future.set_result(None)
    return Pending(future) if async_op else None


def wrapped(monkeypatch, value, ranks):
    monkeypatch.setenv("ZDSL_SIM_NODES", value)
    monkeypatch.setattr(sim_nodes, "members", lambda group: ranks)
    return sim_nodes.slowed(Pending, done, done, done)


def test_unset_leaves_the_collectives_as_they_are(monkeypatch):
    monkeypatch.delenv("ZDSL_SIM_NODES", raising=False)
    assert sim_nodes.slowed(Pending, done, done, done) == (done, done, done)


def test_a_collective_across_simulated_nodes_waits_its_bytes_at_the_rate(monkeypatch):
    all_gather, _, all_reduce = wrapped(monkeypatch, "2:1e6", [0, 1, 2, 3])     # 2 nodes of 2
    full = torch.zeros(25_000)                                                  # 100 kB
    start = time.perf_counter()
    work = all_gather(full, full[:6250], group="g", async_op=True)
    work.wait()
    assert time.perf_counter() - start >= 100_000 * 3 / 4 / 1e6                 # 75 ms: (n-1)/n of it
    start = time.perf_counter()
    all_reduce(full, group="g")                                                  # twice the bytes, waited in place
    assert time.perf_counter() - start >= 2 * 100_000 * 3 / 4 / 1e6


def test_a_collective_within_a_simulated_node_is_untouched(monkeypatch):
    real = Pending(torch.futures.Future())
    monkeypatch.setenv("ZDSL_SIM_NODES", "2:1e3")
    monkeypatch.setattr(sim_nodes, "members", lambda group: [2, 3])                # one node of 2
    all_gather, _, _ = sim_nodes.slowed(Pending, lambda *a, group=None, async_op=False: real, done, done)
    full = torch.zeros(25_000)
    assert all_gather(full, full[:12_500], group="node", async_op=True) is real    # the real work, not delayed


@pytest.mark.parametrize("value", ["2", "0:1e6", "2:0", "two:1e6"])
def test_a_bad_setting_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("ZDSL_SIM_NODES", value)
    with pytest.raises(ValueError, match="ZDSL_SIM_NODES"):
        sim_nodes.setting()


class NoFuture:
    """A work as gloo's reduce-scatter returns it: done, but without a future."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented")


def test_a_work_without_a_future_is_waited_for_its_delay_too(monkeypatch):
    monkeypatch.setenv("ZDSL_SIM_NODES", "2:1e6")
    monkeypatch.setattr(sim_nodes, "members", lambda group: [0, 1, 2, 3])
    _, reduce_scatter, _ = sim_nodes.slowed(Pending, done, lambda *a, group=None, async_op=False: NoFuture(), done)
    full = torch.zeros(25_000)
    start = time.perf_counter()
    work = reduce_scatter(full[:6250], full, group="g", async_op=True)
    with pytest.raises(RuntimeError, match="getFuture"):
        work.get_future()                       # so the executor waits for it in a thread
    work.wait()
    assert time.perf_counter() - start >= 100_000 * 3 / 4 / 1e6
