"""Per-level link rates (issue 57): ``machine ...(cluster_link=, cluster_latency=)`` prices a
collective whose group spans nodes at the cluster's rate, one within a node at ``link``/``latency``,
each a ring over its own group's ranks. Hand-built graphs with ``Op.group`` set, so the pricing is
checked apart from what the compiler emits."""
from __future__ import annotations

import pytest

from zdsl.check.checker import check_text
from zdsl.check.printer import print_schedule
from zdsl.ir import Buffer, Op, TaskGraph, UnitInfo
from zdsl.lang.errors import ZsError
from zdsl.machine_profile import MachineProfile
from zdsl.sim.simulate import op_duration

PAYLOAD = 8_000_000          # bytes of the full tensor each collective moves
NODE = MachineProfile.of(link_bandwidth=1e9, link_latency=1e-5)
TWO_LEVELS = NODE.with_fields(cluster_bandwidth=1e8, cluster_latency=1e-3)


def graph(world: int, per_node: int) -> TaskGraph:
    units = [UnitInfo(0, "u0", PAYLOAD // 4, PAYLOAD // 4, PAYLOAD // 4 // world)]
    bufs = [Buffer("param_full[0]", "param_full", 0, "device", PAYLOAD)]
    return TaskGraph("hand", world, 3, "fp32", 1, units, {b.name: b for b in bufs}, [], per_node=per_node)


def collective(kind: str, group: str) -> Op:
    return Op(0, kind, "comm", 0, reads=["param_full[0]"], bytes=PAYLOAD, group=group)


@pytest.mark.parametrize("kind, group, size, rate, latency, rings", [
    ("comm.all_gather", "all", 8, 1e8, 1e-3, 1),            # every rank: spans both nodes
    ("comm.reduce_scatter", "all", 8, 1e8, 1e-3, 1),
    ("comm.all_gather", "within:4", 4, 1e9, 1e-5, 1),       # a node: its own link, a ring of 4
    ("comm.all_reduce", "across:4", 2, 1e8, 1e-3, 2),       # one replica per node: reduce-scatter + all-gather
])
def test_a_collective_is_a_ring_over_its_group_at_its_levels_rate(kind, group, size, rate, latency, rings):
    sec = op_duration(graph(8, 4), collective(kind, group), TWO_LEVELS)
    assert sec == pytest.approx(rings * (latency + PAYLOAD * (size - 1) / size / rate))


def test_on_one_node_or_without_cluster_rates_every_collective_runs_on_the_link():
    for world, per_node, machine in ((8, 0, TWO_LEVELS), (8, 8, TWO_LEVELS), (8, 4, NODE)):
        sec = op_duration(graph(world, per_node), collective("comm.all_gather", "all"), machine)
        assert sec == pytest.approx(1e-5 + PAYLOAD * 7 / 8 / 1e9)


def test_cluster_latency_alone_keeps_the_links_bandwidth():
    machine = NODE.with_fields(cluster_latency=1e-3)
    sec = op_duration(graph(8, 4), collective("comm.all_gather", "all"), machine)
    assert sec == pytest.approx(1e-3 + PAYLOAD * 7 / 8 / 1e9)


MODEL = "model gpt(layers=2, width=32, heads=4, vocab=64, context=8)\n"


def test_the_machine_statement_takes_the_cluster_link_and_prints_it_back():
    schedule, _ = check_text(MODEL + "machine cuda(link=3e11, latency=3e-6, cluster_link=5e10, cluster_latency=5e-6)\n",
                             "m.zs")
    collectives = schedule.machine.collectives
    assert (collectives.cluster_bandwidth, collectives.cluster_latency) == (5e10, 5e-6)
    text = print_schedule(schedule)
    assert "link      node=(300000000000.0, 3e-06), cluster=(50000000000.0, 5e-06)" in text   # the link statement
    again, _ = check_text(print_schedule(schedule), "again.zs")
    assert again.machine == schedule.machine


@pytest.mark.parametrize("setting", ["cluster_link=0", "cluster_latency=-1e-6"])
def test_a_cluster_link_of_no_rate_is_refused_where_it_is_written(setting):
    with pytest.raises(ZsError) as info:
        check_text(MODEL + f"machine cpu({setting})\n", "m.zs")
    error = next(d for d in info.value.diagnostics if d.is_error)
    assert error.span.line == 2 and setting.split("=")[0] in error.message
