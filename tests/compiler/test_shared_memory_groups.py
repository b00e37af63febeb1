"""Which collectives the planner prices as shared memory's: those of every 2-rank group whose ranks
share a node, as the runtime serves them (runtime/dist/shm.py's ``pair_of``: any 2-rank gloo group
of one host), not only those of a 2-rank run. A shared-memory collective is a worker thread's
copies and sums: it takes its fair share of the cores (no ``comm_under_load``), and where every
collective goes through one the pair's worker runs them one at a time. By arithmetic over the
collectives of HSDP, MiCS and flat ZeRO-3 at 4 ranks."""
from __future__ import annotations

import pytest

from zdsl.driver import compile_schedule
from zdsl.model.units import gpt_units
from zdsl.schedule import MachineProfile, OptimizerSpec, Schedule, TrainSpec
from zdsl.sim.lanes import slots_of
from zdsl.sim.simulate import op_duration, through_shared_memory, under_load

UNITS = gpt_units(layers=2, width=64, heads=4, vocab=128, context=16)
# one core per rank, gloo's collectives at 2% of their rate while compute fills it
CPU = MachineProfile.of(name="cpu", flops=5e10, host_flops=5e10, link_bandwidth=2e9, link_latency=2e-4,
                        memory_bandwidth=3e10, op_overhead=1e-4, comm_overhead=3e-4, cores=1.0,
                        comm_under_load=0.02, comm_slots=2)
UNDER = 0.02


def graph(ranks: int, per_node: int | None = None, over: str = "all"):
    s = Schedule(name="pairs", ranks=ranks, per_node=per_node, stage=3,
                 shard_over={"optimizer": over, "gradients": over, "parameters": over},
                 train=TrainSpec(precision="fp32", batch=2), optimizer=OptimizerSpec(kind="adamw", clip=None))
    return compile_schedule(s, UNITS)


def collectives(g):
    ops = [op for op in g.ops if op.is_collective]
    assert ops
    return ops


def by_group(g) -> dict[str, set[bool]]:
    out: dict[str, set[bool]] = {}
    for op in collectives(g):
        out.setdefault(op.group, set()).add(through_shared_memory(g, op, on_host=True))
    return out


def test_hsdp_pairs_within_a_node_go_through_shared_memory_and_its_all_reduce_across_does_not():
    """4 ranks as 2 nodes of 2: gathers and reduce-scatters within the node's pair (shared memory),
    the all-reduce over the 2 replicas across the nodes (two hosts: the network)."""
    g = graph(4, per_node=2, over="node")
    assert by_group(g) == {"within:2": {True}, "across:2": {False}}
    for op in collectives(g):
        assert under_load(g, op, CPU) == (0.0 if op.group == "within:2" else UNDER)
    assert slots_of(g, CPU) == 2          # gloo's threads still run the all-reduces


def test_mics_pairs_on_one_node_go_through_shared_memory_one_at_a_time():
    """group(2) at 4 ranks on one node: both the pairs and their replicas are 2 ranks of one host."""
    g = graph(4, over="group(2)")
    assert by_group(g) == {"within:2": {True}, "across:2": {True}}
    assert {under_load(g, op, CPU) for op in collectives(g)} == {0.0}
    assert slots_of(g, CPU) == 1


def test_four_ranks_flat_go_through_gloo():
    g = graph(4)
    assert by_group(g) == {"all": {False}}
    assert {under_load(g, op, CPU) for op in collectives(g)} == {UNDER}
    assert slots_of(g, CPU) == 2


def test_a_pair_is_priced_alike_in_a_two_rank_run_and_within_a_four_rank_one():
    """HSDP's node gather at 4 ranks moves what flat ZeRO-3's gather at 2 ranks does (half a unit
    from each rank, a ring of 2): the same op time, and the same fair share of the cores."""
    pair_run, hsdp = graph(2), graph(4, per_node=2, over="node")
    first = [op for op in collectives(pair_run) if op.kind == "comm.all_gather"][0]
    same = next(op for op in collectives(hsdp) if op.kind == "comm.all_gather" and op.unit == first.unit
                and op.phase == first.phase)
    assert op_duration(hsdp, same, CPU) == pytest.approx(op_duration(pair_run, first, CPU))
    assert under_load(hsdp, same, CPU) == under_load(pair_run, first, CPU) == 0.0

