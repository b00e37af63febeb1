"""The engine between steps: full parameters, the state dict, checkpoints.

Every function here is called by every rank together, between steps (after ``engine.step()``,
before the next ``engine(x)``): each all-gathers sharded units on the default group, which the
step graph leaves idle then.

Checkpoints are ``zdsl run``'s (``runtime/checkpoint/``): ``FOLDER/step-N`` with one file per
rank and an index written last, so ``zdsl run --resume``, ``zdsl inspect`` and ``zdsl export``
read them, and a load re-cuts them to any rank count. ``client_state`` (any picklable dict, as
DeepSpeed's) is written by rank 0 into the step folder as ``client_state.pt`` before the index,
so a checkpoint with an index has it; a load returns it (``{}`` when there is none). It is
unpickled (``torch.load(weights_only=False)``): load only checkpoints you trust.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from zdsl.runtime.checkpoint import checkpoint_path
from zdsl.runtime.checkpoint.index import INDEX_NAME
from zdsl.runtime.checkpoint.writer import write_atomic
from zdsl.runtime.state.flat import alloc_storage, free_storage, is_freed

CLIENT_STATE = "client_state.pt"


@contextlib.contextmanager
def gathered(engine):
    """Each unit's full parameters in the model's own tensors, on every rank, for the ``with``."""
    call = "engine.gathered()"
    engine._agree(call, 0, engine._between_steps(call))
    full = engine.run.state.export_state()
    state = engine.run.state
    lent = []
    with torch.no_grad():
        for u, fp in enumerate(state.flats):
            if not is_freed(fp.full):
                continue          # held whole between steps (stages 0-2 on the device): already current
            alloc_storage(fp.full)
            lent.append(fp)
            for name, p in zip(state.param_names[u], fp.params):
                p.data.copy_(full[name])
    try:
        yield
    finally:
        for fp in lent:
            free_storage(fp.full)


def state_dict(engine) -> dict:
    call = "engine.state_dict()"
    engine._agree(call, 0, engine._between_steps(call))
    full = engine.run.state.export_state()
    return full if engine.rank == 0 else {}


def save_checkpoint(engine, folder, client_state: dict | None) -> Path:
    """Write the checkpoint of ``engine.global_step`` steps; its step folder."""
    from zdsl.runtime.checkpoint.checkpointer import Checkpointer
    call = "engine.save_checkpoint()"
    run = engine.run
    step_dir = checkpoint_path(folder, engine.global_step)
    problem = engine._between_steps(call)
    if problem is None and (step_dir / INDEX_NAME).exists():
        problem = (f"rank {engine.rank}: {call}: {step_dir} is already a checkpoint of step {engine.global_step}; "
                   f"save after another step, or into another folder")
    if problem is None and client_state is not None and not isinstance(client_state, dict):
        problem = f"rank {engine.rank}: {call}: client_state must be a dict, got {type(client_state).__name__}"
    saver = None
    if problem is None:
        try:    # rank 0 clears half-written steps here, before the others write
            saver = Checkpointer(str(folder), 0, 0, run.graph, run.units, run.rank, run.world, say=engine_say(engine))
        except OSError as exc:
            problem = f"rank {engine.rank}: {call}: cannot write under {folder}: {exc}"
    engine._agree(call, 0, problem)
    assert saver is not None        # made, or the agreement raised its problem
    try:
        if engine.rank == 0 and client_state is not None:
            step_dir.mkdir(parents=True, exist_ok=True)
            buffer = io.BytesIO()
            torch.save(client_state, buffer)
            write_atomic(step_dir / CLIENT_STATE, buffer.getvalue())
        saver.save(engine.global_step, run.state)
        saver.wait()
    except Exception as exc:        # noqa: BLE001 - an unpicklable client_state, a full disk: said, shared
        problem = f"rank {engine.rank}: {call}: {type(exc).__name__}: {exc}"
    engine._agree(call, 0, problem)     # every rank returns once the index is written, or raises
    return step_dir


def load_checkpoint(engine, folder) -> tuple[str, dict]:
    """Load the newest complete checkpoint under ``folder`` (or the step folder ``folder``); its step
    folder and ``client_state``, the pair DeepSpeed's ``load_checkpoint`` returns."""
    from zdsl.runtime.checkpoint.checkpointer import resume
    call = "engine.load_checkpoint()"
    engine._agree(call, 0, engine._between_steps(call))
    run = engine.run
    next_step = resume(str(folder), run.graph, run.state, run.rank, run.world, engine_say(engine))
    engine.global_step = next_step
    direct = Path(folder) / INDEX_NAME
    step_dir = Path(folder) if direct.exists() else checkpoint_path(folder, next_step)
    saved = step_dir / CLIENT_STATE
    return str(step_dir), torch.load(saved, weights_only=False) if saved.exists() else {}


def engine_say(engine):
    """What the checkpoint code says, printed once (rank 0) as ``zdsl run`` prints it."""
    def say(text: str) -> None:
        if engine.rank == 0:
            print(f"zdsl: {text}", flush=True)
    return say
