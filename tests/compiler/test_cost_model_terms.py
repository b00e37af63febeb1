"""Terms of the cost model that the runtime's own work sets, each against what the runtime
does for that op (benchmarks/capacity.py sets each op kind planned against measured)."""
from __future__ import annotations

import pytest

from zdsl.model.units import gpt_units
from zdsl.driver import compile_schedule
from zdsl.sim.simulate import collective_payload
from zdsl.sim.simulate import op_duration
from zdsl.sim.simulate import op_fixed
from zdsl.schedule import MachineProfile
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec

UNITS = gpt_units(layers=3, width=256, heads=4, vocab=256, context=32)
CPU = MachineProfile.of(name="cpu", flops=5e10, host_flops=5e10, link_bandwidth=2e9, link_latency=2e-4,
                        pcie_bandwidth=4e9, memory_bandwidth=3e10, op_overhead=1e-4, comm_overhead=3e-4)
GPU = MachineProfile.of(name="cuda", flops=1e12, link_bandwidth=1e9, link_latency=1e-5,
                        pcie_bandwidth=2e10, memory_bandwidth=1e11)


def graph(ranks: int, stage: int = 3, precision: str = "fp32"):
    s = Schedule(name="terms", ranks=ranks, stage=stage, train=TrainSpec(precision=precision, batch=4),
                 optimizer=OptimizerSpec(kind="adamw"))
    return compile_schedule(s, UNITS)


def rated(g, op, machine):
    return op_duration(g, op, machine) - op_fixed(op, machine)


@pytest.mark.parametrize("machine,copy_rate", [(CPU, CPU.copies.pcie_bandwidth), (GPU, GPU.compute.memory_bandwidth)],
                         ids=["cpu", "cuda"])
def test_a_one_rank_gather_or_scatter_copies_its_payload(machine, copy_rate):
    """At one rank nothing crosses a wire, but the runtime still copies each gather's shard into
    the full buffer and each reduce-scatter's gradient into its shard: the payload at the
    machine's copy rate (it cost 1.2 and 0.9 s a step at 10 layers, priced at 0 before)."""
    g = graph(ranks=1)
    comms = [op for op in g.ops if op.kind in ("comm.all_gather", "comm.reduce_scatter")]
    assert {op.kind for op in comms} == {"comm.all_gather", "comm.reduce_scatter"}
    for op in comms:
        assert collective_payload(g, op) > 0
        assert rated(g, op, machine) == pytest.approx(collective_payload(g, op) / copy_rate)


def test_a_one_rank_all_reduce_moves_nothing():
    g = graph(ranks=1, stage=0)
    reduces = [op for op in g.ops if op.kind == "comm.all_reduce"]
    assert reduces
    assert all(rated(g, op, CPU) == 0.0 for op in reduces)


def test_two_ranks_still_pay_the_wire():
    g = graph(ranks=2)
    op = next(op for op in g.ops if op.kind == "comm.all_gather")
    assert rated(g, op, CPU) == pytest.approx(CPU.collectives.node.latency + collective_payload(g, op) / 2 / CPU.collectives.node.bandwidth)
