"""The cost model moves with ``prefetch`` and ``bucket`` the way a run does.

Each test is a reasoned example on a fixed machine profile: what a knob changes in the
step (collectives called, gathers left in the open, memory held), the term of the model that
prices it, and the direction and least size of the change that term implies. Dropping the
term (a per-call cost of 0, lanes that run one collective at a time, no hop between lanes)
fails them.
"""
from __future__ import annotations

import pytest

from zdsl.model.units import gpt_units
from zdsl.driver import compile_schedule
from zdsl.ir import Buffer
from zdsl.ir import Op
from zdsl.ir import TaskGraph
from zdsl.ir import UnitInfo
from zdsl.planner.calibration_fit import wake_delays
from zdsl.planner.comm import comm_plan
from zdsl.sim.simulate import collective_seconds
from zdsl.sim.simulate import simulate
from zdsl.schedule import MachineProfile
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec

MiB = 1 << 20

# Width 256: a block's parameters are 3 MiB in fp32, so a 1 MiB bucket cuts each block's
# gather and reduce-scatter into 4 calls (programs/zero3.zs's blocks, 0.2 MiB, are not cut).
UNITS = gpt_units(layers=3, width=256, heads=4, vocab=256, context=32)

# A calibrated 2-core CPU as `zdsl calibrate` writes it: one core a rank, gloo's two threads.
CPU = MachineProfile.of(name="cpu", flops=7e10, host_flops=7e10, link_bandwidth=2e9, link_latency=2e-4,
                        scatter_bandwidth=2e9, scatter_latency=1.5e-4, reduce_bandwidth=1.3e9,
                        reduce_latency=1.2e-4, memory_bandwidth=5e10, op_overhead=1e-4, kernel_overhead=5e-6,
                        comm_overhead=3e-4, scatter_overhead=7e-4, cores=1.0, comm_slots=2, comm_under_load=0.02)
# A GPU whose link is slow beside its compute (a block's gather, 1.6 ms, takes 8 times its forward).
GPU = MachineProfile.of(name="cuda", flops=1e12, link_bandwidth=1e9, link_latency=1e-5, memory_bandwidth=1e11,
                        comm_slots=1)
# The same with a link fast enough that a gather (0.1 ms) hides behind the compute before it.
FAST_GPU = GPU.with_fields(link_bandwidth=2e10)


def graph(prefetch: int = 1, bucket: int = 0, ranks: int = 2):
    s = Schedule(name="knobs", ranks=ranks, stage=3, prefetch=prefetch, bucket_bytes=bucket,
                 train=TrainSpec(precision="fp32", batch=4), optimizer=OptimizerSpec(kind="adamw"))
    return compile_schedule(s, UNITS)


def per_call(machine: MachineProfile) -> float:
    """What one more gather costs beyond its bytes: its latency and the runtime's cost per collective."""
    return machine.collectives.node.latency + (machine.costs.comm or 0.0)


@pytest.mark.parametrize("machine", [CPU, CPU.with_fields(cores=0.0)], ids=["shared-core", "free-lanes"])
def test_a_bucket_that_cuts_units_costs_each_extra_call_its_fixed_cost(machine):
    """1 MiB buckets turn 15 collectives into 42 moving the same bytes. Each extra call pays
    the collective's latency and the runtime's cost per collective (0.5 ms here) on the
    collectives lane, the busiest one at this size; gloo runs two at once, so the step grows by
    at least half of extra calls x per-call cost. With no per-call cost it would not grow so."""
    whole, cut = graph(bucket=0), graph(bucket=1 * MiB)
    extra = comm_plan(cut).collectives - comm_plan(whole).collectives
    assert comm_plan(cut).payload_bytes == comm_plan(whole).payload_bytes and extra >= 20
    grown = simulate(cut, machine).step_s - simulate(whole, machine).step_s
    assert grown >= 0.5 * extra * per_call(machine) / machine.collectives.slots


def test_a_small_message_achieves_less_of_the_link_than_a_large_one():
    """The profile's curve by size: ``latency + bytes / link``, so a 64 KiB part moves at under
    half the bandwidth a 4 MiB gather achieves on this profile."""
    achieved = {n: n / collective_seconds("comm.all_gather", n, CPU.collectives.node) for n in (64 << 10, 4 * MiB)}
    assert achieved[64 << 10] < 0.5 * achieved[4 * MiB]


def hideable_and_gain(machine, ranks: int = 2) -> tuple[float, float]:
    """The gathers' time a prefetch could hide (all but the first of each pass) at prefetch 0,
    and the step time prefetch 1 saves."""
    g0, g1 = graph(prefetch=0, ranks=ranks), graph(prefetch=1, ranks=ranks)
    sim0, sim1 = simulate(g0, machine), simulate(g1, machine)
    gathers = sorted((d for op, d in zip(g0.ops, sim0.duration) if op.kind == "comm.all_gather"), reverse=True)
    return sum(gathers[2:]), sim0.step_s - sim1.step_s


@pytest.mark.parametrize("machine,ranks", [(FAST_GPU, 2), (CPU, 4), (CPU.with_fields(cores=0.0), 2)],
                         ids=["gpu", "shared-core", "free-lanes"])
def test_prefetching_one_unit_hides_gathers_that_prefetch_0_waits_for(machine, ranks):
    """At prefetch 0 a unit's gather is issued when the unit before it is done and its compute
    waits for it: every gather is on the critical path. Prefetch 1 issues it a unit earlier,
    behind that unit's compute, which is longer than the gather on these profiles. So the step
    shrinks by a good part of the gathers' time (all but the first unit's, forward and
    backward; on a shared core a gloo gather beside compute moves slowly, hence only a part)."""
    hideable, gain = hideable_and_gain(machine, ranks)
    assert gain >= 0.3 * hideable


def test_prefetch_hides_little_of_two_ranks_gathers_through_shared_memory_on_one_core():
    """2 ranks' gathers of these blocks (3 MiB) go through shared memory: a worker thread's
    copies on the rank's one core, which compute beside them cannot leave free, so a gather
    issued a unit earlier still takes its time from the compute, and a run's step barely moves
    from prefetch 0 to 1."""
    hideable, gain = hideable_and_gain(CPU)
    assert gain < 0.3 * hideable
    gloo_hideable, gloo_gain = hideable_and_gain(CPU, ranks=4)
    assert gain < 0.5 * gloo_gain


def test_deeper_prefetch_holds_more_and_gains_nothing_where_one_stream_runs_the_gathers():
    """With one collective at a time (NCCL's one stream) and gathers slower than the compute
    they hide behind, the link is the bottleneck at prefetch 1 already: a deeper prefetch holds
    more gathered parameters at once and gives no time back."""
    one, two = simulate(graph(prefetch=1), GPU), simulate(graph(prefetch=2), GPU)
    assert two.step_s == pytest.approx(one.step_s, rel=0.01)
    assert two.memory.tiers["device"].working_peak > one.memory.tiers["device"].working_peak


def test_deeper_prefetch_gains_where_the_backend_runs_two_gathers_at_once():
    """gloo runs two collectives at once (``comm_slots=2``): with two units' gathers in flight
    the slow link serves both, so a prefetch of 2 beats 1 when gathers are slower than the
    compute. One thread (``comm_slots=1``) takes that gain away."""
    two_threads = GPU.with_fields(comm_slots=2)
    p1, p2 = (simulate(graph(prefetch=k), two_threads).step_s for k in (1, 2))
    assert p2 < p1
    gain_with_two = p1 - p2
    p1, p2 = (simulate(graph(prefetch=k), GPU).step_s for k in (1, 2))
    assert gain_with_two > (p1 - p2) + 1e-5


def _gather_then_forward(gather_s: float):
    """A gather of ``gather_s`` seconds on the comm lane beside a 3 s forward, then a forward
    that needs both (its own lane's input and the other lane's)."""
    def buf(name, kind="param_full"):
        return Buffer(name, kind, 0, "device", 10, persistent=kind == "param_shard")
    bufs = [buf("param_shard[0]", "param_shard"), buf("param_full[0]"), buf("act[0]", "act"), buf("act[1]", "act")]
    ops = [Op(0, "comm.all_gather", "comm", 0, reads=["param_shard[0]"], writes=["param_full[0]"],
              bytes=int(2 * gather_s)),      # 2 ranks: half of it on the wire, at 1 B/s
           Op(1, "compute.forward", "compute", 0, writes=["act[0]"], flops=3),
           Op(2, "compute.forward", "compute", 1, reads=["param_full[0]", "act[0]"], writes=["act[1]"], flops=3,
              deps=[0, 1])]
    return TaskGraph("hand", 2, 3, "fp32", 1, [UnitInfo(0, "u0", 8, 8, 4)], {b.name: b for b in bufs}, ops)


@pytest.mark.parametrize("cores", [0.0, 1.0], ids=["independent-lanes", "event-loop"])
@pytest.mark.parametrize("gather_s, want_start", [(5.0, 5.5), (2.0, 3.0)])
def test_an_op_waits_the_wake_after_an_input_from_another_lane_only(cores, gather_s, want_start):
    """The second forward starts 0.5 s (``wake``) after the gather it waited for (5 s); where its
    own lane's forward (3 s) ends after the gather (2 s), it starts at once, as a lane's thread
    runs its ready ops back to back."""
    m = MachineProfile.of(name="cuda", flops=1.0, link_bandwidth=1.0, link_latency=0.0, cores=cores, comm_slots=1,
                          wake_latency=0.5)
    sim = simulate(_gather_then_forward(gather_s), m)
    assert sim.start[2] == pytest.approx(want_start)
    assert sim.critical_path[-1] == 2 and sim.critical_path[0] == (0 if gather_s > 3 else 1)


@pytest.mark.parametrize("machine", [FAST_GPU, CPU, CPU.with_fields(cores=0.0)],
                         ids=["gpu", "shared-core", "free-lanes"])
def test_prefetch_0_pays_a_hop_between_lanes_for_every_gather(machine):
    """At prefetch 0 each gather waits for the free after the compute before it (a hop from the
    compute lane to the collectives lane) and its unit's compute waits for the gather (a hop
    back), both on the critical path; at prefetch 1 the gathers are ready before their compute
    and a lane's thread runs on. So with a hop of ``wake`` seconds, prefetch 0's gap over
    prefetch 1 grows by at least one hop per gather, counted at half."""
    g0, g1 = graph(prefetch=0), graph(prefetch=1)
    gathers = sum(op.kind == "comm.all_gather" for op in g0.ops)

    def gap(m):
        return simulate(g0, m).step_s - simulate(g1, m).step_s
    wake = 5e-4
    assert gap(machine.with_fields(wake_latency=wake)) - gap(machine) >= 0.5 * gathers * wake


def test_calibrate_measures_the_hop_only_where_another_lanes_input_held_an_op_back():
    """``wake`` is measured, not fitted: in the reference's steps, how long each op started after
    the input from another lane that held it back. An op its own lane held back (the forward
    before it ended last) says nothing about the hop."""
    from types import SimpleNamespace as Record
    g = _gather_then_forward(5.0)

    def record(*times):
        return Record(timings=[Record(start=s, end=e) for s, e in times])
    assert wake_delays(g, record((0.0, 5.0), (0.0, 3.0), (5.3, 8.3))) == pytest.approx([0.3])
    assert wake_delays(g, record((0.0, 2.0), (0.0, 3.0), (3.01, 6.01))) == []


def test_the_collective_cost_fitted_beside_a_measured_wake_is_what_the_hops_leave():
    """calibrate sets ``wake`` from the reference's hops before it fits the cost per collective to
    the step, so the fit returns the collective's own cost, not the hops folded into it."""
    from zdsl.planner.calibration_fit import fit_overhead
    from zdsl.planner.calibration_fit import lane_ops
    from zdsl.sim.simulate import rated_duration
    g = graph(prefetch=1)
    truth = CPU.with_fields(cores=0.0, wake_latency=2e-4, comm_overhead=4e-4, scatter_overhead=4e-4)
    lane_op_s = {i: rated_duration(g, g.ops[i], truth) + truth.costs.op + g.ops[i].kernels * truth.costs.kernel
                 for i in lane_ops(g)}
    fit = fit_overhead(g, truth.with_fields(comm_overhead=-1.0, scatter_overhead=-1.0),
                       simulate(g, truth).step_s, lane_op_s)
    assert fit.comm == pytest.approx(4e-4, rel=1e-3)
    folded = fit_overhead(g, truth.with_fields(comm_overhead=-1.0, scatter_overhead=-1.0, wake_latency=0.0),
                          simulate(g, truth).step_s, lane_op_s)
    assert folded.comm > fit.comm            # without the measured hop, the collectives carry it


def test_the_collective_cost_fitted_beside_the_loops_cost_per_op_is_what_the_frees_leave():
    """calibrate measures ``loop`` (the event loop's CPU per op, a free's whole cost) before it fits
    the cost per collective, so the frees' cost is not folded into the collectives'."""
    from zdsl.planner.calibration_fit import fit_overhead
    from zdsl.planner.calibration_fit import lane_ops
    from zdsl.sim.simulate import rated_duration
    g = graph(prefetch=1)
    assert sum(op.kind == "mem.free" for op in g.ops) > 0
    truth = CPU.with_fields(cores=0.0, loop_overhead=1e-4, comm_overhead=4e-4, scatter_overhead=4e-4)
    lane_op_s = {i: rated_duration(g, g.ops[i], truth) + truth.costs.op + g.ops[i].kernels * truth.costs.kernel
                 for i in lane_ops(g)}
    step_s = simulate(g, truth).step_s
    assert step_s > simulate(g, truth.with_fields(loop_overhead=0.0)).step_s    # the frees cost time
    fit = fit_overhead(g, truth.with_fields(comm_overhead=-1.0, scatter_overhead=-1.0), step_s, lane_op_s)
    assert fit.comm == pytest.approx(4e-4, rel=1e-3)
    folded = fit_overhead(g, truth.with_fields(comm_overhead=-1.0, scatter_overhead=-1.0, loop_overhead=0.0),
                          step_s, lane_op_s)
    assert folded.comm > fit.comm            # with frees at no cost, the collectives carry theirs
