"""Overlap figures on hand-made graphs whose answers are worked out by hand."""
from functools import partial

import pytest
from work_count import growth

from zdsl.ir import Op

from zdsl.ir import TaskGraph
from zdsl.observe.overlap import analyze
from zdsl.observe.overlap import summarize
from zdsl.observe.overlap import times_from_trace
from zdsl.observe.overlap import typical


def graph_of(ops, ranks=2):
    """Ranks: 2 (cpu: collectives through shared memory, one at a time), or more (gloo's threads)."""
    return TaskGraph(schedule="t", ranks=ranks, stage=3, precision="fp32", accumulate=1,
                     units=[], buffers={}, ops=ops)


def op(i, kind, lane, unit=None, deps=()):
    return Op(id=i, kind=kind, lane=lane, unit=unit, deps=list(deps))


# Two gathers feed two forwards; a reduce-scatter waits on the second forward
# after a 0.5 s gap; a third forward needs nothing; a free has no time.
#
#   comm    |ag0|ag1|       ..|--rs--|
#   compute     |-fwd0-|-fwd1-|fwd2|
#           0   1   2   3   4   5  5.5  7
GRAPH = graph_of([
    op(0, "comm.all_gather", "comm", 0),
    op(1, "compute.forward", "compute", 0, deps=[0]),
    op(2, "comm.all_gather", "comm", 1),
    op(3, "compute.forward", "compute", 1, deps=[2]),
    op(4, "comm.reduce_scatter", "comm", 1, deps=[3]),
    op(5, "compute.forward", "compute", 2),
    op(6, "mem.free", "compute", 0, deps=[1]),
])
TIMES = {0: (0.0, 1.0), 1: (1.0, 3.0), 2: (1.0, 2.0), 3: (3.0, 5.0),
         4: (5.5, 7.0), 5: (5.0, 6.0)}


def test_known_answer():
    r = analyze(GRAPH, TIMES, rank=0)
    assert r.step_time == pytest.approx(7.0)
    assert r.lane_busy == pytest.approx({"comm": 3.5, "compute": 5.0})
    assert r.lane_share["compute"] == pytest.approx(5.0 / 7.0)
    assert r.busiest_lane == "compute"
    assert r.dep_chain == pytest.approx(4.5)          # ag1 -> fwd1 -> rs
    assert r.critical_length == pytest.approx(6.5)    # ag0 -> fwd0 -> fwd1 -> rs (lane order)
    assert r.critical_path == [0, 1, 3, 4]
    assert r.critical_by_kind == pytest.approx(
        {"comm.all_gather": 1.0, "compute.forward": 4.0, "comm.reduce_scatter": 1.5})
    assert r.lower_bound == pytest.approx(5.0)        # the compute lane
    assert r.efficiency == pytest.approx(5.0 / 7.0)
    text = r.format(GRAPH)
    assert "efficiency 0.71" in text and "set by lane compute" in text
    assert "comm.all_gather[0] -> compute.forward[0]" in text
    m = r.to_metrics()
    assert m["critical_path_ops"] == 4 and m["overlap_efficiency"] == pytest.approx(5 / 7)


@pytest.mark.parametrize("slots, own_second, queued", [(1, 1.0, 1), (2, 3.0, 0)])
def test_a_collective_queued_behind_another_runs_at_once_where_the_backend_has_two_threads(
        slots, own_second, queued):
    # two gathers issued together at 0 (ends 2 and 3), a forward that needs the second
    g = graph_of([op(0, "comm.all_gather", "comm", 0), op(1, "comm.all_gather", "comm", 1),
                  op(2, "compute.forward", "compute", 1, deps=[1])], ranks=4)
    g.config = {"machine": {"comm_slots": slots}}
    r = analyze(g, {0: (0.0, 2.0), 1: (0.0, 3.0), 2: (3.0, 4.0)})
    # one thread: the second's own time starts when the first ends; two: it ran from its issue
    assert r.dep_chain == pytest.approx(own_second + 1.0)
    assert r.lane_busy["comm"] == pytest.approx(3.0)
    assert sum("issued before" in n for n in r.notes) == queued


def test_dependency_chain_bounds_a_serial_graph():
    # A chain alternating lanes: nothing can overlap, the chain is the bound.
    g = graph_of([op(i, "comm.all_gather" if i % 2 == 0 else "compute.forward",
                     "comm" if i % 2 == 0 else "compute", i, deps=[i - 1] if i else [])
                  for i in range(4)])
    times = [(float(i), float(i + 1)) for i in range(4)]          # list form
    r = analyze(g, times, step_time=5.0)                           # 1 s lost outside ops
    assert r.dep_chain == pytest.approx(4.0)
    assert r.lower_bound == pytest.approx(4.0)
    assert r.efficiency == pytest.approx(0.8)
    assert "dependency chain" in r.format()


def test_summary_takes_the_slowest_rank():
    r0 = analyze(GRAPH, TIMES, rank=0)
    r1 = analyze(GRAPH, {k: (s, e * 1.1) for k, (s, e) in TIMES.items()}, rank=1)
    s = summarize([r0, r1])
    assert s["slowest_rank"] == 1 and s["ranks"] == 2
    assert s["overlap_efficiency"] == pytest.approx(max(r0.lower_bound, r1.lower_bound) / r1.step_time)


def test_times_from_trace_picks_rank_and_last_step():
    ev = [{"ph": "X", "name": "fwd", "pid": 0, "tid": 1, "ts": 1000.0 + 1e6 * s, "dur": 500.0,
           "args": {"op": 1, "step": s}} for s in range(3)]
    ev.append({"ph": "X", "name": "ag", "pid": 0, "tid": 2, "ts": 2e6 + 500.0, "dur": 250.0,
               "args": {"op": 0, "step": 2}})
    ev.append({"ph": "X", "name": "ag", "pid": 1, "tid": 2, "ts": 0.0, "dur": 9.0, "args": {"op": 0}})
    t = times_from_trace({"traceEvents": ev}, rank=0)
    assert t[0] == pytest.approx((0.0, 0.00025)) and t[1] == pytest.approx((0.0005, 0.001))
    assert times_from_trace(ev, rank=0, step=0) == {1: pytest.approx((0.0, 0.0005))}


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="ends before it starts"):
        analyze(GRAPH, {0: (1.0, 0.0)})
    cyclic = graph_of([op(0, "compute.forward", "compute", deps=[1]),
                       op(1, "comm.all_gather", "comm", deps=[0])])
    with pytest.raises(ValueError, match="cycle"):
        analyze(cyclic, {})


def chain_of(n):
    """``n`` ops on four lanes, each needing the op before it and the one three back."""
    lanes = ("compute", "comm", "h2d", "nvme")
    g = graph_of([op(i, "compute.forward", lanes[i % 4], deps=[i - 1, i - 3] if i >= 3 else [])
                  for i in range(n)])
    return g, [(i * 1e-3, i * 1e-3 + 2e-3) for i in range(n)]


def test_fifty_thousand_ops_and_work_linear_in_them():
    r = analyze(*chain_of(50_000))
    assert r.ops == 50_000 and 0 < r.efficiency <= 1.0
    # the work (Python lines run, not seconds: a deterministic count) grows as the ops do
    assert growth(lambda n: partial(analyze, *chain_of(n)), 5_000, 20_000) < 1.2     # 1.00 here; quadratic: 4


def test_typical_is_the_median_step():
    reports = [analyze(GRAPH, {k: (s * f, e * f) for k, (s, e) in TIMES.items()}) for f in (3.0, 1.0, 1.2)]
    assert typical(reports).step_time == pytest.approx(7.0 * 1.2)
    assert typical([]) is None


def test_async_ops_queued_in_a_lane_count_from_their_turn():
    # Two collectives issued together at t=0 on a backend that runs one at a time (NCCL's
    # stream); the second completes at 2 after waiting for the first.
    g = graph_of([op(0, "comm.all_gather", "comm", 0), op(1, "comm.all_gather", "comm", 1),
                  op(2, "compute.forward", "compute", 1, deps=[1])])
    g.config = {"machine": {"comm_slots": 1}}
    r = analyze(g, {0: (0.0, 1.0), 1: (0.0, 2.0), 2: (2.0, 3.0)})
    assert r.lane_busy["comm"] == pytest.approx(2.0)
    assert r.critical_length == pytest.approx(3.0)        # not 1 + 2 + 1: the queue is not work
    assert r.dep_chain == pytest.approx(2.0)              # ag1's own 1 s, then the forward
    assert r.critical_length <= r.step_time
    assert any("queue" in n for n in r.notes)


def simulate(n_ops: int, slots: int, seed: int):
    """A random graph and times as an executor would measure them: an op starts after its deps end;
    a compute or copy lane runs one op at a time; the comm lane issues in order and runs up to
    ``slots`` at once (each op waits until the ``slots``-th latest earlier end)."""
    import random
    rnd = random.Random(seed)
    lanes = ("compute", "comm", "h2d")
    ops, times = [], {}
    lane_free = {lane: 0.0 for lane in lanes}
    comm_ends: list[float] = []
    for i in range(n_ops):
        lane = rnd.choice(lanes + ("comm",) * 3)        # mostly collectives, as in ZeRO-3
        deps = sorted(rnd.sample(range(i), min(i, rnd.randint(0, 2))))
        kind = "comm.all_gather" if lane == "comm" else "compute.forward"
        ops.append(op(i, kind, lane, deps=deps))
        ready = max([times[d][1] for d in deps], default=0.0) + rnd.uniform(0, 0.3)   # dispatch delay
        length = rnd.uniform(0.1, 2.0)
        if lane == "comm":
            issued = max(ready, lane_free["comm"])           # issued in lane order, not yet run
            lane_free["comm"] = issued
            latest = sorted(comm_ends)[-slots:]
            runs = max(issued, latest[0]) if len(latest) >= slots else issued
            times[i] = (issued, runs + length)
            comm_ends.append(runs + length)
        else:
            start = max(ready, lane_free[lane])
            times[i] = (start, start + length)
            lane_free[lane] = start + length
    g = graph_of(ops, ranks=4)
    g.config = {"machine": {"comm_slots": slots}}
    return g, times


@pytest.mark.parametrize("slots", [1, 2])
def test_a_lower_bound_never_exceeds_the_critical_path_nor_the_step(slots):
    """The summary shows the bound beside the critical path and the step: it may never exceed them.
    (A comm lane of two threads once counted its overlapping collectives' busy time as a bound.)"""
    for seed in range(200):
        g, times = simulate(40, slots, seed)
        r = analyze(g, times, step_time=max(e for _, e in times.values()) + 0.5)
        assert r.dep_chain <= r.lower_bound + 1e-9
        assert r.lower_bound <= r.critical_length + 1e-9, (seed, r.bound_by)
        assert r.critical_length <= r.step_time + 1e-9
        assert r.efficiency <= 1.0


def test_a_lane_of_two_threads_bounds_nothing_by_its_busy_time():
    # two gathers run side by side on gloo's two threads for 3 s: busy 3 s, but either alone is 2 s
    g = graph_of([op(0, "comm.all_gather", "comm", 0), op(1, "comm.all_gather", "comm", 1)], ranks=4)
    g.config = {"machine": {"comm_slots": 2}}
    r = analyze(g, {0: (0.0, 2.0), 1: (1.0, 3.0)})
    assert r.lane_busy["comm"] == pytest.approx(3.0)
    assert r.lower_bound == pytest.approx(2.0) and r.bound_by == "dependency chain"
    assert r.critical_length == pytest.approx(2.0)
    g.config = {"machine": {"comm_slots": 1}}              # one at a time: the second's own 1 s follows
    r = analyze(g, {0: (0.0, 2.0), 1: (1.0, 3.0)})
    assert r.lower_bound == pytest.approx(3.0) and r.bound_by == "lane comm"


@pytest.mark.parametrize("ranks, name, want", [(2, "cpu", 1), (4, "cpu", 2), (2, "cuda", 2)])
def test_two_cpu_ranks_run_their_collectives_one_at_a_time(ranks, name, want):
    """2 cpu ranks' collectives go through their pair's shared memory, one worker thread, whatever
    gloo's thread count (``comm_slots``); more ranks, or another device, keep the profile's."""
    from zdsl.sim.lanes import comm_slots
    g = graph_of([op(0, "comm.all_gather", "comm", 0)], ranks=ranks)
    g.config = {"machine": {"comm_slots": 2, "name": name}}
    assert comm_slots(g) == want
