"""Planner: model-state bytes equal ZeRO's formulas, comm volume, the simulator, traces."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from work_count import growth
from zdsl.driver import compile_file
from zdsl.driver import compile_schedule
from zdsl.ir import Buffer
from zdsl.ir import Op
from zdsl.ir import TaskGraph
from zdsl.ir import UnitInfo
from zdsl.planner.comm import comm_plan
from zdsl.planner.comm import zero_comm_elements
from zdsl.sim.memory import model_states
from zdsl.sim.memory import zero_model_states
from zdsl.planner.report import build_plan
from zdsl.planner.report import render_plan
from zdsl.sim.simulate import op_duration
from zdsl.sim.simulate import simulate
from zdsl.schedule import MachineProfile
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Placement
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec
from zdsl.observe.trace import predicted_trace
from zdsl.observe.trace import read_trace
from zdsl.observe.trace import write_trace
from zdsl.model.units import gpt_units

ROOT = Path(__file__).resolve().parents[2]
UNITS = gpt_units(layers=3, width=63, heads=7, vocab=97, context=17)   # odd sizes: shards need padding
PSI = sum(u.numel for u in UNITS)


def schedule(stage=0, ranks=2, precision="fp32", optimizer="adamw", momentum=0.0, **kw) -> Schedule:
    return Schedule(name="t", ranks=ranks, stage=stage,
                    train=TrainSpec(precision=precision, batch=2, accumulate=kw.pop("accumulate", 1)),
                    optimizer=OptimizerSpec(kind=optimizer, momentum=momentum), **kw)


def compiled(s: Schedule, units=UNITS) -> TaskGraph:
    return compile_schedule(s, units)


def padded_psi(graph: TaskGraph) -> int:
    return sum(u.padded_numel for u in graph.units)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_match_zero_formulas(stage, precision, ranks):
    g = compiled(schedule(stage, ranks, precision))
    got = model_states(g)["device"]
    exact = zero_model_states(padded_psi(g), ranks, stage, precision, "adamw")
    assert got == {k: int(v) for k, v in exact.items()}
    # against the paper's Ψ: only padding (at most 16 bytes per padding element) separates them
    paper = zero_model_states(PSI, ranks, stage, precision, "adamw")
    assert padded_psi(g) > PSI   # the model was chosen so padding is exercised
    assert 0 <= sum(got.values()) - sum(paper.values()) <= 16 * (padded_psi(g) - PSI)
    assert model_states(g)["host"] == {"parameters": 0, "gradients": 0, "optimizer": 0}


def test_mixed_precision_adam_is_16_psi_over_n_at_stage_3():
    g = compiled(schedule(3, 4, "bf16"))
    assert sum(model_states(g)["device"].values()) == 16 * padded_psi(g) // 4


@pytest.mark.parametrize("precision,momentum,per_param", [
    ("fp32", 0.9, 4), ("bf16", 0.9, 8), ("fp32", 0.0, 0), ("bf16", 0.0, 4)])
def test_sgd_optimizer_bytes(precision, momentum, per_param):
    g = compiled(schedule(1, 2, precision, "sgd", momentum))
    assert model_states(g)["device"]["optimizer"] == per_param * padded_psi(g) // 2


def test_optimizer_offload_puts_optimizer_state_on_host():
    g = compiled(schedule(2, 2, "bf16", placement={"optimizer": Placement("cpu")}))
    states = model_states(g)
    assert states["host"]["optimizer"] == 12 * padded_psi(g) // 2
    assert states["device"]["optimizer"] == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_volume_is_2psi_or_3psi(stage, precision):
    g = compiled(schedule(stage, 4, precision))
    dtype = 4 if precision == "fp32" else 2
    c = comm_plan(g)
    norm = 4 * 2 * sum(op.kind == "comm.all_reduce" and op.unit is None for op in g.ops)  # grad-norm scalars
    assert c.payload_bytes - norm == zero_comm_elements(padded_psi(g), stage) * dtype
    assert c.bus_factor == 3 / 4 and c.wire_bytes == pytest.approx(c.payload_bytes * 0.75)


# -- the simulator on hand-built graphs ---------------------------------------------

def tiny_graph(ops: list[Op], buffers: list[Buffer], ranks=2) -> TaskGraph:
    units = [UnitInfo(0, "u0", 8, 8, 4)]
    return TaskGraph("hand", ranks, 3, "fp32", 1, units, {b.name: b for b in buffers}, ops)


def test_durations_follow_the_machine_profile():
    m = MachineProfile.of(flops=1e9, link_bandwidth=1e6, link_latency=0.5, pcie_bandwidth=2e6,
                          disk_read=4e6, disk_write=8e6, memory_bandwidth=1e3)
    bufs = [Buffer("param_full[0]", "param_full", 0, "device", 1000)]
    g = tiny_graph([], bufs, ranks=4)
    cases = [
        (Op(0, "compute.forward", "compute", 0, flops=2e9), 2.0),
        (Op(0, "comm.all_gather", "comm", 0, bytes=4e6), 0.5 + 4e6 * 3 / 4 / 1e6),
        (Op(0, "comm.reduce_scatter", "comm", 0, bytes=4e6), 0.5 + 4e6 * 3 / 4 / 1e6),
        (Op(0, "comm.all_reduce", "comm", 0, bytes=4e6), 2 * (0.5 + 4e6 * 3 / 4 / 1e6)),
        (Op(0, "copy.h2d", "h2d", 0, bytes=4e6), 2.0),
        (Op(0, "nvme.read", "nvme", 0, bytes=4e6), 1.0),
        (Op(0, "nvme.write", "nvme", 0, bytes=4e6), 0.5),
        (Op(0, "compute.step", "host", 0, bytes=3000), 3.0),
        (Op(0, "mem.free", "compute", 0, writes=["param_full[0]"]), 0.0),
    ]
    for op, want in cases:
        assert op_duration(g, op, m) == pytest.approx(want), op.kind
    m.costs.op = 0.25                 # a fixed cost per op the runtime runs; a free costs only the loop's
    for op, want in cases:
        assert op_duration(g, op, m) == pytest.approx(want + (op.kind != "mem.free") * 0.25), op.kind
    m.costs.comm = 0.0                # collectives' own fixed cost, apart from the lane ops'
    for op, want in cases:
        extra = 0.0 if op.kind == "mem.free" or op.kind.startswith("comm.") else 0.25
        assert op_duration(g, op, m) == pytest.approx(want + extra), op.kind
    m.costs.scatter = 0.125           # a reduce-scatter's own, apart from the other collectives'
    for op, want in cases:
        extra = (0.0 if op.kind == "mem.free" or op.kind.startswith("comm.") else 0.25) \
            + (0.125 if op.kind == "comm.reduce_scatter" else 0.0)
        assert op_duration(g, op, m) == pytest.approx(want + extra), op.kind
    m.costs.loop = 0.0625             # the event loop's CPU per op: a free's whole cost, nothing else's
    for op, want in cases:
        extra = (0.0625 if op.kind == "mem.free" else 0.0 if op.kind.startswith("comm.") else 0.25) \
            + (0.125 if op.kind == "comm.reduce_scatter" else 0.0)
        assert op_duration(g, op, m) == pytest.approx(want + extra), op.kind
    m.costs.kernel = 0.001            # and a compute op one per kernel it dispatches
    fwd = Op(0, "compute.forward", "compute", 0, flops=2e9, kernels=32)
    assert op_duration(g, fwd, m) == pytest.approx(2.0 + 0.25 + 0.032)
    m.disk.read_latency, m.disk.write_latency = 0.5, 0.0625   # and a disk transfer its own latency
    read, write = (Op(0, f"nvme.{k}", "nvme", 0, bytes=4e6) for k in ("read", "write"))
    assert op_duration(g, read, m) == pytest.approx(0.5 + 1.0 + 0.25)
    assert op_duration(g, write, m) == pytest.approx(0.0625 + 0.5 + 0.25)


def test_compute_ops_carry_their_units_kernels():
    """Forward and recompute: the unit's forward kernels; backward: its backward kernels (the
    GPT's, zdsl.model.units.GPT_KERNELS); no other op has any."""
    from zdsl.model.units import GPT_KERNELS
    from pathlib import Path
    from zdsl.driver import compile_file
    program = Path(__file__).resolve().parents[2] / "programs" / "pipelines.zs"    # recomputes its blocks
    graph = compile_file(str(program), {}, simulate=False).graph
    for op in graph.ops:
        name = graph.units[op.unit].name.split(".")[0] if op.unit is not None else None
        want = {"compute.forward": "fwd_kernels", "compute.recompute": "fwd_kernels",
                "compute.backward": "bwd_kernels"}.get(op.kind)
        assert op.kernels == (GPT_KERNELS[name][want] if want else 0), (op.kind, name)
    assert {op.kind for op in graph.ops} >= {"compute.forward", "compute.recompute", "compute.backward"}


def test_each_collective_and_the_host_step_have_their_own_rates_where_given():
    m = MachineProfile.of(link_bandwidth=1e6, link_latency=0.5, scatter_bandwidth=5e5, scatter_latency=0.25,
                          memory_bandwidth=1e3, host_memory_bandwidth=3e3)
    g = tiny_graph([], [], ranks=4)
    wire = 4e6 * 3 / 4
    gather = Op(0, "comm.all_gather", "comm", 0, bytes=4e6)
    scatter = Op(0, "comm.reduce_scatter", "comm", 0, bytes=4e6)
    reduce = Op(0, "comm.all_reduce", "comm", 0, bytes=4e6)
    assert op_duration(g, gather, m) == pytest.approx(0.5 + wire / 1e6)
    assert op_duration(g, scatter, m) == pytest.approx(0.25 + wire / 5e5)
    # no all-reduce rate given: a ring, this machine's reduce-scatter then its all-gather
    assert op_duration(g, reduce, m) == pytest.approx(0.25 + wire / 5e5 + 0.5 + wire / 1e6)
    m.collectives.node.reduce_bandwidth, m.collectives.node.reduce_latency = 2e6, 0.1
    assert op_duration(g, reduce, m) == pytest.approx(0.1 + wire / 2e6)
    # the optimizer step on the host lane at the host's rate; on the device lane at the device's
    assert op_duration(g, Op(0, "compute.step", "host", 0, bytes=3000), m) == pytest.approx(1.0)
    assert op_duration(g, Op(0, "compute.step", "compute", 0, bytes=3000), m) == pytest.approx(3.0)


def test_list_scheduling_overlaps_lanes_and_honours_deps():
    m = MachineProfile.of(flops=1.0, link_bandwidth=1.0, link_latency=0.0, comm_slots=1)   # a lane: one op at a time
    B = lambda n, k="param_full": Buffer(n, k, 0, "device", 10)  # noqa: E731
    bufs = [B("param_shard[0]", "param_shard"), B("param_full[0]"), B("param_full[1]"), B("act[0]", "act"),
            B("act[1]", "act")]
    bufs[0].persistent = True
    ops = [
        Op(0, "comm.all_gather", "comm", 0, reads=["param_shard[0]"], writes=["param_full[0]"], bytes=4),
        Op(1, "comm.all_gather", "comm", 1, reads=["param_shard[0]"], writes=["param_full[1]"], bytes=4),
        Op(2, "compute.forward", "compute", 0, reads=["param_full[0]"], writes=["act[0]"], flops=3, deps=[0]),
        Op(3, "compute.forward", "compute", 1, reads=["param_full[1]", "act[0]"], writes=["act[1]"], flops=3,
           deps=[1, 2]),
        Op(4, "mem.free", "comm", 0, writes=["param_full[0]"], deps=[2]),
    ]
    sim = simulate(tiny_graph(ops, bufs), m)
    # gathers take 2 s each (4 bytes, bus factor 1/2); forward 0 waits for gather 0
    assert list(sim.start) == [0, 2, 2, 5, 5]
    assert list(sim.end) == [2, 4, 5, 8, 5]
    assert sim.step_s == 8
    assert sim.lane_busy == {"compute": 6, "comm": 4}
    assert sim.critical_path == [0, 2, 3]
    assert sim.bound_s == 8    # dependency chain 2 + 3 + 3
    # memory: param_full[0] lives 0..5, param_full[1] 2.., act[0] 2.., act[1] from 5 (reusing param_full[0])
    dev = sim.memory.tiers["device"]
    assert dev.working_peak == 30 and dev.model_states == 10


def gloo_bytes(seconds: float) -> float:
    """Full-tensor bytes a collective of 3 ranks moves in ``seconds`` at 1 B/s (2/3 of them). The
    hand graphs of gloo's threads are of 3 ranks: 2 cpu ranks' collectives go through shared
    memory, one at a time (zdsl.sim.lanes.slots_of)."""
    return seconds * 3 / 2


def _gathers(first_s: float, wait_for_compute: float = 0.0):
    """Three all-gathers on the comm lane of 3 ranks (the first ``first_s`` long, the others 2 s)
    and, with ``wait_for_compute``, a forward of that many seconds the second gather must wait for."""
    B = lambda n, k="param_full": Buffer(n, k, 0, "device", 10)  # noqa: E731
    bufs = [B("param_shard[0]", "param_shard"), *(B(f"param_full[{u}]") for u in range(3)), B("act[0]", "act")]
    bufs[0].persistent = True
    gather = lambda i, u, nbytes, deps=(): Op(i, "comm.all_gather", "comm", u, reads=["param_shard[0]"],  # noqa: E731
                                              writes=[f"param_full[{u}]"], bytes=nbytes, deps=list(deps))
    ops = [Op(0, "compute.forward", "compute", 0, writes=["act[0]"], flops=wait_for_compute),
           gather(1, 0, gloo_bytes(first_s)), gather(2, 1, gloo_bytes(2), deps=[0] if wait_for_compute else []),
           gather(3, 2, gloo_bytes(2))]
    return tiny_graph(ops, bufs, ranks=3)


@pytest.mark.parametrize("slots, cores, want_start, want_end", [
    (1, 0, [0, 2, 4], [2, 4, 6]),      # one at a time, as NCCL's stream runs them
    (2, 0, [0, 0, 2], [2, 2, 4]),      # gloo's two threads: the third starts when one is free
    (2, 1, [0, 0, 4], [4, 4, 6]),      # ... but on one core the two running share it
])
def test_a_backend_with_two_threads_runs_two_collectives_at_once(slots, cores, want_start, want_end):
    m = MachineProfile.of(flops=1.0, link_bandwidth=1.0, link_latency=0.0, comm_slots=slots, cores=cores)
    sim = simulate(_gathers(2.0), m)
    assert sim.start[1:] == pytest.approx(want_start) and sim.end[1:] == pytest.approx(want_end)


@pytest.mark.parametrize("cores", [0, 1])
def test_collectives_start_in_issue_order_and_a_short_one_frees_its_thread_first(cores):
    m = MachineProfile.of(flops=1.0, link_bandwidth=1.0, link_latency=0.0, comm_slots=2, cores=cores)
    # a 6 s gather beside a 2 s one: the third takes the thread the short one leaves at 2
    sim = simulate(_gathers(6.0), m)
    if cores == 0:
        assert sim.start[1:] == pytest.approx([0, 0, 2]) and sim.end[1:] == pytest.approx([6, 2, 4])
        assert sim.critical_path == [1]                   # the long gather ends the step
        three = simulate(_gathers(1.0), m)                # the third waited for the first gather's end
        assert three.critical_path == [1, 3]
    # the second gather waits for a 5 s forward; the third, issued behind it, may not overtake it
    sim = simulate(_gathers(1.0, wait_for_compute=5.0), m)
    assert sim.start[2] == pytest.approx(sim.end[0]) and sim.start[3] >= sim.start[2]


def _two_lane_ops():
    """A 2 s gather of 3 ranks (gloo's) beside a 3 s forward that does not need it, then a forward that does."""
    B = lambda n, k="param_full": Buffer(n, k, 0, "device", 10)  # noqa: E731
    bufs = [B("param_shard[0]", "param_shard"), B("param_full[0]"), B("act[0]", "act"), B("act[1]", "act")]
    bufs[0].persistent = True
    ops = [
        Op(0, "comm.all_gather", "comm", 0, reads=["param_shard[0]"], writes=["param_full[0]"],
           bytes=gloo_bytes(2)),
        Op(1, "compute.forward", "compute", 0, reads=[], writes=["act[0]"], flops=3),
        Op(2, "compute.forward", "compute", 1, reads=["param_full[0]", "act[0]"], writes=["act[1]"], flops=3,
           deps=[0, 1]),
    ]
    return tiny_graph(ops, bufs, ranks=3)


@pytest.mark.parametrize("name,cores,want_end", [
    ("cpu", 0, [2, 3, 6]),        # no sharing model: lanes independent
    ("cpu", 1, [4, 5, 8]),        # one core: both at half rate until the gather ends at 4; forward 0 then alone
    ("cpu", 2, [3, 4, 7]),        # demand 2 + 1 on 2 cores: both at 2/3 rate until 3
    ("cpu", 8, [2.25, 3.25, 6.25]),  # 8 compute threads and gloo's on 8 cores: both at 8/9 until 2.25
    ("cuda", 1, [2, 3, 6]),       # GPU compute and NCCL need no host core
])
def test_lanes_share_the_ranks_cores(name, cores, want_end):
    m = MachineProfile.of(name=name, flops=1.0, link_bandwidth=1.0, link_latency=0.0, cores=cores)
    sim = simulate(_two_lane_ops(), m)
    assert sim.end == pytest.approx(want_end)
    assert sim.step_s == pytest.approx(want_end[-1])
    assert sim.critical_path == [1, 2]   # the forward that ended last made the second one wait


@pytest.mark.parametrize("under, overhead, want_end", [
    (0.25, 0.0, [4.25, 3, 7.25]),  # the gather moves at 1/4 while forward 0 fills the core (3 s: 0.75
                                   # of its 2 s), the rest alone; forward 0 is not slowed
    (1.0, 0.0, [2, 3, 6]),        # unaffected by the load: independent lanes
    (0.25, 1.0, [6.25, 5, 10.25]),  # its 1 s fixed cost (the host's work of issuing it) shares the core
                                    # with forward 0's: both end at 2; then its transfer moves at 1/4
                                    # beside forward 0's 3 s of work (0.75 of 2 by 5), the rest alone
])
def test_a_collectives_transfer_under_load_takes_no_share_and_moves_at_its_own_rate(under, overhead, want_end):
    m = MachineProfile.of(flops=1.0, link_bandwidth=1.0, link_latency=0.0, cores=1, comm_under_load=under,
                          op_overhead=overhead)
    sim = simulate(_two_lane_ops(), m)
    assert sim.end == pytest.approx(want_end)
    m.name = "cuda"               # cpu machines only: on cuda the host work (fixed costs) is shared as before
    assert simulate(_two_lane_ops(), m).end == pytest.approx([4, 5, 9] if overhead else [2, 3, 6])


def test_a_free_costs_the_loops_cpu_per_op_and_takes_its_share_of_the_core():
    """A free is the event loop's work alone (``loop_overhead``): on one core it slows the forward
    running beside it; with lanes independent it only takes its own time."""
    bufs = [Buffer("param_full[0]", "param_full", 0, "device", 10), Buffer("act[0]", "act", 0, "device", 10)]
    ops = [Op(0, "compute.forward", "compute", 0, reads=[], writes=["act[0]"], flops=3),
           Op(1, "mem.free", "comm", 0, writes=["param_full[0]"])]
    m = MachineProfile.of(flops=1.0, cores=1, loop_overhead=1.0)
    assert simulate(tiny_graph(ops, bufs), m).end == pytest.approx([4, 2])   # both at 1/2 until the free ends
    assert simulate(tiny_graph(ops, bufs), m.with_fields(cores=0)).end == pytest.approx([3, 1])
    assert simulate(tiny_graph(ops, bufs), m.with_fields(loop_overhead=0.0)).end == pytest.approx([3, 0])


def _beside_a_transfer(kind: str, other: str):
    """A 1 s disk transfer (``kind``) beside a 1 s op on another lane (``other``: a forward or a
    gather), neither needing the other."""
    B = lambda n, k: Buffer(n, k, 0, "device", 10)  # noqa: E731
    bufs = [B("param_shard[0]", "param_shard"), B("param_full[0]", "param_full"), B("act[0]", "act"),
            B("optim[0]", "optim"), B("optim_host[0]", "optim")]
    bufs[0].persistent = True
    ops = [Op(0, kind, "nvme", 0, reads=["optim[0]"], writes=["optim_host[0]"], bytes=1),
           Op(1, "compute.forward", "compute", 0, writes=["act[0]"], flops=1) if other == "forward" else
           Op(1, "comm.all_gather", "comm", 0, reads=["param_shard[0]"], writes=["param_full[0]"],
              bytes=gloo_bytes(1))]
    return tiny_graph(ops, bufs, ranks=3)


@pytest.mark.parametrize("kind", ["nvme.read", "nvme.write"])
def test_a_disk_transfer_shares_one_core_and_takes_its_share_of_more_first(kind):
    """On one core a transfer shares it fairly with the forward beside it: calibrate's share 1/3
    (compute beside it took 1.5x) is half a core, 1.5 cores of demand on 1, so both move at 2/3
    of their rate and end at 1.5 s (on one core a transfer beside compute is slowed too: calibrate
    measures by how much, ``disk_*_cpu``). On two its threads wake first: it keeps its rate and the
    forward gets what is left (1.5 of 2 cores for 1 s, then alone: ends at 1.25)."""
    m = MachineProfile.of(flops=1.0, disk_read=1.0, disk_write=1.0, cores=1, disk_read_cpu=1 / 3, disk_write_cpu=1 / 3)
    assert simulate(_beside_a_transfer(kind, "forward"), m).end == pytest.approx([1.5, 1.5])
    m.costs.cores, m.disk.read_cpu, m.disk.write_cpu = 2, 0.5, 0.5
    assert simulate(_beside_a_transfer(kind, "forward"), m).end == pytest.approx([1.0, 1.25])
    m.costs.cores = 1
    m.disk.read_cpu = m.disk.write_cpu = 0.0           # no host work: independent
    assert simulate(_beside_a_transfer(kind, "forward"), m).end == pytest.approx([1.0, 1.0])
    m.costs.cores = None                                     # no sharing model
    m.disk.read_cpu = m.disk.write_cpu = 0.5
    assert simulate(_beside_a_transfer(kind, "forward"), m).end == pytest.approx([1.0, 1.0])


def test_a_collective_under_load_moves_in_what_the_others_leave():
    """Beside a write holding 0.75 of the core (calibrate's share 3/7: compute beside it took
    1.75x), a gather of 3 ranks (gloo's: 1 s) moves at 0.25 for 1 s and alone after it:
    ends at 1.75; beside a write that holds all of it, at its ``comm_under_load`` share 0.1
    (1 s: 0.1 done, 0.9 alone)."""
    m = MachineProfile.of(disk_write=1.0, link_bandwidth=1.0, link_latency=0.0, cores=1, comm_under_load=0.1,
                          disk_write_cpu=3 / 7)
    assert simulate(_beside_a_transfer("nvme.write", "gather"), m).end == pytest.approx([1.0, 1.75])
    m.disk.write_cpu = 1.0
    assert simulate(_beside_a_transfer("nvme.write", "gather"), m).end == pytest.approx([1.0, 1.9])


def test_the_fixed_cost_per_op_is_host_work_shared_like_the_rest():
    # each op first does its 1 s of dispatch on one thread, then its rated work; one core for all
    m = MachineProfile.of(flops=1.0, link_bandwidth=1.0, link_latency=0.0, cores=1, op_overhead=1.0)
    sim = simulate(_two_lane_ops(), m)
    # both dispatch at half rate 0..2; both work at half rate 2..6 (gather done); forward 0's last
    # second alone 6..7; forward 1 alone: 1 s dispatch and 3 s work, 7..11
    assert sim.end == pytest.approx([6, 7, 11])
    m.costs.comm = 0.0       # collectives without the fixed cost: the gather works from 0 at half rate
    sim = simulate(_two_lane_ops(), m)
    # gather 0..? at half rate beside forward 0's dispatch (0..2) and work: gather done at 4;
    # forward 0: dispatch 0..2, work 2..4 at half (1 s done), 4..6 alone; forward 1: 6..7, 7..10
    assert sim.end == pytest.approx([4, 6, 10])


def test_sharing_without_host_work_matches_independent_lanes_on_a_program():
    g = compiled(schedule(3, 2, "fp32", prefetch=2))
    free = simulate(g, MachineProfile.of(name="cuda"))
    shared = simulate(g, MachineProfile.of(name="cuda", cores=1.0))   # the event loop, nothing competing
    assert shared.start == pytest.approx(free.start) and shared.end == pytest.approx(free.end)
    assert shared.critical_path == free.critical_path
    free = simulate(g, MachineProfile())
    tight = simulate(g, MachineProfile.of(cores=1.0))
    assert tight.step_s > free.step_s     # gathers overlap compute there: sharing one core costs time


def test_deeper_prefetch_costs_device_memory():
    base = dict(stage=3, ranks=2, precision="bf16")
    peaks = [simulate(compiled(schedule(**base, prefetch=k))).memory.tiers["device"].working_peak
             for k in (1, 3)]
    assert peaks[1] > peaks[0]


def test_simulating_1000_units_is_linear_work():
    """Counted in Python lines run, not seconds (benchmarks/compile_speed.py times it)."""
    graphs = {layers: compiled(schedule(3, 8, "bf16", prefetch=2),
                               gpt_units(layers=layers, width=64, heads=4, vocab=96, context=16))
              for layers in (248, 998)}
    assert len(graphs[998].units) == 1000 and simulate(graphs[998]).step_s > 0
    assert growth(lambda layers: lambda: simulate(graphs[layers]), 248, 998) < 1.5   # quadratic: ~4


# -- the context a run trains on --------------------------------------------------------

def gpt_file(tmp_path, model_context: int, data_context: int | None) -> str:
    path = tmp_path / f"gpt{model_context}-{data_context}.zs"
    data = "" if data_context is None else f"data synthetic(context={data_context})\n"
    path.write_text(f"model gpt(layers=2, width=64, heads=4, vocab=256, context={model_context})\n"
                    f"{data}train batch=4\nranks 2 on cpu\nzero 3\n")
    return str(path)


def test_the_run_context_is_the_datas_else_the_models(tmp_path):
    from zdsl.check.checker import load_schedule
    from zdsl.compile.models import run_context
    assert run_context(load_schedule(gpt_file(tmp_path, 1024, 16))[0]) == 16
    assert run_context(load_schedule(gpt_file(tmp_path, 48, None))[0]) == 48
    assert run_context(load_schedule(gpt_file(tmp_path, 48, 48))[0]) == 48


def test_the_plan_sizes_activations_and_compute_by_the_data_context(tmp_path):
    """A GPT's context only sizes its position table: with data context 16 a model of context 1024
    runs (and is planned) like one of context 16, apart from the table's parameters."""
    def plan_of(model_context):
        c = compile_file(gpt_file(tmp_path, model_context, 16), None)
        assert c.ok, [d.message for d in c.diagnostics]
        return c, build_plan(c.graph, c.schedule, c.sim)
    (long, long_plan), (short, short_plan) = plan_of(1024), plan_of(16)
    flops = lambda c: [(op.kind, op.flops) for op in c.graph.ops                         # noqa: E731
                       if op.kind in ("compute.forward", "compute.backward")]
    activations = lambda c: {b.name: b.bytes for b in c.graph.buffers.values()          # noqa: E731
                             if b.kind.startswith("act")}
    assert flops(long) == flops(short) and activations(long) == activations(short)
    assert len(activations(long)) >= 4 and sum(f for _, f in flops(long)) > 0
    tables = [p.sim.memory.to_json()["device"]["working_at_peak"]["activations"]
              for p in (long_plan, short_plan)]
    assert tables[0] == tables[1] > 0
    assert long_plan.parameters - short_plan.parameters == (1024 - 16) * 64     # wpe only
    # the step differs only by the larger table's communication, not by a 64x longer sequence
    assert long_plan.sim.step_s < 1.5 * short_plan.sim.step_s


def test_a_user_model_is_sized_at_the_data_context():
    pytest.importorskip("torch")
    from zdsl.runtime.sizing import units_for_user_model
    program = str(ROOT / "programs" / "user_model.zs")
    for context in (8, 32):
        c = compile_file(program, {"data.context": str(context)}, simulate=False)
        assert c.ok, [d.message for d in c.diagnostics]
        assert c.units == units_for_user_model(c.schedule.model, context)
    assert c.units[1].input_elems_per_seq == 32 * 64      # hidden=64 per token


def test_plan_json_and_table():
    s = schedule(3, 2, "bf16", memory={"device": 1 << 40})
    plan = build_plan(compiled(s), s)
    data = plan.to_json()
    for key in ("ranks", "parameters", "units", "memory", "comm_bytes_per_step", "predicted_step_s", "lanes"):
        assert key in data
    assert data["parameters"] == PSI and data["units"] == len(UNITS) and data["ranks"] == 2
    dev = data["memory"]["device"]
    assert set(dev["model_states"]) == {"parameters", "gradients", "optimizer"} and dev["budget"] == 1 << 40
    assert data["lanes"]["compute"] > 0
    json.dumps(data)
    text = render_plan(plan)
    assert "memory per rank" in text and "ZeRO formula" in text and "predicted step" in text


# -- traces ---------------------------------------------------------------------------

def test_predicted_trace_has_ranks_lanes_flows_and_counters(tmp_path):
    g = compiled(schedule(3, 2, "bf16"))
    sim = simulate(g)
    trace = predicted_trace(g, sim)
    ev = trace["traceEvents"]
    assert {e["pid"] for e in ev if e["ph"] == "X"} == {0, 1}
    lanes = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "comm"} <= lanes
    assert any(e["ph"] == "s" for e in ev) and any(e["ph"] == "f" for e in ev)
    counters = [e for e in ev if e["ph"] == "C"]
    assert counters and all(e["name"].startswith("memory.") and "bytes" in e["args"] for e in counters)
    path = tmp_path / "t.json"
    write_trace(path, trace)
    spans, cs = read_trace(path)
    assert len(spans) == 2 * len(g.ops)
    rank0 = sorted((s for s in spans if s.rank == 0), key=lambda s: s.op)
    assert [s.op for s in rank0] == [op.id for op in g.ops]
    assert [s.end_s for s in rank0] == pytest.approx(sim.end)
    assert max(c.values["bytes"] for c in cs if c.name == "memory.device") == sim.memory.tiers["device"].peak


def test_predicted_trace_draws_as_a_timeline(tmp_path):
    from zdsl.observe.timeline import render_timeline
    g = compiled(schedule(3, 2, "bf16"))
    out = render_timeline(predicted_trace(g, simulate(g)), tmp_path / "t.svg")
    assert (tmp_path / "t.svg").read_text().startswith("<svg") or "svg" in open(out).read(200)


def _prediction_error():
    """benchmarks/prediction_error.py as a module (benchmarks/ is not a package)."""
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "prediction_error.py"
    spec = importlib.util.spec_from_file_location("prediction_error", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_drift_correction_leaves_the_disk_as_measured():
    """benchmarks/prediction_error.py's correction: a program without disk I/O predicted exactly
    ``drift`` times slower; the NVMe program less, its transfers keeping their calibrated rates."""
    root = Path(__file__).resolve().parents[2]
    bench = _prediction_error()
    machine = ("cpu(flops=5e10, link=1e9, latency=2e-4, disk_read=6e8, disk_write=1.2e9, disk_read_latency=1e-4, "
               "disk_read_cpu=0.3, disk_write_cpu=0.6, overhead=2e-4, kernel_overhead=8e-6, comm_overhead=6e-4, "
               "cores=1, comm_under_load=0.02)")
    steps = {}
    for name in ("zero3", "nvme"):
        compiled = compile_file(str(root / "programs" / f"{name}.zs"), {"machine": machine}, simulate=True)
        steps[name] = compiled.sim.step_s, bench.drifted_step(compiled.graph, 1.3)
    assert steps["zero3"][1] == pytest.approx(1.3 * steps["zero3"][0], rel=1e-9)
    assert steps["nvme"][0] < steps["nvme"][1] < 1.3 * steps["nvme"][0] * (1 - 1e-3)


def test_prediction_error_calls_a_round_quiet_only_where_the_reference_held_the_calibrated_step(tmp_path):
    """benchmarks/prediction_error.py's quiet round: every run of the reference beside the
    programs within 10% of the step the round's calibration measured, read off its profile."""
    bench = _prediction_error()
    profile = tmp_path / "m.zs"
    profile.write_text("#               run by the executor: measured 20.5 ms a step, of which its lane ops 10.5 ms\n"
                       "machine cpu(flops=5e10)\n")
    assert bench.reference_seconds(str(profile)) == pytest.approx(0.0205)
    (tmp_path / "none.zs").write_text("machine cpu(flops=5e10)\n")
    assert bench.reference_seconds(str(tmp_path / "none.zs")) is None
    assert bench.is_quiet(bench.steadiness([0.020], [0.019, 0.0215, 0.020]))
    assert not bench.is_quiet(bench.steadiness([0.020], [0.019, 0.0235]))       # one run 17.5% slower
    assert not bench.is_quiet(bench.steadiness([0.020], [0.0175, 0.020]))       # one 12.5% faster
    assert not bench.is_quiet(bench.steadiness([], [0.020]))                    # --machine: nothing to judge
    rows = [{"program": "a", "predicted_runs_s": [0.020, 0.020, 0.020], "runs_s": [0.025, 0.019, 0.021],
             "quiet_runs": [False, True, True]},
            {"program": "b", "predicted_runs_s": [0.020], "runs_s": [0.030], "quiet_runs": [False]}]
    held = bench.quiet_errors(rows)                  # the slow run (-20%) beside a moved reference left out
    assert set(held) == {"a"} and held["a"] == pytest.approx((0.020 / 0.019 + 0.020 / 0.021) / 2 - 1)


def test_prediction_error_plans_with_the_profile_zdsl_plan_uses_where_calibrate_kept_the_cached_one(
        tmp_path, monkeypatch):
    """A round whose calibration measured the reference off the machine's usual step (calibrate
    kept the cached profile) is planned as `zdsl plan` would plan it then: with the cached profile,
    its quiet control judged against the reference step that profile was fitted to. Told apart by
    what calibrate wrote: its --out file and the cache, each as calibrate itself writes them."""
    import dataclasses

    from zdsl.runtime.calibrate.cli import Calibration, cache_profile
    bench = _prediction_error()
    monkeypatch.setenv("ZDSL_CALIBRATE", "1")
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path))
    out = tmp_path / "m.zs"
    usual = Calibration(MachineProfile().with_fields(flops=5e10), {"reference": (2, 0.0168)})
    fast = Calibration(MachineProfile().with_fields(flops=7e10),
                       {"reference": (2, 0.012), "usual_reference_s": 0.0168, "off_usual": True})
    out.write_text(fast.to_zs())
    measured = bench.machine_statement(str(out))
    assert bench.kept_cached(measured) is None                                 # nothing cached yet
    cache_profile(usual)
    cache_profile(fast)                                                        # off the usual: not cached
    kept = bench.kept_cached(measured)
    assert kept == (usual.machine_statement().removeprefix("machine "), 0.0168)
    cache_profile(dataclasses.replace(fast, details={"reference": (2, 0.012)}))    # cached
    assert bench.kept_cached(measured) is None
