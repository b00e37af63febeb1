"""programs/nvme.zs's disk transfers share each rank's core with the compute beside them: the
CPU they need (disk_read_cpu, disk_write_cpu) slows them as it slows the compute."""
import os

import pytest

from zdsl.driver import compile_file
from zdsl.sim.simulate import machine_of
from zdsl.sim.simulate import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a profile of this host's shape (2 ranks, a core each), its figures rounded from a quick calibration
MACHINE = ("cpu(flops=7.5e10, host_flops=7.5e10, link=2e9, latency=8e-5, scatter_link=2e9, scatter_latency=1.5e-4, "
           "pcie=1.1e10, disk_read=6.5e8, disk_write=2e9, disk_read_latency=2e-5, disk_write_latency=5e-5, "
           "disk_read_cpu=0.2, disk_write_cpu=0.45, memory_bw=2e10, overhead=1.1e-4, kernel_overhead=6e-6, "
           "comm_overhead=3.5e-4, cores=1, comm_slots=2, comm_under_load=0.02, wake=1.1e-4, disk_ranks=2)")


@pytest.fixture(scope="module")
def nvme():
    compiled = compile_file(os.path.join(ROOT, "programs", "nvme.zs"), {"machine": MACHINE}, simulate=False)
    if not compiled.ok:
        pytest.skip("programs/nvme.zs does not compile here")
    return compiled.graph


def lane_seconds(sim, graph, kind: str) -> float:
    return sum(d for op, d in zip(graph.ops, sim.duration) if op.kind == kind)


def test_transfers_beside_compute_take_longer_as_their_cpu_grows(nvme):
    """With no CPU for the transfers they move at the disk's rates whatever runs beside them;
    with the calibrated CPU they share the core with the forward and backward they overlap,
    so the reads and writes take longer, the compute too, and the step (the nvme lane's) with
    them. (A transfer that took its share first kept its rate: the nvme lane's seconds did
    not move, and nvme.zs was planned 11-22% under its measured step in every quiet round.)"""
    machine = machine_of(nvme)
    free = simulate(nvme, machine.with_fields(disk_read_cpu=0.0, disk_write_cpu=0.0))
    busy = simulate(nvme, machine)
    for kind in ("nvme.read", "nvme.write", "compute.backward"):
        assert lane_seconds(busy, nvme, kind) > 1.05 * lane_seconds(free, nvme, kind), kind
    assert busy.step_s > 1.05 * free.step_s
    heavier = simulate(nvme, machine.with_fields(disk_write_cpu=0.6))
    assert lane_seconds(heavier, nvme, "nvme.write") > lane_seconds(busy, nvme, "nvme.write")
    assert heavier.step_s > busy.step_s
