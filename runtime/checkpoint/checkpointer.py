"""Checkpoints during a run: save every N steps without stalling, resume from the newest complete one.

Saving copies this rank's shards to host memory at a step boundary (the
only part on the critical path), then a writer thread puts them on disk
while the next steps compute; rank 0's thread writes the index once every
rank's file is done, then applies retention. A checkpoint is named by the
number of steps it completed, so resuming from ``step-000030`` runs step 30
next, with the data position that step would have had.

The storage format, atomic writes, re-cutting to another rank count and
damage checks are ``runtime/checkpoint/``; this module only drives them.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from zdsl.ir import TaskGraph
from zdsl.model.layout import FlatLayout, unit_layout
from zdsl.runtime.checkpoint import (
    CheckpointError,
    Index,
    apply_retention,
    checkpoint_path,
    latest_complete,
    load_for_rank,
    parse_shard_key,
    read_index,
    remove_incomplete,
    unit_metas,
    write_index,
    write_rank_shards,
)
from zdsl.runtime.checkpoint.export import BUFFER_PREFIX

RNG_KEY = "rng.torch"
CUDA_RNG_KEY = "rng.cuda"       # the rank's CUDA device's generator (dropout on the GPU)


@dataclass
class SaveCost:
    step: int
    blocking_s: float        # time the training loop waited (copy to host, previous save)
    writing_s: float = 0.0   # time the writer thread spent (overlapped with training)
    bytes: int = 0


def graph_layouts(graph: TaskGraph) -> list[FlatLayout]:
    """Each unit's layout, a shard per rank of its shard group (every rank; HSDP's node, MiCS's group)."""
    return [unit_layout(u, graph.shard_ranks()) for u in graph.units]


def replica_shards(shards: dict, rank: int, graph: TaskGraph) -> dict:
    """What ``rank`` writes of its ``shards``: all of them on the first replica of each shard (ranks
    below the shard group's size), only its per-rank state (random state, buffers) on the others,
    so a checkpoint holds each shard once, in the one format a flat run writes."""
    if rank < graph.shard_ranks():
        return shards
    return {key: t for key, t in shards.items() if parse_shard_key(key) is None}


def data_position(graph: TaskGraph, next_step: int) -> dict:
    """Where the data stands: the next step, and what fixes each step's samples (runtime/data: the
    seed, the data source and the global batch; how ranks and micro-batches split it does not matter)."""
    train = graph.config.get("train", {})
    return {"next_step": next_step, "seed": train.get("seed"), "data": graph.config.get("data"),
            "samples_per_step": graph.ranks * train.get("batch", 0) * train.get("accumulate", 0)}


def data_order_note(saved: dict, graph: TaskGraph) -> str | None:
    """Why the steps after a resume will not see the samples an uninterrupted run would, or None."""
    now = data_position(graph, saved.get("next_step", 0))
    changed = []
    if "seed" in saved and saved["seed"] != now["seed"]:
        changed.append(f"seed {saved['seed']} -> {now['seed']}")
    if "samples_per_step" in saved and saved["samples_per_step"] != now["samples_per_step"]:
        changed.append(f"global batch (ranks x batch x accumulate) {saved['samples_per_step']} -> "
                       f"{now['samples_per_step']}")
    if "data" in saved and saved["data"] != now["data"]:
        changed.append("another data source")
    if not changed:
        return None
    return (f"{'; '.join(changed)}: from step {now['next_step']} on, the samples are not the ones the "
            f"checkpointed run would have seen next (the same seed, data and global batch, split over any "
            f"ranks and micro-batches, keeps them)")


class Checkpointer:
    def __init__(self, root: str, every: int, keep: int, graph: TaskGraph, units, rank: int, world: int,
                 say=print):
        self.root = Path(root)
        self.every, self.keep = every, keep
        self.graph, self.units = graph, units
        self.rank, self.world = rank, world
        self.say = say
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.costs: list[SaveCost] = []
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_incomplete(self.root)   # a killed run's half-written step must not mix with ours

    def save(self, completed: int, state) -> None:
        """Copy shards to host now; write them in the background."""
        t0 = time.perf_counter()
        self.wait()
        shards = replica_shards(state.shard_state(), self.rank, self.graph)
        shards[RNG_KEY] = torch.get_rng_state()
        if state.device.type == "cuda":
            shards[CUDA_RNG_KEY] = torch.cuda.get_rng_state(state.device)
        shards.update({BUFFER_PREFIX + name: t for name, t in state.buffers().items()})
        meta = {
            "units": unit_metas(self.units, graph_layouts(self.graph), self.prefixes(state)),
            "ranks": self.world,
            "schedule_hash": self.graph.digest(),
            "data_position": data_position(self.graph, completed),
            "loss_scaler": state.scaler.__dict__.copy() if getattr(state.scaler, "enabled", False) else None,
            "aliases": dict(state.aliases),
            "extra": {"optimizer_steps": state.optimizer_steps(), "stage": self.graph.stage,
                      "precision": self.graph.precision, "optimizer": dict(state.opt_config),
                      "model": self.graph.config.get("model")},   # what export --format hf rebuilds
        }
        cost = SaveCost(completed, blocking_s=time.perf_counter() - t0,
                        bytes=sum(t.numel() * t.element_size() for t in shards.values()))
        self.costs.append(cost)
        self.thread = threading.Thread(target=self._write, args=(completed, shards, meta, cost),
                                       name=f"zdsl-checkpoint-{completed}", daemon=True)
        self.thread.start()

    def prefixes(self, state) -> list[str]:
        """Each unit's module path in the model's state dict (``blocks.3``), for export."""
        out = []
        for u, spec in enumerate(self.units):
            if not spec.params:
                out.append(f"units.{u}")
                continue
            full, local = state.param_names[u][0], spec.params[0][0]
            out.append(full[: -len(local) - 1] if full.endswith("." + local) else f"units.{u}")
        return out

    def _write(self, completed: int, shards: dict, meta: dict, cost: SaveCost) -> None:
        t0 = time.perf_counter()
        try:
            record = write_rank_shards(self.root, completed, self.rank, self.world, shards)
            if self.rank == 0:
                write_index(self.root, completed, meta, [record])
                if self.keep:
                    apply_retention(self.root, self.keep)
        except BaseException as exc:  # reported by the training loop at its next wait
            self.error = exc
        cost.writing_s = time.perf_counter() - t0

    def wait(self) -> None:
        """Let the previous save finish; raise what it hit."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            exc, self.error = self.error, None
            raise CheckpointError(f"rank {self.rank}: saving a checkpoint under {self.root} failed: {exc}")


def find_checkpoint(where: str, say=print) -> Path:
    """A step folder given directly, or the newest complete checkpoint under a root (falling back past
    damaged ones, and saying so)."""
    path = Path(where)
    if (path / "index.json").exists() or path.name.startswith("step-"):
        read_index(path)        # refuses a damaged one, naming the file
        return path
    found = latest_complete(path, verify=False, report=say)   # load_for_rank checks every byte it reads
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint to resume from")
    return found


def describe_optimizer(config: dict | None, moments) -> str:
    """``adamw(lr=0.003, ...)`` from a schedule's optimizer config; from the moments alone when a
    checkpoint did not record its optimizer."""
    if config:
        keep = [k for k in ("lr", "momentum", "weight_decay") if config.get(k)]
        return f"{config.get('kind', 'adamw')}({', '.join(f'{k}={config[k]:g}' for k in keep)})"
    names = set(moments)
    if {"exp_avg", "exp_avg_sq"} <= names:
        return "adamw or adam"
    return "sgd with momentum" if "momentum" in names else "sgd without momentum"


def optimizer_mismatch(path, index, shards: dict, state) -> str | None:
    """Why the checkpoint's optimizer state cannot continue this schedule's optimizer, or None."""
    saved = sorted({parsed[1] for key in shards if (parsed := parse_shard_key(key))   # any unit: a frozen
                    and parsed[1] != "param"})                                       # one holds none
    wanted = sorted(state.moment_names())
    if saved == wanted:
        return None
    recorded = index.extra.get("optimizer")
    held, asked = describe_optimizer(recorded, saved), describe_optimizer(state.opt_config, wanted)
    same = f"--set optimizer='{held}'" if recorded else "the optimizer that wrote it"
    return (f"checkpoint {path} holds the state of {held} ({', '.join(saved) or 'none'}); this schedule's "
            f"{asked} needs {', '.join(wanted) or 'none'}. Resume with {same}, or add --fresh-optimizer to "
            f"start {asked}'s state from zero with the checkpoint's weights")


def _agreed_checkpoint(where: str, graph: TaskGraph, rank: int, world: int,
                       say: Callable[[str], None]) -> tuple[Path, Index, dict[str, torch.Tensor]]:
    """The checkpoint to resume from, its index and this rank's shards: ``where`` itself, or the newest
    checkpoint under the root ``where`` that every rank could read its part of (saying why one was
    passed over)."""
    root = Path(where)
    direct = (root / "index.json").exists() or root.name.startswith("step-")
    before = None
    while True:
        path: Path | None = None
        index: Index | None = None
        found: tuple[Path, Index, dict[str, torch.Tensor]] | None = None
        problem = ""
        try:
            path = find_checkpoint(where, say) if direct else \
                latest_complete(root, verify=False, before=before, report=say)   # said once, by rank 0
            if path is None:
                raise CheckpointError(f"{root}: no complete checkpoint to resume from")
            index = read_index(path)
            found = path, index, load_for_rank(path, rank, world, graph_layouts(graph))
        except CheckpointError as exc:
            problem = str(exc)
        problems: list[str] = [""] * world
        dist.all_gather_object(problems, problem)
        bad = next((p for p in problems if p), "")
        if found is not None and not bad:    # no problem anywhere: this rank found its part too
            return found
        if direct or path is None or index is None:
            raise CheckpointError(bad)
        say(f"checkpoint {path} refused: {bad}; falling back to an older one")
        before = index.step


def resume(where: str, graph: TaskGraph, state, rank: int, world: int, say: Callable[[str], None] = print,
           fresh_optimizer: bool = False) -> int:
    """Load the checkpoint into ``state`` (re-cut to this run's ranks and layout); the next step to run.

    ``where`` is a step folder, or a root whose newest complete checkpoint is used. The ranks agree
    that every one of them could read its part; if one could not (a damaged file), all of them fall
    back to the next older checkpoint under the root, and say why. ``fresh_optimizer``: take only
    the weights and start the optimizer's state (moments, step count) from zero; without it, a
    checkpoint whose optimizer state is not the schedule's optimizer's is refused."""
    path, index, shards = _agreed_checkpoint(where, graph, rank, world, say)
    if index.ranks != world:
        say(f"resuming {path} (written by {index.ranks} ranks) on {world} ranks: shards re-cut")
    note = data_order_note(index.data_position, graph)
    if note:
        say(f"note: {note}")
    rng, cuda_rng = shards.pop(RNG_KEY, None), shards.pop(CUDA_RNG_KEY, None)
    state.load_buffers({k[len(BUFFER_PREFIX):]: shards.pop(k) for k in list(shards) if k.startswith(BUFFER_PREFIX)})
    steps = int(index.extra.get("optimizer_steps", index.data_position.get("next_step", index.step)))
    if fresh_optimizer:
        say(f"--fresh-optimizer: the weights of {path}, {describe_optimizer(state.opt_config, ())}'s state "
            f"from zero (the checkpoint's optimizer state is not used)")
        state.load_shard_state(shards, 0, moments=False)
    else:
        problem = optimizer_mismatch(path, index, shards, state)
        if problem:
            raise CheckpointError(problem)
        state.load_shard_state(shards, steps)
    if index.loss_scaler and getattr(state.scaler, "enabled", False):
        for key, value in index.loss_scaler.items():
            setattr(state.scaler, key, value)
    if rng is not None:
        torch.set_rng_state(rng.clone())   # a view into a shared read buffer crashes set_rng_state
    if cuda_rng is not None and state.device.type == "cuda":
        torch.cuda.set_rng_state(cuda_rng.clone(), state.device)
    return int(index.data_position.get("next_step", index.step))


__all__ = ["Checkpointer", "SaveCost", "checkpoint_path", "find_checkpoint", "resume"]
