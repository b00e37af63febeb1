"""calibrate's fits against the reference step (zdsl/planner/calibration_fit.py), torch-free."""
from __future__ import annotations

import pytest

from test_cost_model_knobs import CPU
from test_cost_model_knobs import graph
from zdsl.planner.calibration_fit import fit_overhead
from zdsl.planner.calibration_fit import lane_ops
from zdsl.planner.calibration_fit import scaled_latencies
from zdsl.sim.simulate import UNIT_COMPUTE_KINDS
from zdsl.sim.simulate import rated_duration
from zdsl.sim.simulate import simulate

TRUTH = CPU.with_fields(cores=0.0, comm_overhead=3e-4, scatter_overhead=3e-4)


def _measured(g):
    """The reference's lane ops and step as ``TRUTH`` runs them."""
    lane_op_s = {i: rated_duration(g, g.ops[i], TRUTH) + TRUTH.costs.op + g.ops[i].kernels * TRUTH.costs.kernel
                 for i in lane_ops(g)}
    return simulate(g, TRUTH).step_s, lane_op_s


def _fitted(profile, fit):
    return scaled_latencies(profile, fit.latency_scale).with_fields(op_overhead=fit.op,
                               kernel_overhead=fit.kernel, comm_overhead=fit.comm, scatter_overhead=fit.comm)


def test_latencies_measured_right_are_kept():
    g = graph(prefetch=1)
    step, lane_op_s = _measured(g)
    fit = fit_overhead(g, TRUTH.with_fields(comm_overhead=-1.0, scatter_overhead=-1.0), step, lane_op_s)
    assert fit.latency_scale == 1.0 and fit.comm == pytest.approx(3e-4, rel=1e-3)


def test_latencies_that_alone_overshoot_the_reference_are_scaled_until_it_matches():
    """A loaded host's loop of isolated calls measured every collective's latency 20 times what
    the step sees: as measured they alone predict the reference far slower than it ran. The fit
    scales them so the profile predicts its own reference (no cost per collective left)."""
    g = graph(prefetch=1)
    step, lane_op_s = _measured(g)
    inflated = scaled_latencies(TRUTH, 20.0).with_fields(comm_overhead=-1.0, scatter_overhead=-1.0)
    assert simulate(g, inflated.with_fields(comm_overhead=0.0, scatter_overhead=0.0)).step_s > 1.3 * step
    fit = fit_overhead(g, inflated, step, lane_op_s)
    assert fit.latency_scale < 1.0 and fit.comm == pytest.approx(0.0, abs=1e-9)
    assert simulate(g, _fitted(inflated, fit)).step_s == pytest.approx(step, rel=0.01)


def test_a_second_reference_shares_the_cost_per_collective_fitted_to_both():
    """calibrate's clipped and unclipped reference steps (``also``): where the model prices the
    second 10% short and the first right, the cost per collective fitted to both leaves the first
    over and the second under by ratios whose geometric mean is 1, with a larger cost than the
    first alone asks for."""
    first, second = graph(prefetch=1), graph(prefetch=0)
    step, lane_op_s = _measured(first)
    other = 1.1 * simulate(second, TRUTH).step_s
    start = TRUTH.with_fields(comm_overhead=-1.0, scatter_overhead=-1.0)
    alone = fit_overhead(first, start, step, lane_op_s)
    both = fit_overhead(first, start, step, lane_op_s, also=((second, other),))
    assert both.comm > alone.comm == pytest.approx(3e-4, rel=1e-3)
    over = simulate(first, _fitted(start, both)).step_s / step
    under = simulate(second, _fitted(start, both)).step_s / other
    assert over > 1.0 > under and over * under == pytest.approx(1.0, rel=1e-3)


def test_compute_excess_is_what_units_took_beyond_their_rate_and_fixed_costs():
    """Units whose CPU time was their rated time 25% longer plus the fixed costs the profile
    already charges them: the excess is 0.25 (the fixed costs not counted twice, the other
    compute ops ignored); units no slower than their rate give 0, never less."""
    from zdsl.planner.calibration_fit import compute_excess
    from zdsl.sim.simulate import op_fixed
    g = graph(prefetch=1)
    units = [i for i, op in enumerate(g.ops) if op.kind in UNIT_COMPUTE_KINDS and op.flops]
    assert len(units) >= 4
    others = {i: 1.0 for i, op in enumerate(g.ops) if op.kind.startswith("compute.") and i not in units}
    cpu = {i: 1.25 * rated_duration(g, g.ops[i], TRUTH) + op_fixed(g.ops[i], TRUTH) for i in units}
    assert compute_excess(g, TRUTH, {**cpu, **others}) == pytest.approx(0.25, rel=1e-9)
    # a profile that already carries an excess is measured against the bare rate all the same
    assert compute_excess(g, TRUTH.with_fields(compute_excess=0.4), cpu) == pytest.approx(0.25, rel=1e-9)
    at_rate = {i: rated_duration(g, g.ops[i], TRUTH) + op_fixed(g.ops[i], TRUTH) for i in units}
    assert compute_excess(g, TRUTH, at_rate) == pytest.approx(0.0, abs=1e-12)
    assert compute_excess(g, TRUTH, {i: 0.5 * rated_duration(g, g.ops[i], TRUTH) for i in units}) == 0.0


def test_compute_excess_lengthens_forwards_and_backwards_only():
    g = graph(prefetch=1)
    slower = TRUTH.with_fields(compute_excess=0.5)
    for op in g.ops:
        base = rated_duration(g, op, TRUTH)
        expected = 1.5 * base if op.kind in UNIT_COMPUTE_KINDS else base
        assert rated_duration(g, op, slower) == pytest.approx(expected, rel=1e-12)
    assert simulate(g, slower).step_s > simulate(g, TRUTH).step_s
