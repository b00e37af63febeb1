"""What this machine is, as zdsl keys and checks what it measured: its device, usable cores, installed torch.

Torch-free: torch's version is read from its metadata, the GPUs from the kernel's files.
"""
from __future__ import annotations

import importlib.metadata
import os

from zdsl import env


def device_in_ram(device: str) -> bool:
    """Whether the schedule's device tier is host memory: ``on cpu``, or ``auto`` with no GPU here."""
    if device == "cpu":
        return True
    if device == "cuda":
        return False
    visible = env.raw("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return True
    try:
        gpus = os.listdir("/proc/driver/nvidia/gpus")
    except OSError:
        gpus = []
    return not gpus and not os.path.exists("/dev/kfd")   # kfd: ROCm, which torch also calls cuda


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
