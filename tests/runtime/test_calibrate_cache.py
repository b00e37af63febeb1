"""``zdsl calibrate`` refreshes the profile ``zdsl plan`` uses by default (zdsl.sim.profile_cache)."""
from __future__ import annotations

import json

import pytest

from zdsl.sim import profile_cache
from zdsl.runtime.calibrate.cli import Calibration
from zdsl.runtime.calibrate.cli import cache_profile
from zdsl.schedule import MachineProfile


def test_calibrate_refreshes_the_cached_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CALIBRATE", "1")
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path))
    old = MachineProfile().with_fields(flops=1e9)
    profile_cache.write_profile(old.to_config(), "machine cpu(flops=1e9)")
    new = MachineProfile().with_fields(flops=3e10, link_bandwidth=4e9)
    said = cache_profile(Calibration(new))
    path = profile_cache.profile_path()
    assert said == f"cached for zdsl plan, tune and run --trace in {path}"
    assert profile_cache.read_profile(path)[0] == new


def test_calibrate_off_leaves_the_cache_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CALIBRATE", "0")
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path))
    assert cache_profile(Calibration(MachineProfile())) == "not cached for zdsl plan: ZDSL_CALIBRATE=0"
    assert list(tmp_path.iterdir()) == []


def test_a_cached_profile_without_the_alone_tables_is_measured_again_once_and_that_is_said(
        tmp_path, capsys, monkeypatch):
    """Format 2 had no compute tables of one rank with every core (flops_alone_*): a one-rank
    schedule would plan on one core's rates, so the cache is measured again, once, and said."""
    from zdsl.cli import main
    monkeypatch.setenv("ZDSL_CALIBRATE", "1")
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    path = profile_cache.profile_path("cpu")
    path.parent.mkdir(parents=True)
    shared = MachineProfile.of(name="cpu", flops_widths=(64.0,), flops_fp32=(4e10,), disk_ranks=2)
    path.write_text(json.dumps({"format": 2, "profile": shared.to_config(), "statement": "machine cpu(...)",
                                "when": "2026-11-25 20:45 UTC"}))
    alone = shared.with_fields(compute_ranks=2, flops_alone_fp32=(6e10,))
    calls = []

    def quick():
        calls.append(1)
        profile_cache.write_profile(alone.to_config(), "machine cpu(...)")
    monkeypatch.setattr(profile_cache, "calibrate_in_runtime", quick)
    schedule = tmp_path / "s.zs"
    schedule.write_text("schedule s\nmodel gpt(layers=2)\ndata synthetic(vocab=256, context=32)\n"
                        "train steps=1, batch=4\nranks 1 on cpu\nzero 3\n")
    try:
        for _ in range(2):
            assert main(["plan", str(schedule)]) == 0
        err = capsys.readouterr().err
        assert calls == [1] and err.count("calibrated this machine again") == 1
        assert "older format, without the compute rates of one rank with every core" in err
        assert profile_cache.read_profile(path)[0].compute.alone_fp32 == (6e10,)
    finally:
        profile_cache.enable(False)


def test_the_cache_keeps_the_latest_reference_steps_and_their_median_is_the_usual_one(tmp_path, monkeypatch):
    """Each calibration's reference step joins the machine's history (the latest HISTORY, of this
    profile format's runtime); the usual step is the median of those at the same ranks."""
    monkeypatch.setenv("ZDSL_CALIBRATE", "1")
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path))
    assert profile_cache.usual_reference(2) is None
    steps = [0.019, 0.018, 0.030, 0.019, 0.020, 0.021, 0.018, 0.019, 0.024, 0.017]
    for step in steps:
        cache_profile(Calibration(MachineProfile(), {"reference": (2, step)}))
    cache_profile(Calibration(MachineProfile(), {"reference": (4, 0.05)}))
    history = profile_cache.reference_history(profile_cache.profile_path())
    assert len(history) == profile_cache.HISTORY and history[-1]["ranks"] == 4
    assert [r["step_s"] for r in history[:-1]] == steps[-profile_cache.HISTORY + 1:]
    assert profile_cache.usual_reference(2) == (0.019, profile_cache.HISTORY - 1)
    assert profile_cache.usual_reference(4) == (0.05, 1)
    assert profile_cache.usual_reference(1) is None
    # a profile without a reference (a test's, an older one's) keeps the history; garbage is none
    cache_profile(Calibration(MachineProfile()))
    assert len(profile_cache.reference_history(profile_cache.profile_path())) == profile_cache.HISTORY
    profile_cache.profile_path().write_text('{"references": [{"ranks": 2, "step_s": "fast"}, 3]}')
    assert profile_cache.usual_reference(2) is None
    # an older runtime's references (its collectives ran another way) are not this one's usual
    old = {"ranks": 2, "step_s": 0.02, "format": profile_cache.PROFILE_FORMAT - 1}
    profile_cache.profile_path().write_text(json.dumps({"references": [old, {"ranks": 2, "step_s": 0.02}]}))
    assert profile_cache.usual_reference(2) is None


@pytest.mark.parametrize("step_s, side", [(0.030, "slower"), (0.012, "faster")])
def test_a_profile_measured_off_the_usual_either_way_does_not_replace_the_cached_one(tmp_path, monkeypatch, capsys,
                                                                                     step_s, side):
    """Still slow after its tries, or still fast (the host's fast moments last seconds, as its slow
    spells do): the cached profile (of the machine's usual speed) is kept and said so, and calibrate
    warns which way; the reference joins the history, so that after more calibrations as far off
    the usual moves. With nothing cached the off one is cached (better than the default rates)."""
    from zdsl.runtime.calibrate import cli
    monkeypatch.setenv("ZDSL_CALIBRATE", "1")
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path))
    off = Calibration(MachineProfile().with_fields(flops=1e9),
                      {"reference": (2, step_s), "usual_reference_s": 0.019, "off_usual": True})
    assert cache_profile(off).startswith("cached for zdsl plan")              # nothing cached yet
    usual = MachineProfile().with_fields(flops=3e10)
    assert cache_profile(Calibration(usual, {"reference": (2, 0.019)})).startswith("cached for zdsl plan")
    said = cache_profile(off)
    path = profile_cache.profile_path()
    assert said.startswith("not cached: the profile cached ") and "is kept" in said and str(path) in said
    assert f"measured {side} than the machine's usual" in said
    assert profile_cache.read_profile(path)[0] == usual
    assert [r["step_s"] for r in profile_cache.reference_history(path)] == [step_s, 0.019, step_s]
    monkeypatch.setattr(cli, "calibrate", lambda *a, **k: off)
    assert cli.main(["--quick", "--no-progress", "--out", str(tmp_path / "m.zs")]) == 0
    err = capsys.readouterr().err
    assert f"warning: the reference step ran {step_s * 1e3:.1f} ms, " in err
    assert f"58% {side} than this machine's usual 19.0 ms" in err and "is kept" in err     # 30/19, 19/12
    assert profile_cache.read_profile(path)[0] == usual


def test_a_calibration_whose_blocks_moved_warns_and_calibration_by_default_relays_it(tmp_path, monkeypatch, capsys):
    """The reference's blocks 11.2-20.6 ms apart: the host's speed moved while it was measured, so
    the profile's predictions are that uncertain; `zdsl calibrate` says so, and the one line of a
    calibration by default carries the warning on. Blocks within 30% of each other: no warning."""
    import subprocess
    from zdsl.runtime.calibrate import cli
    monkeypatch.setenv("ZDSL_CALIBRATE", "1")
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path))
    for blocks, warned in (([0.0206, 0.0112, 0.0120], True), ([0.0168, 0.0164, 0.0188], False)):
        cal = Calibration(MachineProfile(), {"reference": (2, sorted(blocks)[1]), "block_steps": blocks})
        monkeypatch.setattr(cli, "calibrate", lambda *a, cal=cal, **k: cal)
        assert cli.main(["--quick", "--no-progress", "--out", str(tmp_path / "m.zs")]) == 0
        err = capsys.readouterr().err
        assert ("the host's speed moved 1.84x while it was measured" in err and "20.6, 11.2, 12.0 ms" in err) == warned
        assert ("warning:" in err) == warned
    said = "warning: the reference step's blocks ran 20.6, 11.2, 12.0 ms: the host's speed moved 1.84x"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", f"{said}\nwrote x\n"))
    assert profile_cache.calibrate_in_runtime() is None
    assert capsys.readouterr().err == f"zdsl: calibrating: {said}\n"


def test_a_reference_is_off_the_usual_by_the_same_measure_either_way():
    """Faster is the usual over the step (14.6 ms against 16.4 is 12% faster, as 16.4 against 14.6
    is 12% slower), the measure the 12% threshold holds to and calibrate's notes print."""
    from zdsl.runtime.calibrate.reference import SLOW_SPELL, is_off_usual, off_usual_by
    assert off_usual_by(0.0146, 0.0164) == pytest.approx(off_usual_by(0.0164, 0.0146))
    assert off_usual_by(0.0146, 0.0164) == pytest.approx(0.1233, abs=1e-3)
    assert is_off_usual(0.0146, 0.0164) and is_off_usual(0.0164, 0.0146) and SLOW_SPELL == 0.12
    assert not is_off_usual(0.0151, 0.0164) and not is_off_usual(0.0164, 0.0151) and not is_off_usual(0.0146, None)
