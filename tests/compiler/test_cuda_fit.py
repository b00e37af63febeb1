"""`zdsl plan` says a `ranks N on cuda` schedule does not fit a machine with fewer GPUs, without torch
(the pre-flight of `zdsl run` refuses it with torch's own count: tests/e2e/test_cuda_preflight.py)."""
from __future__ import annotations

from zdsl.planner.machine_fit import Machine
from zdsl.planner.machine_fit import Needs
from zdsl.planner.machine_fit import TorchFloor
from zdsl.planner.machine_fit import judge
from zdsl.planner.machine_fit import visible_cuda_devices

GiB = 1 << 30
FLOOR = TorchFloor(0, 0, "test")


def test_cuda_ranks_beyond_the_machines_gpus_are_refused_with_the_count_and_a_fix():
    fit = judge(Needs(2, GiB, 0, device="cuda"), Machine(24 * GiB, 2, cuda_devices=1), FLOOR)
    assert not fit.fits
    assert fit.refusals == ["`ranks 2 on cuda` needs a CUDA device per rank on this machine, which has 1: "
                            "write `ranks 2 on cpu` (--set 'ranks=2 on cpu'), or run where each rank has a GPU"]


def test_enough_gpus_an_unknown_count_or_a_cpu_schedule_are_not_refused_for_it():
    assert judge(Needs(2, GiB, 0, device="cuda"), Machine(24 * GiB, 2, cuda_devices=2), FLOOR).fits
    assert judge(Needs(2, GiB, 0, device="cuda"), Machine(24 * GiB, 2, cuda_devices=None), FLOOR).fits
    assert judge(Needs(2, GiB, 0, device="cpu"), Machine(24 * GiB, 2, cuda_devices=0), FLOOR).fits


def test_the_count_follows_cuda_visible_devices(tmp_path, monkeypatch):
    gpus = tmp_path / "gpus"
    for i in range(4):
        (gpus / f"0000:0{i}:00.0").mkdir(parents=True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_cuda_devices(str(gpus), str(tmp_path / 'kfd')) == 4
    for visible, count in (("0,1", 2), ("", 0), ("-1", 0), ("2,-1,3", 1), ("0,1,2,3,4,5", 4)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert visible_cuda_devices(str(gpus), str(tmp_path / 'kfd')) == count, visible
    assert visible_cuda_devices(str(tmp_path / "no-driver"), str(tmp_path / 'kfd')) == 0
    (tmp_path / "kfd").touch()                 # an AMD GPU's driver: torch counts ROCm devices as cuda
    assert visible_cuda_devices(str(gpus), str(tmp_path / "kfd")) is None
