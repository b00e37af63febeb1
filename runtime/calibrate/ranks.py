"""A process joining ``zdsl calibrate``'s group as one of its ranks, as a run's rank joins."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from zdsl.runtime.calibrate.measure import Settings
from zdsl.runtime.dist.affinity import _thread_ids, set_cpu_threads
from zdsl.runtime.dist.spawn import MASTER_ADDR


@dataclass
class Joined:
    device: object          # torch.device the rank measures on
    threads: int            # its torch threads
    unbound: set[int] | None   # the process's cores before it was bound to its share
    slots: int              # collectives the backend runs at once (zdsl.runtime.dist.collectives.comm_slots)


def device_for(rank: int, backend: str):
    import torch
    if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


@contextlib.contextmanager
def joined(rank: int, world: int, port: int, s: Settings, backend: str):
    """This process as rank ``rank`` of ``world``: on its device, bound to its share of the cores
    with their threads (as ``zdsl run`` binds a rank), in the group at ``port``. On exit the group
    is left and the process has its cores and torch threads back: ranks it spawns later would
    otherwise inherit its share and bind within it (two ranks on one core, every step 2x)."""
    import torch
    threads_before = torch.get_num_threads()
    device = device_for(rank, s.backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    unbound = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if device.type == "cpu":
        threads = set_cpu_threads(rank, world)
    else:
        threads = max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
    # joined as a run's rank joins (gloo's loop threads calmed); at one rank too, since the
    # reference step's collectives run on the group as a one-rank run's do
    from zdsl.runtime.dist.group import init_group, leave_group
    init_group(rank, world, device, s.timeout_s, backend=backend, init_method=f"tcp://{MASTER_ADDR}:{port}")
    try:
        from zdsl.runtime.dist.collectives import comm_slots
        yield Joined(device, threads, unbound, comm_slots())
    finally:
        leave_group()
        torch.set_num_threads(threads_before)
        restore_cores(unbound)


def restore_cores(cores: set[int] | None) -> None:
    """Give every thread of this process back the cores it had: rank 0 measures in the caller's
    process and binds it to its share, which left a caller (a test session) on one core."""
    if cores is None:
        return
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass                 # a thread that has just ended
