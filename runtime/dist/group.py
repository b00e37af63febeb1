"""Joining and leaving the process group: the one rank start-up of `zdsl run`, calibrate and tests."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from zdsl.runtime.dist import shm
from zdsl.runtime.dist.affinity import calm_gloo_loops


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(rank: int, world: int, device: torch.device, timeout_s: float, *,
               backend: str | None = None, init_method: str | None = None) -> None:
    """Join the default process group as ``rank`` of ``world``.

    The backend is ``backend_for(device)`` unless given; rendezvous is ``init_method``, else the
    environment (MASTER_ADDR, MASTER_PORT). A collective that waits longer than ``timeout_s``
    fails (a dead peer). With gloo, its event-loop threads are calmed as every rank runs them
    (:func:`~zdsl.runtime.dist.affinity.calm_gloo_loops`).
    """
    backend = backend or backend_for(device)
    kwargs = dict(backend=backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    if init_method is not None:
        kwargs["init_method"] = init_method
    if backend == "nccl" and device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    if backend == "gloo":
        calm_gloo_loops()


def leave_group() -> None:
    """Destroy the default process group if this process joined one, and its shared-memory pair."""
    shm.release_all()
    if dist.is_initialized():
        dist.destroy_process_group()
