"""``zdsl calibrate`` refreshes the profile ``zdsl plan`` uses by default (zdsl.planner.profile_cache)."""
from __future__ import annotations

import dataclasses

from zdsl.planner import profile_cache
from zdsl.runtime.calibrate.cli import Calibration
from zdsl.runtime.calibrate.cli import cache_profile
from zdsl.schedule import MachineProfile


def test_calibrate_refreshes_the_cached_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CALIBRATE", "1")
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path))
    old = dataclasses.replace(MachineProfile(), flops=1e9)
    profile_cache.write_profile(dataclasses.asdict(old), "machine cpu(flops=1e9)")
    new = dataclasses.replace(MachineProfile(), flops=3e10, link_bandwidth=4e9)
    said = cache_profile(Calibration(new))
    path = profile_cache.profile_path()
    assert said == f"cached for zdsl plan, tune and run --trace in {path}"
    assert profile_cache.read_profile(path)[0] == new


def test_calibrate_off_leaves_the_cache_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CALIBRATE", "0")
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path))
    assert cache_profile(Calibration(MachineProfile())) == "not cached for zdsl plan: ZDSL_CALIBRATE=0"
    assert list(tmp_path.iterdir()) == []
