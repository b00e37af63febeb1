"""How a one-rank CPU schedule's host work is priced. Two ops whose cost is a memory copy, priced
as one: a collective of one rank (the runtime copies the shard into the full buffer, the gradient
into its shard: no message to wait for) and a norm over bf16 gradients on a CPU (the runtime
upcasts them into an fp32 block first). Priced otherwise (the copies at gloo's rate under load,
the norm by its flops alone) both are far off a run at programs/capacity.zs's full size
(benchmarks/capacity.py sets each op kind planned against measured). And the cores its lanes
share: the node's, not one rank's share of it."""
from __future__ import annotations

import pytest

from zdsl.model.units import gpt_units
from zdsl.driver import compile_schedule
from zdsl.ir import DTYPE_BYTES
from zdsl.sim.rates import for_graph
from zdsl.sim.simulate import collective_payload
from zdsl.sim.simulate import op_duration
from zdsl.sim.simulate import op_fixed
from zdsl.sim.simulate import simulate
from zdsl.sim.simulate import under_load
from zdsl.schedule import MachineProfile
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec

UNITS = gpt_units(layers=3, width=256, heads=4, vocab=256, context=32)
# one core per rank shared by the lanes, and gloo's collectives at 2% of their rate while compute
# fills it (the calibrated profile's figures on this VM)
CPU = MachineProfile.of(name="cpu", flops=5e10, host_flops=5e10, link_bandwidth=2e9, link_latency=2e-4,
                        pcie_bandwidth=4e9, memory_bandwidth=3e10, op_overhead=1e-4, comm_overhead=3e-4,
                        cores=1.0, comm_under_load=0.02)
GPU = MachineProfile.of(name="cuda", flops=1e12, link_bandwidth=1e9, link_latency=1e-5,
                        pcie_bandwidth=2e10, memory_bandwidth=1e11)


def graph(ranks: int, precision: str = "fp32", stage: int = 3):
    s = Schedule(name="copies", ranks=ranks, stage=stage, train=TrainSpec(precision=precision, batch=4),
                 optimizer=OptimizerSpec(kind="adamw", clip=1.0))
    return compile_schedule(s, UNITS)


def comm_busy(g, machine) -> float:
    sim = simulate(g, machine)
    return sum(d for op, d in zip(g.ops, sim.duration) if op.kind in ("comm.all_gather", "comm.reduce_scatter"))


def test_a_one_rank_collective_shares_the_cores_as_a_copy():
    """At one rank ``comm_under_load`` (gloo's threads waiting for messages) does not apply: the
    copies take their share of the cores, so their planned time is the fair-share one."""
    fair = CPU.with_fields(comm_under_load=0.0)
    one, four = graph(ranks=1), graph(ranks=4)
    assert under_load(one, gathers(one)[0], CPU) == 0.0
    assert under_load(four, gathers(four)[0], CPU) == CPU.collectives.under_load
    assert comm_busy(one, CPU) == pytest.approx(comm_busy(one, fair))
    # while four ranks' collectives still move at their rate under load, beside the compute
    assert comm_busy(four, CPU) != pytest.approx(comm_busy(four, fair))


def gathers(g):
    return [op for op in g.ops if op.kind == "comm.all_gather"]


def test_two_ranks_collectives_through_shared_memory_share_the_cores_as_a_copy():
    """At 2 ranks every collective, of any size, is a shared-memory worker's copies and sums
    (runtime/dist/shm.py): a fair share, not gloo's waiting; at 4 ranks they go through gloo's
    TCP and keep ``comm_under_load``."""
    two, four = graph(ranks=2), graph(ranks=4)
    sizes = {collective_payload(two, op) for op in gathers(two)}
    assert min(sizes) < 1 << 20 <= max(sizes)        # small and large alike
    assert {under_load(two, op, CPU) for op in gathers(two)} == {0.0}
    assert {under_load(four, op, CPU) for op in gathers(four)} == {CPU.collectives.under_load}


def rated(g, op, machine):
    return op_duration(g, op, machine) - op_fixed(op, machine)


def unit_norms(g):
    norms = [op for op in g.ops if op.kind == "compute.norm" and op.unit is not None]
    assert norms
    return norms


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_bf16_norm_on_a_cpu_pays_its_upcast(ranks):
    """Each bf16 gradient a norm reads is copied into fp32 (its elements at 4 bytes) at the
    host's copy rate before the reduction its flops price; an fp32 one is reduced as it is."""
    g = graph(ranks, "bf16")
    for op in unit_norms(g):
        (grad,) = (g.buffers[n] for n in op.reads)
        assert grad.dtype == "bf16"
        upcast = grad.bytes // DTYPE_BYTES["bf16"] * 4 / CPU.copies.pcie_bandwidth
        assert rated(g, op, CPU) == pytest.approx(op.flops / CPU.compute.flops + upcast)
    g = graph(ranks, "fp32")
    for op in unit_norms(g):
        assert rated(g, op, CPU) == pytest.approx(op.flops / CPU.compute.flops)


def test_a_cuda_device_reduces_bf16_gradients_without_a_copy():
    g = graph(2, "bf16")
    for op in unit_norms(g):
        assert g.buffers[op.reads[0]].tier == "device"
        assert rated(g, op, GPU) == pytest.approx(op.flops / GPU.compute.flops)


def test_a_one_rank_schedule_shares_the_cores_the_profiles_ranks_divided():
    """Calibrate binds each of its ``disk_ranks`` ranks to its share of the node (``cores``); a
    schedule of one rank has all of them, so its lanes share ``cores x disk_ranks``, as a profile
    measured with one rank would say. Resolving the profile for the schedule twice is once."""
    measured_at_two = CPU.with_fields(disk_ranks=2)
    one = graph(ranks=1)
    node = for_graph(measured_at_two, one)
    assert node.costs.cores == 2.0 and for_graph(node, one) == node
    as_if_one = CPU.with_fields(cores=2.0, disk_ranks=1)
    assert simulate(one, measured_at_two).step_s == pytest.approx(simulate(one, as_if_one).step_s)
    assert simulate(one, measured_at_two).step_s < simulate(one, CPU.with_fields(disk_ranks=0)).step_s
    two = graph(ranks=2)
    assert for_graph(measured_at_two, two).costs.cores == 1.0
