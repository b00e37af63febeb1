"""The fits that invert the simulator: from measured times to a machine profile's rates and costs.

``zdsl calibrate`` (runtime/calibrate/) measures; this is the arithmetic on what it measured:
latency and bandwidth from transfer times, the fixed cost per op, per kernel and per collective
that make the simulated reference step match the measured one, and the rate a collective keeps
while compute fills the cores. Torch-free.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from zdsl.machine_profile import MachineProfile
from zdsl.sim.lanes import BackendThreads, union_length
from zdsl.sim.simulate import UNIT_COMPUTE_KINDS, op_fixed, rated_duration, simulate


def fit_latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``t = latency + x / bandwidth`` to (x bytes, t seconds), minimising relative error.

    Relative weights keep the small sizes (which carry the latency) from
    being drowned by the large ones (which carry the bandwidth).
    """
    if len(points) < 2:
        x, t = points[0]
        return 0.0, x / t
    intercept, slope = least_squares_line(points, [1.0 / (t * t) for _, t in points])
    if slope <= 0:                                   # noise: bandwidth from the largest size alone
        x, t = max(points)
        return min(t for _, t in points), x / t
    return max(intercept, 1e-6), 1.0 / slope


@dataclass
class OverheadFit:
    """The fixed costs per op that make the reference's prediction match its measurement."""
    op: float                   # seconds per op run in a lane's thread (compute, copy, I/O)
    comm: float                 # seconds per collective (< 0: not fitted apart, ``op`` applies)
    bare_s: float               # the predicted step with no fixed cost at all
    scatter: float = -1.0       # seconds per reduce-scatter (< 0: ``comm`` applies)
    kernel: float = 0.0         # seconds per kernel a compute op dispatches
    under_load: float = 0.0     # a collective's rate while compute fills the cores (0: fair share)
    latency_scale: float = 1.0  # < 1: the collectives' latencies, scaled so (see :func:`latency_scale`)


LATENCY_FIELDS = ("link_latency", "scatter_latency", "reduce_latency")


def scaled_latencies(profile: MachineProfile, scale: float) -> MachineProfile:
    """``profile`` with each collective's latency times ``scale`` (at least 1 us, as fitted)."""
    return profile.with_fields(**{f: max(1e-6, profile.value(f) * scale) for f in LATENCY_FIELDS
                                  if profile.value(f) is not None and profile.value(f) > 0})


def lane_ops(graph) -> list[int]:
    """Positions of the ops a lane's thread runs (not collectives, not frees)."""
    return [i for i, op in enumerate(graph.ops) if op.kind != "mem.free" and not op.kind.startswith("comm.")]


def comm_ops(graph) -> list[int]:
    """Positions of the collectives."""
    return [i for i, op in enumerate(graph.ops) if op.kind.startswith("comm.")]


def comm_intervals(graph, record, slots: int = 1) -> dict[int, tuple[float, float]]:
    """Each collective's service interval in one measured step: from when it was issued, or when
    the backend had a thread free for it if that was later, to its end. The runtime issues a
    lane's collectives without waiting; the backend runs ``slots`` at once, in issue order (gloo:
    two threads), so one issued behind others starts when the ``slots``-th latest end before it
    has passed. The planner runs a lane's collectives the same way (``comm_slots``), so this is
    the measured time comparable to its duration."""
    intervals: dict[int, tuple[float, float]] = {}
    lanes: dict[str, BackendThreads] = {}
    for i in comm_ops(graph):
        t = record.timings[i]
        start, _ = lanes.setdefault(graph.ops[i].lane, BackendThreads(slots)).take(t.start, t.end)
        intervals[i] = (start, t.end)
    return intervals


def wake_delays(graph, record) -> list[float]:
    """Seconds each op of one measured step started after its input made on another lane ended,
    for the ops that such an input held back (it ended after the op's lane was free): what the
    runtime's hop from one lane to another costs (``wake_latency``). Every op counts, frees
    too: a free on the collectives lane waits for a compute op the same way a gather does."""
    ops, times = graph.ops, record.timings
    lane_free: dict[str, float] = {}         # when the lane could take its next op
    out = []
    for op in ops:
        free = lane_free.get(op.lane, 0.0)
        # a collective is issued and left to the backend: the lane goes on at its issue
        lane_free[op.lane] = times[op.id].start if op.kind.startswith("comm.") else times[op.id].end
        inputs = [times[d].end for d in op.deps if ops[d].lane != op.lane]
        mine = [times[d].end for d in op.deps if ops[d].lane == op.lane]
        if inputs and max(inputs) > max([free, *mine]):
            out.append(max(0.0, times[op.id].start - max(inputs)))
    return out


def comm_under_compute(graph, record, intervals: dict[int, tuple[float, float]]) -> dict[int, float]:
    """Seconds of each collective's service interval (:func:`comm_intervals`) during which a
    compute op ran on the rank (the cores were full: what ``comm_under_load`` is fitted on)."""
    compute = [(record.timings[i].start, record.timings[i].end)
               for i, op in enumerate(graph.ops) if op.kind.startswith("compute.")]
    return {i: union_length([(max(s, cs), min(e, ce)) for cs, ce in compute if cs < e and ce > s])
            for i, (s, e) in intervals.items()}


def fit_overhead(graph, profile: MachineProfile, measured_s: float,
                 lane_op_s: dict[int, float] | None = None,
                 comm_service_s: dict[int, float] | None = None,
                 comm_loaded_s: dict[int, float] | None = None,
                 also: tuple[tuple[object, float], ...] = ()) -> OverheadFit:
    """Fixed costs per op that make ``graph``'s (the reference step's) prediction equal ``measured_s``.

    With ``also`` (more (graph, measured seconds) pairs: the same model stepped another way), the
    cost fitted to the steps (per collective, or per op without lane times) makes the predictions'
    geometric mean ratio to their measurements 1 instead: one reference's structure priced right
    can leave another's wrong, and the programs a profile plans have either (clipped and unclipped
    steps; ``benchmarks/prediction_error.py`` measures the programs against their plans).

    With ``lane_op_s`` (the measured seconds of each lane op of the reference, by position)
    and collectives in the graph, the cost per lane op and per kernel come from what each lane
    op took beyond its rated time (:func:`lane_costs`), and the cost per collective is then the
    one that makes the step match. Without it,
    one cost for every op makes the step match. Each prediction grows with its cost: bisection.
    The profile's ``wake_latency`` (measured by calibrate: :func:`wake_delays`) and
    ``loop_overhead`` (what a free costs) are in every prediction made here, so the cost per
    collective is what the hops between lanes and the frees leave.

    With ``comm_service_s`` (each collective's measured service time, :func:`comm_intervals`) a
    reduce-scatter costs what it took beyond its rated time more than the other collectives did
    (the medians' difference): its reduction runs on the backend's threads, on the cores the
    backward it overlaps is using, which its isolated rate does not see.

    Where the collectives' latencies alone (with each lane op's measured cost and no cost per
    collective) already predict the reference slower than it ran, they are scaled down until
    they do not (``latency_scale``): on a host loaded by other processes the isolated loop of
    calls waits for a core on every call, many times a quiet call's latency, while in the step
    those waits overlap the other lanes' work; a profile that predicts its own reference slow
    would put every program that far off.
    """
    bare = simulate(graph, profile.with_fields(op_overhead=0.0, comm_overhead=None, kernel_overhead=0.0,
                                               wake_latency=0.0, loop_overhead=0.0)).step_s
    has_comm = any(op.kind.startswith("comm.") for op in graph.ops)

    def bisect(key, fixed: dict | None = None) -> float:
        """The x that makes the step match; ``key`` names the field x sets, or maps x to fields."""
        fields = key if callable(key) else (lambda x: {**(fixed or {}), key: x})

        def step(x: float) -> float:
            """The reference's predicted step, scaled by the other steps' errors (their geometric mean)."""
            p = profile.with_fields(**fields(x))
            ratios = [simulate(g, p).step_s / sec for g, sec in ((graph, measured_s), *also)]
            return measured_s * math.prod(ratios) ** (1.0 / len(ratios))
        lo, hi = 0.0, max(measured_s, 1e-6)
        if step(lo) >= measured_s:
            return 0.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step(mid) < measured_s else (lo, mid)
        return (lo + hi) / 2

    if not lane_op_s or not has_comm:
        return OverheadFit(bisect("op_overhead", {"comm_overhead": None}), -1.0, bare)
    op_cost, kernel_cost = lane_costs(graph, profile, lane_op_s)

    def with_lane_costs(p: MachineProfile) -> tuple[MachineProfile, dict[int, float]]:
        """``p`` with the lane ops' costs and the collectives' rate under load, and the service
        times left once the wait for a core is taken out."""
        under = 0.0
        service = dict(comm_service_s or {})
        if comm_loaded_s and p.costs.shared_cores > 0 and p.name == "cpu":
            under = rate_under_load(graph, p, service, comm_loaded_s)
            service = {i: sec - (1.0 - under) * comm_loaded_s.get(i, 0.0) for i, sec in service.items()}
        return p.with_fields(op_overhead=op_cost, kernel_overhead=kernel_cost, comm_under_load=under), service

    def floor(scale: float) -> float:
        p, _ = with_lane_costs(scaled_latencies(profile, scale))
        return simulate(graph, p.with_fields(comm_overhead=0.0, scatter_overhead=0.0)).step_s
    scale = 1.0
    if floor(1.0) > measured_s:
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if floor(mid) <= measured_s else (lo, mid)
        scale = lo
    profile, service = with_lane_costs(scaled_latencies(profile, scale))
    under = profile.collectives.under_load or 0.0
    extra = scatter_extra(graph, profile, service)
    if extra is None:
        return OverheadFit(op_cost, bisect("comm_overhead", {}), bare, kernel=kernel_cost, under_load=under,
                           latency_scale=scale)
    comm = bisect(lambda x: {"comm_overhead": x, "scatter_overhead": max(0.0, x + extra)})
    if comm == 0.0:             # the extra alone overshoots the step: the reduce-scatter's cost is fitted instead
        scatter = bisect("scatter_overhead", {"comm_overhead": 0.0})
        return OverheadFit(op_cost, 0.0, bare, scatter, kernel_cost, under, scale)
    return OverheadFit(op_cost, comm, bare, max(0.0, comm + extra), kernel_cost, under, scale)


# A collective that took 50x its rate under load is waiting, not moving: the floor of the fit.
MIN_UNDER_LOAD = 0.02


def rate_under_load(graph, profile: MachineProfile, service_s: dict[int, float],
                    loaded_s: dict[int, float]) -> float:
    """The share of its rate a collective keeps while compute fills the rank's cores.

    A collective needs ``W`` seconds of progress (rated time plus a fixed cost); it makes them at
    rate 1 while the cores are free and at ``a`` while compute runs beside it (``loaded`` of its
    ``service`` seconds), so ``service - rated = cost + (1 - a) x loaded``: the least-squares
    slope over the reference's collectives gives ``a``. 1 (no effect) without a rising line."""
    points = [(loaded_s.get(i, 0.0), sec - rated_duration(graph, graph.ops[i], profile))
              for i, sec in service_s.items()]
    _, slope = least_squares_line(points)
    return min(1.0, max(MIN_UNDER_LOAD, 1.0 - slope))


def least_squares_line(points: list[tuple[float, float]],
                       weights: list[float] | None = None) -> tuple[float, float]:
    """(intercept, slope) of the (weighted) least-squares line through (x, y) points; slope 0
    (and the mean) where the x do not vary."""
    w = weights or [1.0] * len(points)
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    var = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
    slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points)) / var if var > 0 else 0.0
    return my - slope * mx, slope


def lane_costs(graph, profile: MachineProfile, lane_op_s: dict[int, float]) -> tuple[float, float]:
    """(seconds per lane op, seconds per kernel of a compute op) from the measured lane ops: the
    least-squares line through each op's time beyond its rated time against the kernels it
    dispatches (``op.kernels``; 0 for a step or a copy): in the executor a kernel costs more than
    in a bare forward+backward (the runtime's saved-tensor hooks, a core shared with the
    collectives' threads), so it is fitted here, not taken from the compute test. Without two kernel counts to
    draw a line through, or with a line that falls, the median excess per op and no kernel cost;
    a line that would start below 0 goes through the origin."""
    points = [(graph.ops[i].kernels, sec - rated_duration(graph, graph.ops[i], profile))
              for i, sec in lane_op_s.items()]
    if not points:
        return 0.0, 0.0
    intercept, slope = least_squares_line(points)
    if slope <= 0:
        return max(0.0, statistics.median(y for _, y in points)), 0.0
    if intercept < 0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return intercept, slope


def compute_excess(graph, profile: MachineProfile, compute_cpu_s: dict[int, float]) -> float:
    """How much longer than its rated time a unit's forward or backward takes in the runtime, as a
    share of it (``compute_excess``, at least 0): over the compute ops of ``graph`` (a reference
    whose units' compute outweighs their kernels' costs), their CPU time in their thread less the
    fixed costs the profile already charges them (``op_overhead`` and ``kernel_overhead``, fitted on
    the small reference), against their rated time."""
    bare = profile.with_fields(compute_excess=0.0)
    rated = extra = 0.0
    for i, sec in compute_cpu_s.items():
        op = graph.ops[i]
        if op.kind in UNIT_COMPUTE_KINDS and op.flops:
            r = rated_duration(graph, op, bare)
            rated += r
            extra += sec - r - op_fixed(op, bare)
    return max(0.0, extra / rated) if rated > 0 else 0.0


def scatter_extra(graph, profile: MachineProfile, comm_service_s: dict[int, float]) -> float | None:
    """Seconds a reduce-scatter took beyond its rated time more than the other collectives did
    (median against median), or None without both kinds measured."""
    scatter: list[float] = []
    other: list[float] = []
    for i, sec in comm_service_s.items():
        op = graph.ops[i]
        (scatter if op.kind == "comm.reduce_scatter" else other).append(sec - rated_duration(graph, op, profile))
    if not scatter or not other:
        return None
    return statistics.median(scatter) - statistics.median(other)
