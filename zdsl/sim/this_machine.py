"""What this machine is, as zdsl keys and checks what it measured: its device, usable cores, installed torch.

Torch-free: torch's version is read from its metadata, the GPUs from the kernel's files.
"""
from __future__ import annotations

import importlib.metadata
import os

from zdsl import env

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"   # the NVIDIA driver's folder: one entry per GPU, its PCI address
ROCM_DRIVER = "/dev/kfd"                    # AMD's driver: torch calls ROCm devices cuda too


def nvidia_gpus(folder: str = NVIDIA_GPUS) -> list[str]:
    """The GPUs the NVIDIA driver found (their PCI addresses, sorted), every one: CUDA_VISIBLE_DEVICES is
    not applied (:func:`visible_nvidia_gpus` applies it); [] without the driver."""
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def cuda_visible_limit() -> int | None:
    """How many devices CUDA_VISIBLE_DEVICES leaves a process: its entries before the first -1 (CUDA
    ignores the rest), 0 where it is empty; None where it is unset (every device)."""
    visible = env.raw("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    listed = [d.strip() for d in visible.split(",") if d.strip()]
    return len(listed[:listed.index("-1")] if "-1" in listed else listed)


def visible_nvidia_gpus(folder: str = NVIDIA_GPUS) -> int:
    """The NVIDIA GPUs this machine's ranks may use: the driver's count narrowed by CUDA_VISIBLE_DEVICES."""
    count, limit = len(nvidia_gpus(folder)), cuda_visible_limit()
    return count if limit is None else min(count, limit)


def device_in_ram(device: str, gpus: str = NVIDIA_GPUS, kfd: str = ROCM_DRIVER) -> bool:
    """Whether the schedule's device tier is host memory: ``on cpu``, or ``auto`` with no GPU here
    (none in the drivers' folders, or CUDA_VISIBLE_DEVICES leaves none)."""
    if device == "cpu":
        return True
    if device == "cuda":
        return False
    if cuda_visible_limit() == 0:
        return True
    return not nvidia_gpus(gpus) and not os.path.exists(kfd)


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which its ranks share."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def installed_torch() -> str | None:
    """The installed torch's version (read from its metadata: torch is not imported), None without it."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
