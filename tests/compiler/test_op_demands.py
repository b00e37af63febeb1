"""The core-sharing model's per-op demands (zdsl.sim.simulate.op_demands) are worked out once per
op kind and lane, or op kind and group: each must equal what the per-op functions say of that op."""
from __future__ import annotations

import pytest

from zdsl.driver import compile_schedule
from zdsl.model.units import gpt_units
from zdsl.schedule import MachineProfile, OptimizerSpec, Schedule, TrainSpec
from zdsl.sim.rates import for_graph
from zdsl.sim.simulate import cpu_demand, op_demands, takes_share_first, under_load

UNITS = gpt_units(layers=2, width=64, heads=4, vocab=128, context=16)


def machine(cores: float, name: str = "cpu") -> MachineProfile:
    return MachineProfile.of(name=name, flops=5e10, host_flops=5e10, link_bandwidth=2e9, link_latency=2e-4,
                             memory_bandwidth=3e10, op_overhead=1e-4, comm_overhead=3e-4, cores=cores,
                             comm_under_load=0.02, comm_slots=2)


def graph(ranks: int, per_node: int | None, over: str):
    s = Schedule(name="demands", ranks=ranks, per_node=per_node, stage=3,
                 shard_over={"optimizer": over, "gradients": over, "parameters": over},
                 train=TrainSpec(precision="fp32", batch=2), optimizer=OptimizerSpec(kind="adamw", clip=None))
    return compile_schedule(s, UNITS)


def mixed_graph():
    """HSDP at 4 ranks on 2 nodes with one gather over all ranks (through gloo, beside the node
    pairs' through shared memory) and one step on the host lane: ops of one kind whose demands
    differ by group and by lane."""
    g = graph(4, 2, "node")
    next(op for op in g.ops if op.kind == "comm.all_gather").group = "all"
    next(op for op in g.ops if op.kind == "compute.step").lane = "host"
    return g


@pytest.mark.parametrize("name", ["cpu", "cuda"])
@pytest.mark.parametrize("cores", [1.0, 2.0])
@pytest.mark.parametrize("shape", [(4, 2, "node"), (4, None, "group(2)"), (4, None, "all"), (8, 4, "group(2)"),
                                   "mixed"])
def test_each_op_demands_what_the_per_op_functions_say(name, cores, shape):
    g = mixed_graph() if shape == "mixed" else graph(*shape)
    m = for_graph(machine(cores, name), g)
    n = len(g.ops)
    fixed, work, wake = [0.1] * n, [0.2] * n, [0.3] * n
    demands = op_demands(g, m, fixed, work, wake)
    assert demands.work_cores == [cpu_demand(op, m) for op in g.ops]
    assert demands.under == [under_load(g, op, m) for op in g.ops]
    assert demands.first == [takes_share_first(m) and op.kind.startswith("nvme.") for op in g.ops]
    assert (demands.fixed, demands.work, demands.wake) == (fixed, work, wake)
