"""The planner prices a placement striped over folders on distinct drives at the sum of their rates,
says when its folders share one device, and ``zdsl plan`` shows which state goes to which folders."""
from __future__ import annotations

from pathlib import Path

import pytest

from zdsl.driver import compile_file
from zdsl.sim import rates
from zdsl.planner.report import build_plan
from zdsl.planner.report import render_plan
from zdsl.sim.simulate import rated_duration
from zdsl.schedule import MachineProfile

NVME = Path(__file__).parents[2] / "programs" / "nvme.zs"
MACHINE = MachineProfile.of(disk_read=1e9, disk_write=1e9)


@pytest.fixture
def devices(monkeypatch):
    """Folders' devices as the test says: the folder name's first letter (a1, a2: one drive)."""
    monkeypatch.setattr(rates, "device_of", lambda folder: Path(folder).name[0])
    rates._drives_cached.cache_clear()
    yield
    rates._drives_cached.cache_clear()


def compiled(parameters: str):
    c = compile_file(str(NVME), {"offload.parameters": parameters}, simulate=True)
    assert c.ok, [d.message for d in c.diagnostics]
    return c


def nvme_seconds(c, kind: str, state: str) -> float:
    return sum(rated_duration(c.graph, op, MACHINE) for op in c.graph.ops
               if op.kind == kind and rates.nvme_state(c.graph, op) == state)


@pytest.mark.parametrize("folders,expected", [(("a1", "b1"), 2.0), (("a1", "a2"), 1.0),
                                              (("a1", "a2", "b1"), 1.5), (("a1",), 1.0)])
def test_a_placement_gets_the_drives_its_folders_stripe_over(devices, folders, expected):
    assert rates.drives(folders) == expected


def test_striping_over_two_drives_halves_a_states_disk_time_and_one_drive_does_not(devices, tmp_path):
    one = compiled(f'nvme("{tmp_path / "a1"}")')
    two = compiled(f'nvme("{tmp_path / "a1"}", "{tmp_path / "b1"}")')
    same = compiled(f'nvme("{tmp_path / "a1"}", "{tmp_path / "a2"}")')
    for kind in ("nvme.read", "nvme.write"):
        alone = nvme_seconds(one, kind, "parameters")
        assert alone > 0
        assert nvme_seconds(two, kind, "parameters") == pytest.approx(alone / 2)
        assert nvme_seconds(same, kind, "parameters") == pytest.approx(alone)
        # the optimizer's own placement (one folder) is priced as before
        assert nvme_seconds(two, kind, "optimizer") == pytest.approx(nvme_seconds(one, kind, "optimizer"))


def test_the_plan_shows_where_each_state_goes_and_when_folders_share_a_device(devices, tmp_path):
    c = compiled(f'nvme("{tmp_path / "a1"}", "{tmp_path / "a2"}", block=256KiB)')
    plan = build_plan(c.graph, c.schedule, c.sim)
    text = render_plan(plan, width=400)
    assert f"nvme: parameters -> {tmp_path / 'a1'}, {tmp_path / 'a2'}" in text
    assert "on one device (st_dev), no faster than one folder" in text
    assert "nvme: optimizer -> /tmp/zdsl_nvme" in text
    where = plan.to_json()["nvme"]
    assert where["parameters"] == {"folders": [str(tmp_path / "a1"), str(tmp_path / "a2")], "block": 256 << 10,
                                   "depth": 8, "drives": 1.0}
    assert where["optimizer"]["folders"] == ["/tmp/zdsl_nvme"]
