"""zdsl.sim.this_machine is the one reader of the kernel's GPU folders: the planner's count of the GPUs a
schedule's ranks may use, the calibration's count and whether ``auto`` means host memory all come from it.
Faked here with folders under tmp_path in place of /proc/driver/nvidia/gpus and /dev/kfd."""
from __future__ import annotations

import pytest

from zdsl.sim.this_machine import cuda_visible_limit, device_in_ram, nvidia_gpus, visible_nvidia_gpus

ADDRESSES = ("0000:3b:00.0", "0000:05:00.0", "0000:d8:00.0")


@pytest.fixture
def gpus(tmp_path, monkeypatch):
    """A fake NVIDIA driver folder with three GPUs, and CUDA_VISIBLE_DEVICES unset."""
    folder = tmp_path / "gpus"
    for address in ADDRESSES:
        (folder / address).mkdir(parents=True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return str(folder)


def test_the_driver_lists_every_gpu_by_address_whatever_cuda_visible_devices_says(gpus, tmp_path, monkeypatch):
    assert nvidia_gpus(gpus) == sorted(ADDRESSES)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert nvidia_gpus(gpus) == sorted(ADDRESSES)
    assert nvidia_gpus(str(tmp_path / "no-driver")) == []


@pytest.mark.parametrize("visible, limit", [(None, None), ("", 0), ("-1", 0), (" , ", 0), ("-1,0", 0),
                                            ("0,1", 2), ("1, 0", 2), ("2,-1,3", 1), ("GPU-8f2a", 1)])
def test_cuda_visible_devices_limits_the_devices_up_to_its_first_minus_one(visible, limit, monkeypatch):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert cuda_visible_limit() == limit


def test_the_visible_count_is_the_drivers_narrowed_by_cuda_visible_devices(gpus, tmp_path, monkeypatch):
    assert visible_nvidia_gpus(gpus) == 3
    for visible, count in (("1", 1), ("0,1,2,3,4", 3), ("", 0), ("-1", 0)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert visible_nvidia_gpus(gpus) == count, visible
    assert visible_nvidia_gpus(str(tmp_path / "no-driver")) == 0


def test_auto_is_host_memory_only_where_no_gpu_is_usable(gpus, tmp_path, monkeypatch):
    none, kfd = str(tmp_path / "no-driver"), str(tmp_path / "kfd")
    assert device_in_ram("auto", none, kfd)
    assert not device_in_ram("auto", gpus, kfd)
    assert device_in_ram("cpu", gpus, kfd) and not device_in_ram("cuda", none, kfd)
    (tmp_path / "kfd").touch()                 # AMD's driver: torch's cuda is ROCm
    assert not device_in_ram("auto", none, kfd)
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert device_in_ram("auto", gpus, kfd), hidden
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not device_in_ram("auto", gpus, str(tmp_path / "no-kfd"))
