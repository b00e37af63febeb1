"""benchmarks/host_load.py: the host's CPU time less the benchmark's own is what other work took
(clocks fed by the test: no measuring here)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "host_load.py"


@pytest.fixture()
def host_load(monkeypatch):
    spec = importlib.util.spec_from_file_location("host_load", BENCH)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "host_load", mod)     # its dataclasses look their module up
    spec.loader.exec_module(mod)
    clock = {"wall": 100.0, "host": (1000.0, 10.0), "own": 50.0}
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(mod, "_host_seconds", lambda: clock["host"])
    monkeypatch.setattr(mod, "_own_seconds", lambda: clock["own"])
    monkeypatch.setattr(mod.os, "cpu_count", lambda: 2)
    return mod, clock


def test_the_benchmarks_own_ranks_are_not_outside_load(host_load):
    mod, clock = host_load
    window = mod.OutsideLoad.start()
    clock.update(wall=110.0, host=(1019.0, 10.0), own=69.0)     # 10 s, 2 cores: our ranks kept both busy
    load = window.stop()
    assert load.measured and load.others == pytest.approx(0.0) and not load.busy


def test_other_processes_and_steal_are(host_load):
    mod, clock = host_load
    window = mod.OutsideLoad.start()
    clock.update(wall=110.0, host=(1015.0, 13.0), own=55.0)     # 10 of 15 busy seconds not ours, 3 stolen
    load = window.stop()
    assert load.others == pytest.approx(0.5) and load.steal == pytest.approx(0.15) and load.busy
    assert "other processes 50% of the 2 cores" in load.line()


def test_without_proc_stat_nothing_is_claimed(host_load, monkeypatch):
    mod, _ = host_load
    monkeypatch.setattr(mod, "_host_seconds", lambda: None)
    load = mod.OutsideLoad.start().stop()
    assert not load.measured and not load.busy and "not measured" in load.line()
