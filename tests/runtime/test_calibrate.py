"""`zdsl calibrate --quick` measures 2 ranks and writes a profile the checker accepts."""
import os
import re

import pytest

from zdsl.planner.calibration_fit import MIN_UNDER_LOAD, fit_latency_bandwidth, fit_overhead
from zdsl.runtime.calibrate.cli import ZS_KEYS, Calibration, main
from zdsl.runtime.calibrate.reference import reference_graph
from zdsl.machine_profile import MACHINE_NOT_MEASURED
from zdsl.schedule import MACHINE_SHAPE_FIELDS
from zdsl.schedule import MachineProfile


def test_fit_recovers_latency_and_bandwidth():
    pts = [(x, 2e-4 + x / 1.5e9) for x in (3e4, 5e5, 4e6, 1.6e7)]
    latency, bw = fit_latency_bandwidth(pts)
    assert latency == pytest.approx(2e-4, rel=1e-6) and bw == pytest.approx(1.5e9, rel=1e-6)
    # Noise that makes the slope negative still gives positive rates.
    latency, bw = fit_latency_bandwidth([(1e3, 2e-3), (1e6, 1e-3)])
    assert latency > 0 and bw > 0


def machine_statement(machine_zs) -> str:
    """The ``machine`` statement calibrate wrote (a setting a line), joined into one line."""
    code = [line.strip() for line in machine_zs.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return " ".join(code).replace("( ", "(").replace(" )", ")")


def profile_errors(machine_zs) -> list[str]:
    """Why the checker refuses the ``machine`` profile in file ``machine_zs`` (its own messages,
    from its own rules: ``MACHINE_MAY_BE_ZERO`` and the ranges in ``zdsl/check/checker.py``), and the
    keywords it does not write: [] for a profile the language accepts in full."""
    from zdsl.check.checker import check_text
    from zdsl.lang.errors import ZsError
    statement = machine_statement(machine_zs)
    if not statement.startswith("machine cpu(") or statement.count("machine ") != 1:
        return [f"not one `machine cpu(...)` statement: {statement}"]
    schedule = machine_zs.with_name("s.zs")
    schedule.write_text(f'schedule t\nmodel gpt(layers=2)\ninclude "{machine_zs.name}"\n')
    try:
        checked, _ = check_text(schedule.read_text(), str(schedule))
    except ZsError as e:
        return [d.message for d in e.diagnostics if d.is_error]
    written = {span.split(".", 1)[1] for span in checked.spans if span.startswith("machine.")}
    # the shape fields are written where measured (a CPU's fp16 never is): see test_quick_profile_parses;
    # the link across nodes is the user's to give
    return [f"{key} is not written" for key in ZS_KEYS.values() if key not in written
            and key not in MACHINE_SHAPE_FIELDS and key not in MACHINE_NOT_MEASURED]


@pytest.mark.slow      # a real quick calibration: it starts a rank beside this process and measures for seconds
def test_quick_profile_parses(tmp_path, capsys, monkeypatch):
    out = tmp_path / "machine.zs"
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    from zdsl.runtime.calibrate import cli
    measured_on = {}                 # rank 0's cores during each disk test (it measures in this process)

    def disk(*args, beside=True, **kw):
        measured_on["shared" if beside else "alone"] = os.sched_getaffinity(0) if cores is not None else None
        return measure_disk(*args, beside=beside, **kw)
    measure_disk = cli.measure_disk
    monkeypatch.setattr(cli, "measure_disk", disk)
    import torch
    tables = []                      # rank 0's (cores, torch threads) during each compute table

    def table(*args, **kw):
        tables.append((os.sched_getaffinity(0) if cores is not None else None, torch.get_num_threads()))
        return measure_compute_table(*args, **kw)
    measure_compute_table = cli.measure_compute_table
    monkeypatch.setattr(cli, "measure_compute_table", table)
    threads = torch.get_num_threads()
    assert main(["--quick", "--no-progress", "--out", str(out), "--disk", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads
    assert len(tables) == 2                      # beside the other rank, then alone
    every = len(cores) if cores is not None else os.cpu_count()
    if os.environ.get("OMP_NUM_THREADS") is None:
        assert tables[1][1] == every and tables[0][1] == max(1, every // 2)
    if cores is not None and len(cores) > 1 and os.environ.get("ZDSL_BIND_CORES", "1") != "0":
        # bound to its share beside the other rank; alone with every core, as a one-rank run
        assert measured_on["shared"] < cores and measured_on["alone"] == cores
        assert tables[0][0] < cores and tables[1][0] == cores
    assert profile_errors(out) == []
    # the rates by shape (zdsl/sim/rates.py): compute by width in fp32 and bf16, the disk alone
    statement = machine_statement(out)
    for key in ("flops_widths=(64, 512, 2048)", "flops_fp32=(", "flops_bf16=(", "disk_ranks=2",
                "disk_read_alone=", "disk_write_alone=", "compute_ranks=2", "flops_alone_fp32=(",
                "flops_alone_bf16=("):
        assert key in statement
    # the default block (fp32, width 64) is the table's first entry: programs of that size keep their rate
    flops = re.search(r"[(, ]flops=([^,]+),", statement).group(1)
    assert f"flops_fp32=({flops}, " in statement
    # the event loop's CPU per op of the reference step: some, and less than a whole step's worth
    loop = float(re.search(r"[(, ]loop=([^,]+),", statement).group(1))
    assert 0 < loop < 0.05 / 53
    if cores is not None:     # rank 0 measured in this process, bound to its share: the cores are back
        assert os.sched_getaffinity(0) == cores
    assert not list(tmp_path.glob(".zdsl-calibrate-*"))          # test files removed


def _written(tmp_path, profile: MachineProfile, edit=lambda text: text):
    path = tmp_path / "machine.zs"
    path.write_text(edit(Calibration(profile).to_zs()))
    return path


def test_a_fixed_cost_fitted_to_0_is_a_valid_profile(tmp_path):
    """What calibrate writes when each fixed cost is clamped at 0 (see its docstring)."""
    zeros = MachineProfile.of(op_overhead=0.0, kernel_overhead=0.0, comm_overhead=0.0, scatter_overhead=0.0)
    assert profile_errors(_written(tmp_path, zeros)) == []


@pytest.mark.parametrize("profile, edit, refused", [
    (MachineProfile(), None, "comm_overhead is not written"),              # not given: left out, not written as 0
    (MachineProfile.of(comm_overhead=0.0, scatter_overhead=0.0, flops=-5e10), None, "flops must be"),
    (MachineProfile.of(comm_overhead=0.0, scatter_overhead=0.0, disk_read=0.0), None, "disk_read must be"),
    (MachineProfile.of(comm_overhead=0.0, scatter_overhead=1e-4), lambda t: t.replace("scatter_overhead=0.0001",
                                                                                    "scatter_overhead=-0.0001"),
     "scatter_overhead must be"),
    (MachineProfile.of(comm_overhead=0.0, scatter_overhead=0.0, comm_under_load=1.5), None, "comm_under_load must be"),
    (MachineProfile.of(comm_overhead=0.0, scatter_overhead=0.0, comm_slots=0), None, "comm_slots must be"),
    (MachineProfile.of(comm_overhead=0.0, scatter_overhead=0.0), lambda t: re.sub(r"\n\s*link=[^,\n]*,", "", t),
     "link is not written"),
])
def test_the_profile_check_refuses_what_the_checker_refuses(tmp_path, profile, edit, refused):
    errors = profile_errors(_written(tmp_path, profile, edit or (lambda text: text)))
    assert any(refused in e for e in errors), errors


def test_bad_disk_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["--quick", "--no-progress", "--disk", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_disk_test_runs_the_swapper_and_fits_each_direction(tmp_path):
    """Transfers of each size through the runtime's swapper, both directions fitted to latency +
    bytes / rate; its files go; a folder it cannot use is a CalibrationError, not a traceback.
    (Which size took longer is the disk's and the load's business: the fit is checked, not the
    times, which on a loaded host need not even rise with the bytes.)"""
    from zdsl.runtime.calibrate.measure import DISK_SIZES
    from zdsl.runtime.calibrate.measure import MIN_DISK_CPU
    from zdsl.runtime.calibrate.measure import CalibrationError
    from zdsl.runtime.calibrate.measure import Settings
    from zdsl.runtime.calibrate.measure import measure_disk
    disk = measure_disk(str(tmp_path), Settings(quick=True), rank=0)
    for way in ("read", "write"):
        sizes = [n for n, _ in disk["points"][way]]
        assert sizes == list(DISK_SIZES[:-1]) == disk["sizes"]
        latency, rate = fit_latency_bandwidth(disk["points"][way])
        assert disk[f"disk_{way}_latency"] == latency > 0 and disk[f"disk_{way}"] == rate > 0
        assert all(seconds > 0 for _, seconds in disk["points"][way])
        assert MIN_DISK_CPU <= disk[f"disk_{way}_cpu"] <= 1
    assert not list(tmp_path.iterdir())
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CalibrationError, match="disk test"):
        measure_disk(str(tmp_path / "a_file"), Settings(quick=True), rank=0)


def test_the_per_op_overhead_fit_recovers_a_known_one():
    from zdsl.sim.simulate import simulate
    profile = MachineProfile.of(flops=1e10, link_bandwidth=1e9, link_latency=1e-4, memory_bandwidth=5e9)
    graph = reference_graph(2, "cpu").graph
    truth = 7e-4
    measured = simulate(graph, profile.with_fields(op_overhead=truth)).step_s
    fit = fit_overhead(graph, profile, measured)
    assert fit.op == pytest.approx(truth, rel=1e-6) and fit.comm < 0 and fit.bare_s < measured
    assert fit_overhead(graph, profile, fit.bare_s / 2).op == 0.0      # faster than the rates: no overhead


@pytest.mark.parametrize("cores", [0, 1])
@pytest.mark.parametrize("kernel_cost", [0.0, 8e-6])
@pytest.mark.parametrize("op_cost, comm_cost", [(3e-4, 1.5e-3), (1e-3, 2e-4), (5e-4, 0.0)])
def test_the_fit_recovers_lane_kernel_and_collective_costs(op_cost, comm_cost, kernel_cost, cores):
    """Lane ops that each took their rated time plus a fixed cost plus one per kernel, and the
    step the known costs predict: the fit returns them (the lane ops pin the first two, the step
    the third)."""
    import dataclasses
    from zdsl.sim.simulate import rated_duration
    from zdsl.sim.simulate import simulate
    from zdsl.planner.calibration_fit import lane_ops
    profile = MachineProfile.of(flops=3e10, host_flops=3e10, link_bandwidth=1.3e9, link_latency=3.5e-4,
                                scatter_bandwidth=4.2e8, scatter_latency=7e-4, memory_bandwidth=1.4e10, cores=cores)
    graph = reference_graph(2, "cpu").graph
    assert len({graph.ops[i].kernels for i in lane_ops(graph)}) > 3      # steps (none) and units' compute
    truth = profile.with_fields(op_overhead=op_cost, comm_overhead=comm_cost, kernel_overhead=kernel_cost)
    step = simulate(graph, truth).step_s
    measured = {i: rated_duration(graph, graph.ops[i], profile) + op_cost + graph.ops[i].kernels * kernel_cost
                for i in lane_ops(graph)}
    fit = fit_overhead(graph, profile, step, measured)
    assert fit.op == pytest.approx(op_cost, rel=1e-6)
    assert fit.kernel == pytest.approx(kernel_cost, rel=1e-6, abs=1e-12)
    assert fit.comm == pytest.approx(comm_cost, rel=1e-4, abs=1e-8)


def test_the_lane_cost_line_stands_noise():
    """Each lane op 10% off its fixed costs either way: the costs come back within 10%."""
    from zdsl.sim.simulate import rated_duration
    from zdsl.planner.calibration_fit import lane_costs
    from zdsl.planner.calibration_fit import lane_ops
    profile = MachineProfile.of(flops=3e10, memory_bandwidth=1.4e10)
    graph = reference_graph(2, "cpu").graph
    noise = [0.9, 1.1, 1.0]
    measured = {i: rated_duration(graph, graph.ops[i], profile)
                + (2e-4 + graph.ops[i].kernels * 8e-6) * noise[k % 3] for k, i in enumerate(lane_ops(graph))}
    op, kernel = lane_costs(graph, profile, measured)
    assert op == pytest.approx(2e-4, rel=0.1) and kernel == pytest.approx(8e-6, rel=0.1)


def test_the_lane_cost_line_never_starts_below_zero():
    from zdsl.sim.simulate import rated_duration
    from zdsl.planner.calibration_fit import lane_costs
    from zdsl.planner.calibration_fit import lane_ops
    profile = MachineProfile.of(flops=3e10, memory_bandwidth=1.4e10)
    graph = reference_graph(2, "cpu").graph
    # ops with no kernels took no more than their rates; the others 10 us a kernel, less 50 us
    measured = {i: rated_duration(graph, graph.ops[i], profile) + max(0.0, graph.ops[i].kernels * 1e-5 - 5e-5)
                for i in lane_ops(graph)}
    op, kernel = lane_costs(graph, profile, measured)
    assert op == 0.0 and 0 < kernel < 1e-5


def test_lane_ops_faster_than_their_rate_give_no_negative_cost():
    from zdsl.sim.simulate import rated_duration
    from zdsl.planner.calibration_fit import lane_ops
    profile = MachineProfile.of(flops=1e10, link_bandwidth=1e9, link_latency=1e-4, memory_bandwidth=5e9)
    graph = reference_graph(2, "cpu").graph
    measured = {i: rated_duration(graph, graph.ops[i], profile) / 2 for i in lane_ops(graph)}
    fit = fit_overhead(graph, profile, 1.0, measured)
    assert fit.op == 0.0 and fit.comm > 0


def test_the_reference_step_is_the_median_block_of_the_slowest_rank():
    from zdsl.runtime.calibrate.reference import reference_times

    def block(steps, op):
        return {"steps": steps, "lane_op_s": {3: op}}
    # Three blocks; the middle one caught a burst (3x slower). Per step, the slower rank counts.
    rank0 = {"runtime": [block([1.0, 1.0, 1.2], 0.1), block([3.0, 3.0, 3.0], 0.3), block([1.1, 1.1, 1.1], 0.1)]}
    rank1 = {"runtime": [block([1.0, 1.4, 1.4], 0.2), block([3.0, 3.0, 3.0], 0.6), block([1.0, 1.0, 1.0], 0.2)]}
    step, blocks, ops, comm, loaded = reference_times([rank0, rank1])
    assert blocks == [1.4, 3.0, 1.1]
    assert step == 1.4                              # the burst moved nothing
    assert ops == {3: pytest.approx(0.15)}          # mean over ranks of each rank's median block
    assert comm == {} and loaded == {}              # no collectives' service times in these blocks


def test_a_variants_step_is_its_ratio_to_the_reference_step_beside_it():
    """The variants ran in turn with the reference step by step, through a burst that slowed the
    middle round 3x: each is its median ratio to the reference's step of the same round (the
    slowest rank's each), times the reference step, so the burst moves nothing."""
    from zdsl.runtime.calibrate.reference import variant_steps

    def rank(f):
        return {"runtime_variants": {"steps": {"reference": [1.0 * f, 3.0 * f, 1.0 * f],
                                               "unclipped": [0.9 * f, 2.7 * f, 0.9 * f],
                                               "zero1": [0.8, 2.4, 0.7]}}}
    steps = variant_steps([rank(1.0), rank(0.5)], 2.0)
    assert steps == {"unclipped": pytest.approx(1.8), "zero1": pytest.approx(1.6)}


def test_the_variants_run_in_turn_with_the_reference(monkeypatch):
    """Each round runs the reference, then each variant (unclipped ZeRO-3, ZeRO-1), one step each,
    after the same warm-up: the pairs a ratio is taken of are neighbours in time."""
    import torch

    from zdsl.runtime.calibrate import reference
    from zdsl.runtime.calibrate.measure import Settings
    ran = []

    class Record:
        seconds = 1.0

    def stepper(compiled, device, rank, world):
        s = compiled.schedule

        async def step(n):
            ran.append((s.optimizer.clip, s.stage, n))
            return Record(), 0.0
        return None, step
    monkeypatch.setattr(reference, "_stepper", stepper)
    out = reference.measure_variants(torch.device("cpu"), Settings(), 0, 1, 2)
    assert set(out["steps"]) == {"reference", "unclipped", "zero1"}
    assert all(len(ts) == 2 for ts in out["steps"].values())
    assert ran[:6] == [(1.0, 3, 0), (None, 3, 0), (None, 1, 0), (1.0, 3, 1), (None, 3, 1), (None, 1, 1)]
    assert len(ran) == 3 * (reference.WARM_UP_STEPS + 2)


@pytest.mark.parametrize("scatter_extra", [6e-4, 0.0])
def test_the_scatter_cost_is_the_collectives_cost_plus_what_reduce_scatters_took_beyond_the_others(scatter_extra):
    """Collectives whose service times exceed their rated times by a fixed cost, reduce-scatters by
    ``scatter_extra`` more, and the step the three costs predict: the fit returns all three."""
    import dataclasses
    from zdsl.sim.simulate import rated_duration
    from zdsl.sim.simulate import simulate
    from zdsl.planner.calibration_fit import comm_ops
    from zdsl.planner.calibration_fit import lane_ops
    profile = MachineProfile.of(flops=3e10, host_flops=3e10, link_bandwidth=1.3e9, link_latency=3.5e-4,
                                scatter_bandwidth=4.2e8, scatter_latency=7e-4, memory_bandwidth=1.4e10, cores=1)
    graph = reference_graph(2, "cpu").graph
    op_cost, comm_cost = 2e-4, 3e-4
    truth = profile.with_fields(op_overhead=op_cost, comm_overhead=comm_cost,
                                scatter_overhead=comm_cost + scatter_extra)
    step = simulate(graph, truth).step_s
    lane = {i: rated_duration(graph, graph.ops[i], profile) + op_cost for i in lane_ops(graph)}
    base = 0.4e-3               # what every collective took beyond its rate, whatever the fitted cost
    service = {i: rated_duration(graph, graph.ops[i], profile) + base
               + (scatter_extra if graph.ops[i].kind == "comm.reduce_scatter" else 0.0) for i in comm_ops(graph)}
    assert {graph.ops[i].kind for i in service} >= {"comm.reduce_scatter", "comm.all_gather"}
    fit = fit_overhead(graph, profile, step, lane, service)
    assert fit.op == pytest.approx(op_cost, rel=1e-6)
    assert fit.comm == pytest.approx(comm_cost, rel=1e-4)
    assert fit.scatter == pytest.approx(comm_cost + scatter_extra, rel=1e-4)
    # and the prediction with the fitted costs is the step they were fitted to
    fitted = profile.with_fields(op_overhead=fit.op, comm_overhead=fit.comm, scatter_overhead=fit.scatter)
    assert simulate(graph, fitted).step_s == pytest.approx(step, rel=1e-6)


def test_a_collectives_service_time_starts_when_the_one_before_it_on_its_lane_ends():
    from types import SimpleNamespace as NS

    from zdsl.planner.calibration_fit import comm_intervals
    graph = NS(ops=[NS(kind="comm.all_gather", lane="comm"), NS(kind="compute.forward", lane="compute"),
                    NS(kind="comm.reduce_scatter", lane="comm"), NS(kind="comm.all_gather", lane="comm")])
    # issued together at 1.0: the second queues behind the first; the third issued after both ended
    timings = [NS(start=1.0, end=2.0), NS(start=0.0, end=9.0), NS(start=1.0, end=2.5), NS(start=3.0, end=3.25)]
    intervals = comm_intervals(graph, NS(timings=timings))
    assert {i: e - s for i, (s, e) in intervals.items()} == {0: 1.0, 2: 0.5, 3: 0.25}


def test_with_two_backend_threads_a_collective_waits_only_for_one_of_them():
    from types import SimpleNamespace as NS

    from zdsl.planner.calibration_fit import comm_intervals
    graph = NS(ops=[NS(kind="comm.all_gather", lane="comm")] * 4)
    # issued together at 1.0: the first two start at once; the third when the second's thread is
    # free (2.0), the fourth when the third's is (2.5: the first holds the other until 4.0)
    timings = [NS(start=1.0, end=4.0), NS(start=1.0, end=2.0), NS(start=1.0, end=2.5), NS(start=1.0, end=3.0)]
    intervals = comm_intervals(graph, NS(timings=timings), slots=2)
    assert {i: e - s for i, (s, e) in intervals.items()} == {0: 3.0, 1: 1.0, 2: 0.5, 3: 0.5}


def test_the_time_compute_ran_beside_a_collective_is_counted_once_and_only_inside_its_service():
    from types import SimpleNamespace as NS

    from zdsl.planner.calibration_fit import comm_intervals

    from zdsl.planner.calibration_fit import comm_under_compute
    graph = NS(ops=[NS(kind="comm.all_gather", lane="comm"), NS(kind="compute.forward", lane="compute"),
                    NS(kind="compute.step", lane="host"), NS(kind="comm.all_gather", lane="comm"),
                    NS(kind="copy.h2d", lane="h2d")])
    # the second gather queues behind the first (served 2..4); compute 1..3 and a host step 2.5..3.5
    # overlap each other; a copy is not compute
    timings = [NS(start=0.0, end=2.0), NS(start=1.0, end=3.0), NS(start=2.5, end=3.5),
               NS(start=0.5, end=4.0), NS(start=0.0, end=4.0)]
    record = NS(timings=timings)
    assert comm_under_compute(graph, record, comm_intervals(graph, record)) == {0: 1.0, 3: 1.5}


def test_a_scatter_extra_that_alone_overshoots_the_step_is_fitted_to_it():
    import dataclasses
    from zdsl.sim.simulate import rated_duration
    from zdsl.sim.simulate import simulate
    from zdsl.planner.calibration_fit import comm_ops
    from zdsl.planner.calibration_fit import lane_ops
    profile = MachineProfile.of(flops=3e10, host_flops=3e10, link_bandwidth=1.3e9, link_latency=3.5e-4,
                                memory_bandwidth=1.4e10, cores=1)
    graph = reference_graph(2, "cpu").graph
    step = simulate(graph, profile.with_fields(op_overhead=2e-4, comm_overhead=0.0,
                                               scatter_overhead=1e-3)).step_s
    lane = {i: rated_duration(graph, graph.ops[i], profile) + 2e-4 for i in lane_ops(graph)}
    service = {i: rated_duration(graph, graph.ops[i], profile)
               + (5e-3 if graph.ops[i].kind == "comm.reduce_scatter" else 0.0) for i in comm_ops(graph)}
    fit = fit_overhead(graph, profile, step, lane, service)
    assert fit.comm == 0.0 and fit.scatter == pytest.approx(1e-3, rel=1e-4)


@pytest.mark.parametrize("under", [0.3, 1.0, MIN_UNDER_LOAD])
def test_a_collectives_rate_under_load_is_fitted_from_the_time_compute_ran_beside_it(under):
    """Collectives that took their rated time plus a fixed cost plus (1 - a) of the seconds compute
    ran beside them: the fit returns a, and the fixed cost then matches the step."""
    import dataclasses
    from zdsl.sim.simulate import rated_duration
    from zdsl.sim.simulate import simulate
    from zdsl.planner.calibration_fit import comm_ops
    from zdsl.planner.calibration_fit import lane_ops
    profile = MachineProfile.of(flops=3e10, host_flops=3e10, link_bandwidth=1.3e9, link_latency=3.5e-4,
                                memory_bandwidth=1.4e10, cores=1)
    graph = reference_graph(2, "cpu").graph
    op_cost, comm_cost = 2e-4, 3e-4
    truth = profile.with_fields(op_overhead=op_cost, comm_overhead=comm_cost, scatter_overhead=comm_cost,
                                comm_under_load=under)
    step = simulate(graph, truth).step_s
    lane = {i: rated_duration(graph, graph.ops[i], profile) + op_cost for i in lane_ops(graph)}
    loaded = {i: 1e-4 * (k % 5) for k, i in enumerate(comm_ops(graph))}
    service = {i: rated_duration(graph, graph.ops[i], profile) + comm_cost + (1 - under) * loaded[i]
               for i in comm_ops(graph)}
    fit = fit_overhead(graph, profile, step, lane, service, loaded)
    assert fit.under_load == pytest.approx(under, rel=1e-6)
    assert fit.comm == pytest.approx(comm_cost, rel=1e-4) and fit.scatter == pytest.approx(comm_cost, rel=1e-3)
    # no sharing model (cores 0): nothing to fit, the fair-share default stays
    assert fit_overhead(graph, profile.with_fields(cores=0), step, lane, service, loaded).under_load == 0


def test_collectives_slower_than_waiting_out_the_compute_floor_the_rate():
    from zdsl.sim.simulate import rated_duration
    from zdsl.planner.calibration_fit import comm_ops
    from zdsl.planner.calibration_fit import rate_under_load
    profile = MachineProfile.of(link_bandwidth=1.3e9, link_latency=3.5e-4, cores=1)
    graph = reference_graph(2, "cpu").graph
    loaded = {i: 1e-4 * (k % 5) for k, i in enumerate(comm_ops(graph))}
    service = {i: rated_duration(graph, graph.ops[i], profile) + 1.5 * loaded[i] for i in comm_ops(graph)}
    assert rate_under_load(graph, profile, service, loaded) == MIN_UNDER_LOAD


def test_the_disk_test_moves_aligned_buffers_as_a_run_does(tmp_path, monkeypatch):
    """Every transfer the disk test times hands the swapper 4 KiB-aligned tensors, as the run's
    host pool does: an unaligned one goes through the swapper's staging copy, a slower path no
    run takes (the rate came out 0.74x the run's)."""
    from zdsl.runtime.calibrate.measure import Settings
    from zdsl.runtime.calibrate.measure import measure_disk
    from zdsl.runtime.io.aligned import is_aligned
    from zdsl.runtime.offload.swap import Swapper
    seen = []
    for method in ("write_sync", "read_sync"):
        def spy(self, name, tensor, *a, _real=getattr(Swapper, method), **k):
            seen.append(is_aligned(tensor))
            return _real(self, name, tensor, *a, **k)
        monkeypatch.setattr(Swapper, method, spy)
    measure_disk(str(tmp_path), Settings(quick=True), rank=0)
    assert seen and all(seen)


def test_the_cpu_copy_rate_is_measured_out_of_cache_even_when_quick():
    """The memcpy rate prices one-rank collectives, whose payloads exceed the last-level cache:
    quick calibration copies 64 MiB too (a 16 MiB copy stayed in a 32 MiB L3)."""
    import torch

    from zdsl.runtime.calibrate.measure import Settings
    from zdsl.runtime.calibrate.measure import measure_copy
    copy = measure_copy(torch.device("cpu"), Settings(quick=True))
    assert copy["pcie"] > 0 and copy["copy_note"].startswith("memcpy of 64 MiB")


def test_the_host_step_rate_is_measured_out_of_cache_even_when_quick():
    """The AdamW step prices a shard of a real model, far larger than the last-level cache: the
    quick measurement's state (2 moments, parameter, gradient; fp32) is 128 MiB too, not 16 MiB
    that a 32 MiB L3 held (43.7 GB/s there against 8.8 out of cache)."""
    import torch

    from zdsl.runtime.calibrate.measure import Settings
    from zdsl.runtime.calibrate.measure import measure_optimizer
    step = measure_optimizer(torch.device("cpu"), Settings(quick=True))
    assert step["adam_numel"] * 16 >= 128 << 20 and step["host_adam_bandwidth"] > 0


def test_a_bf16_schedule_is_calibrated_in_bf16(tmp_path):
    """``--schedule`` of a bf16 program measures the CPU's compute in bf16, the precision its
    step runs in (this CPU's bf16 rate is 2-3x its fp32 one); without a schedule, fp32."""
    import torch

    from zdsl.runtime.calibrate.cli import shape_of_schedule
    from zdsl.runtime.calibrate.measure import Settings
    from zdsl.runtime.calibrate.measure import compute_dtype
    cpu = torch.device("cpu")
    path = tmp_path / "bf16.zs"
    path.write_text('schedule t "t"\nmodel gpt(layers=1, width=64, heads=4, vocab=256, context=32)\n'
                    'data synthetic(vocab=256, context=32)\ntrain steps=1, batch=2, precision=bf16\n'
                    'optimizer adamw(lr=1e-3)\nranks 1 on cpu\nzero 3\n')
    shape, ranks, _ = shape_of_schedule(str(path))
    assert ranks == 1 and compute_dtype(cpu, Settings(**shape).precision) == torch.bfloat16
    assert compute_dtype(cpu, Settings().precision) == torch.float32


def test_precision_is_a_calibrate_option(capsys):
    with pytest.raises(SystemExit):
        main(["--precision", "fp8"])
    assert "fp32" in capsys.readouterr().err


def test_one_rank_calibrates(tmp_path, monkeypatch):
    """``--ranks 1`` (a one-rank schedule's: its disk is not shared, as at two ranks it is)
    measures and writes a profile; its reference step's collectives need the group a one-rank
    run joins, which calibrate did not join at one rank."""
    from zdsl.runtime.calibrate import cli
    from zdsl.runtime.calibrate.reference import set_step
    # one set measured, never again in fresh ranks (test_quick_profile_parses covers that path)
    monkeypatch.setattr(cli, "remeasure", lambda raw, s, backend, report: [set_step(raw)])
    out = tmp_path / "machine.zs"
    assert main(["--quick", "--no-progress", "--ranks", "1", "--out", str(out), "--disk", str(tmp_path)]) == 0
    assert profile_errors(out) == []
    statement = machine_statement(out)      # alone is how its one rank measured the disk
    read = re.search(r"[(, ]disk_read=([^,]+),", statement).group(1)
    assert "disk_ranks=1" in statement and f"disk_read_alone={read}," in statement
    # its compute tables are one rank's with every core already: none measured again
    assert "compute_ranks=1" in statement and "flops_alone_" not in statement


@pytest.mark.parametrize("usual, firsts, kept", [
    (None, [0.030, 0.024, 0.027], 0.027),        # no history: twice more in fresh ranks, the median kept
    (None, [0.024, 0.030, 0.026], 0.026),
    (0.020, [0.0215], 0.0215),                   # 7.5% slower: the host's day-to-day drift, kept
    (0.020, [0.025, 0.021, 0.020], 0.021),       # a slow spell that passed: a set measured again kept
    (0.020, [0.025, 0.026, 0.024], 0.025),       # one that lasts: the median of the tries kept
    (0.020, [0.025, 0.026, 0.014], 0.025),       # a fast moment among them is not what the programs meet
    (0.020, [0.0185], 0.0185),                   # 8% faster: drift, kept
    (0.020, [0.016, 0.021, 0.0205], 0.0205),     # a fast moment first (25% faster): measured again too
    (0.020, [0.016, 0.017, 0.0165], 0.0165),     # a host faster for now: the median of the tries kept
])
def test_a_reference_step_off_the_usual_is_measured_twice_more_in_fresh_ranks_and_the_median_kept(
        monkeypatch, usual, firsts, kept):
    from zdsl.runtime.calibrate import slow_spell
    from zdsl.runtime.calibrate.measure import Settings
    from zdsl.runtime.calibrate.reference import REMEASURES, RUNTIME_BLOCKS, set_step
    assert REMEASURES == 2

    def ranks_at(step: float, rank_one: float = 1.0) -> list[dict]:
        """Two ranks' reference sets whose step is ``step`` (the slowest rank's), tagged by it."""
        return [{"runtime": [{"steps": [step * f] * 4} for _ in range(RUNTIME_BLOCKS)],
                 "runtime_variants": {"at": step}} for f in (rank_one, 0.9)]
    sets = iter(firsts[1:])
    sleeps, fresh = [], []
    monkeypatch.setattr(slow_spell.time, "sleep", sleeps.append)

    def in_fresh_ranks(s, backend):
        fresh.append(backend)
        return ranks_at(next(sets))
    monkeypatch.setattr(slow_spell, "_in_fresh_ranks", in_fresh_ranks)
    raw = ranks_at(firsts[0])
    assert slow_spell.remeasure(raw, Settings(usual_reference_s=usual), "gloo") == firsts
    assert len(fresh) == len(firsts) - 1 and len(sleeps) == (0 if usual is None else len(fresh))
    assert set_step(raw) == pytest.approx(kept)
    assert [r["runtime_variants"]["at"] for r in raw] == [kept, kept]     # each rank's whole set kept


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or os.environ.get("ZDSL_BIND_CORES", "1") == "0", reason="needs 2 cores to bind a share of")
def test_a_calibration_rank_gives_its_process_the_cores_and_threads_back(monkeypatch):
    """Rank 0 measures in the caller's process; ranks spawned after it left its group (the
    reference measured again in fresh ranks) inherit that process's cores, and bound within its
    share two ranks shared one core, every step taking twice as long."""
    import torch
    from zdsl.runtime.calibrate.measure import Settings
    from zdsl.runtime.calibrate.ranks import joined
    from zdsl.runtime.dist import collectives, group
    monkeypatch.setattr(group, "init_group", lambda *a, **kw: None)     # the binding is what is tested
    monkeypatch.setattr(group, "leave_group", lambda: None)
    monkeypatch.setattr(collectives, "comm_slots", lambda: 1)
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with joined(0, 2, 0, Settings(backend="gloo"), "gloo") as me:
        assert os.sched_getaffinity(0) < cores and me.unbound == cores
    assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == threads


def test_placements_on_other_disk_settings_are_said_to_share_the_one_measured_rate(tmp_path, capsys):
    """The profile holds one disk rate: calibrate measures it with the first NVMe placement's folder,
    block and depth, and says which other placements the plan prices at that rate."""
    from zdsl.runtime.calibrate.cli import shape_of_schedule
    head = ('schedule t "t"\nmodel gpt(layers=1, width=64, heads=4, vocab=256, context=32)\n'
            'data synthetic(vocab=256, context=32)\ntrain steps=1, batch=2\noptimizer adamw(lr=1e-3)\n'
            'ranks 1 on cpu\nzero 3\n')
    a, b = tmp_path / "a", tmp_path / "b"
    path = tmp_path / "two.zs"
    path.write_text(head + f'offload parameters -> nvme("{a}", block=1MiB, depth=8)\n'
                           f'offload optimizer -> nvme("{b}", block=256KiB, depth=2)\n')
    shape, _, folder = shape_of_schedule(str(path))
    assert (shape["block"], shape["depth"], folder) == (1 << 20, 8, str(a))
    assert capsys.readouterr().err == (
        f"zdsl calibrate: the profile holds one disk rate, measured with the parameters' placement ({a}, block "
        f"1024 KiB, depth 8); it plans the optimizer's ({b}, block 256 KiB, depth 2) too\n")
    path.write_text(head + f'offload parameters -> nvme("{a}")\noffload optimizer -> nvme("{a}")\n')
    shape_of_schedule(str(path))
    assert capsys.readouterr().err == ""
