"""Joining and leaving the process group: the one rank start-up of `zdsl run`, calibrate, tests and
the Python API (which joins from the launcher's variables, or alone, when the script has not); and
the process groups of a graph's collectives (:class:`CollectiveGroups`)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from zdsl import env
from zdsl.ir import ALL, group_members
from zdsl.runtime.dist import shm
from zdsl.runtime.dist.affinity import calm_gloo_loops
from zdsl.runtime.dist.spawn import MASTER_ADDR, free_port


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
    device_id = device if backend == "nccl" and device.type == "cuda" else None
    dist.init_process_group(backend=backend, rank=rank, world_size=world, init_method=init_method,
                            timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)
    if backend == "gloo":
        calm_gloo_loops()


class CollectiveGroups:
    """One process group per distinct group of a graph's collectives (``Op.group``, ``zdsl.ir``):
    ``of(name)`` is the one holding this rank; "all" is the default group (None).

    c10d's ``new_group`` is a collective over every rank, members or not, so every rank creates
    every instance of every group (``within:2`` at 8 ranks: {0,1}, {2,3}, {4,5}, {6,7}), in one
    order: the names sorted, each name's instances by their lowest rank. Created once, before the
    first step, with the default group's timeout: a dead peer fails a subgroup's collective as
    soon as the default group's."""

    def __init__(self, names, rank: int, world: int):
        self.rank, self.world = rank, world
        self.by_name: dict[str, object] = {ALL: None}
        wanted = sorted(set(names) - {ALL})
        if not wanted:
            return
        timeout = datetime.timedelta(seconds=shm.group_timeout(dist.group.WORLD))
        for name in wanted:
            for members in group_members(name, world):
                made = dist.new_group(members, timeout=timeout)
                if rank in members:
                    self.by_name[name] = made
        if dist.get_backend() == "gloo":
            calm_gloo_loops(wait_s=0.1)       # the new groups' event-loop threads too

    @classmethod
    def of_graph(cls, graph, rank: int, world: int) -> "CollectiveGroups":
        """The groups ``graph``'s collectives run over, and its shards' (checkpoints and exports
        gather within the shard group even where no op of a step does)."""
        names = {op.group for op in graph.ops if op.is_collective} | {graph.shard_group()}
        secondary = graph.secondary_group()
        return cls(names | ({secondary} if secondary else set()), rank, world)

    def of(self, name: str):
        """The process group of this rank's instance of ``name`` (None: the default group)."""
        try:
            return self.by_name[name]
        except KeyError:
            raise ValueError(f"rank {self.rank}: no process group was made for {name!r}") from None


def leave_group() -> None:
    """Destroy the default process group if this process joined one, and its shared-memory pair."""
    shm.release_all()
    if dist.is_initialized():
        dist.destroy_process_group()


def launched_rank() -> tuple[int, int] | None:
    """This process's (rank, world): the default group's where one is joined, else the launcher's
    variables (torchrun's, ``zdsl run``'s: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else None
    (a plain ``python script.py``)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = env.raw("RANK"), env.raw("WORLD_SIZE")
    if rank is not None and world is not None and env.raw("MASTER_ADDR") is not None \
            and env.raw("MASTER_PORT") is not None:
        return int(rank), int(world)
    return None


def join_alone(device: torch.device, timeout_s: float) -> None:
    """A group of this process alone (a plain ``python script.py`` of a one-rank schedule), its
    rendezvous on a free loopback port."""
    init_group(0, 1, device, timeout_s, init_method=f"tcp://{MASTER_ADDR}:{free_port()}")
