"""`zdsl calibrate --quick` measures 2 ranks and writes a profile the checker accepts."""
import pytest

from zdsl.runtime.calibrate import ZS_KEYS, fit_latency_bandwidth, fit_overhead, main, reference_graph
from zdsl.schedule import MachineProfile


def test_fit_recovers_latency_and_bandwidth():
    pts = [(x, 2e-4 + x / 1.5e9) for x in (3e4, 5e5, 4e6, 1.6e7)]
    latency, bw = fit_latency_bandwidth(pts)
    assert latency == pytest.approx(2e-4, rel=1e-6) and bw == pytest.approx(1.5e9, rel=1e-6)
    # Noise that makes the slope negative still gives positive rates.
    latency, bw = fit_latency_bandwidth([(1e3, 2e-3), (1e6, 1e-3)])
    assert latency > 0 and bw > 0


def test_quick_profile_parses(tmp_path, capsys):
    out = tmp_path / "machine.zs"
    assert main(["--quick", "--no-progress", "--out", str(out), "--disk", str(tmp_path)]) == 0
    text = out.read_text()
    statement = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(statement) == 1 and statement[0].startswith("machine cpu(")
    assert all(f"{key}=" in statement[0] for key in ZS_KEYS.values())
    assert not list(tmp_path.glob(".zdsl-calibrate-*"))          # test files removed
    try:
        from zdsl.check import check_text
    except ImportError:
        return
    schedule = tmp_path / "s.zs"
    schedule.write_text('schedule t\nmodel gpt(layers=2)\ninclude "machine.zs"\n')
    checked, _ = check_text(schedule.read_text(), str(schedule))
    for name in MachineProfile.__dataclass_fields__:
        value = getattr(checked.machine, name)
        assert name == "name" or value > 0 or (name == "op_overhead" and value == 0)
    assert checked.machine.name == "cpu"


def test_bad_disk_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["--quick", "--no-progress", "--disk", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_per_op_overhead_fit_recovers_a_known_one():
    from zdsl.planner.simulate import simulate
    profile = MachineProfile(flops=1e10, link_bandwidth=1e9, link_latency=1e-4, memory_bandwidth=5e9)
    graph = reference_graph(2, "cpu", 2).graph
    truth = 7e-4
    measured = simulate(graph, MachineProfile(**{**vars(profile), "op_overhead": truth})).step_s
    fitted, bare = fit_overhead(profile, 2, "cpu", measured)
    assert fitted == pytest.approx(truth, rel=1e-6) and bare < measured
    assert fit_overhead(profile, 2, "cpu", bare / 2)[0] == 0.0      # faster than the rates: no overhead
