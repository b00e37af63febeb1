"""Calibration by default: ``zdsl plan`` (and ``tune``) plans a schedule without a ``machine`` statement with
the profile calibrated on this machine, measuring it once (stubbed here: the real one starts the runtime)."""
from __future__ import annotations

import pytest

import helpers

from zdsl.cli import main
from zdsl.sim import profile_cache
from zdsl.schedule import MachineProfile

SMALL = helpers.SMALL
MEASURED = MachineProfile().with_fields(flops=1e9, link_bandwidth=1e8, op_overhead=1e-3)


@pytest.fixture
def calibrating(tmp_path, monkeypatch):
    """Calibration on, in a private cache; a stub that caches MEASURED and counts its calls."""
    monkeypatch.setenv("ZDSL_CALIBRATE", "1")
    helpers.private_cache(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")             # this machine's device: the CPU
    calls = []

    def quick() -> str | None:
        calls.append(1)
        profile_cache.write_profile(MEASURED.to_config(), "machine cpu(...)")
        return None
    monkeypatch.setattr(profile_cache, "calibrate_in_runtime", quick)
    yield calls
    profile_cache.enable(False)


def plan(tmp_path, capsys, text=SMALL, *flags):
    path = tmp_path / "s.zs"
    path.write_text(text)
    status = main(["plan", str(path), *flags])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "Traceback" not in out + err
    return out, err


def rates(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if line.strip().startswith("rates:")]


def predicted_ms(out: str) -> float:
    return float(next(line for line in out.splitlines() if line.startswith("predicted step")).split()[2])


def test_first_plan_calibrates_once_and_says_so_then_uses_the_cache(tmp_path, capsys, calibrating):
    out, err = plan(tmp_path, capsys)
    path = profile_cache.profile_path("cpu")
    assert calibrating == [1]
    assert err.count("calibrated this machine once") == 1 and str(path) in err
    assert len(rates(out)) == 1 and rates(out)[0].startswith("rates: calibrated on this machine (cached ")
    assert str(path) in rates(out)[0]
    calibrated_ms = predicted_ms(out)
    out, err = plan(tmp_path, capsys)                             # a later command: the cache at once
    assert calibrating == [1] and "calibrat" not in err
    assert rates(out)[0].startswith("rates: calibrated on this machine")
    out, _ = plan(tmp_path, capsys, SMALL, "--no-calibrate")       # the default rates predict another step
    assert rates(out)[0].startswith("rates: zdsl's uncalibrated default 'cpu' profile")
    assert predicted_ms(out) < calibrated_ms                      # MEASURED is slower than the defaults


def test_a_machine_statement_wins_and_nothing_is_calibrated(tmp_path, capsys, calibrating):
    out, err = plan(tmp_path, capsys, SMALL + "machine cpu(flops=1e11)\n")
    assert calibrating == [] and "calibrat" not in err
    assert rates(out) == [f"rates: the 'cpu' profile of the machine statement at {tmp_path / 's.zs'}:9"]


def test_a_failing_calibration_falls_back_to_the_default_and_says_why(tmp_path, capsys, calibrating, monkeypatch):
    monkeypatch.setattr(profile_cache, "calibrate_in_runtime", lambda: "backend gloo could not start")
    out, err = plan(tmp_path, capsys)
    assert [line for line in err.splitlines() if "calibrate" in line] == [
        "zdsl: could not calibrate this machine (backend gloo could not start); "
        "planning with zdsl's default profile"]
    assert rates(out)[0].startswith("rates: zdsl's uncalibrated default 'cpu' profile")
    assert not profile_cache.profile_path("cpu").exists()


def test_calibrate_off_by_environment(tmp_path, capsys, calibrating, monkeypatch):
    monkeypatch.setenv("ZDSL_CALIBRATE", "0")
    out, err = plan(tmp_path, capsys)
    assert calibrating == [] and "calibrat" not in err
    assert rates(out)[0].startswith("rates: zdsl's uncalibrated default 'cpu' profile")


def test_the_cache_key_changes_with_the_core_count(calibrating, monkeypatch):
    monkeypatch.setattr(profile_cache, "usable_cores", lambda: 2)
    two = profile_cache.profile_path("cpu")
    monkeypatch.setattr(profile_cache, "usable_cores", lambda: 8)
    eight = profile_cache.profile_path("cpu")
    assert two != eight and "2cores" in two.name and "8cores" in eight.name
    assert profile_cache.profile_path("cuda") != eight


def test_an_unreadable_cache_is_measured_again(tmp_path, capsys, calibrating):
    path = profile_cache.profile_path("cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    out, _ = plan(tmp_path, capsys)
    assert calibrating == [1] and rates(out)[0].startswith("rates: calibrated on this machine")


def test_tune_predicts_with_the_calibrated_profile(tmp_path, capsys, calibrating):
    path = tmp_path / "s.zs"
    path.write_text(SMALL)
    status = main(["tune", str(path), "--vary", "prefetch=0,1", "--measure", "0"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert calibrating == [1] and "calibrated this machine once" in err


def test_the_suite_never_calibrates(tmp_path, capsys, monkeypatch):
    """tests/conftest.py turns calibration off for every test (and the zdsl processes tests start)."""
    helpers.private_cache(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(profile_cache, "calibrate_in_runtime", lambda: pytest.fail("the suite calibrated"))
    out, err = plan(tmp_path, capsys)
    assert "calibrat" not in err and not list((tmp_path / "cache").glob("machine-*.json"))
    assert rates(out)[0].startswith("rates: zdsl's uncalibrated default 'cpu' profile")
