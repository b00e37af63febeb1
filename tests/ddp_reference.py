"""Plain data-parallel training (torch DDP) of the built-in GPT: the reference.

The same model (``GPT(..., seed=seed)``), the same batches
(``zdsl.runtime.data.make_batch`` as a ``Batch``, or a test's own ``make``:
positions, masks, labels with -100), the same torch optimizer
(``zdsl.runtime.state.optim.make_torch_optimizer``), clipping with
``clip_grad_norm_``, gradient accumulation with ``no_sync`` and the loss
divided by ``accumulate``. zdsl must reproduce its parameters (bitwise where
the reduction order is the same). Also :func:`spawn`, which runs a function
on N gloo ranks in fresh processes (``runtime/dist/spawn.py``) and returns each
rank's result, and :func:`run_steps`, zdsl's side of the comparisons.
"""
from __future__ import annotations

import contextlib
import copy
import inspect

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zdsl.runtime.data import make_batch
from zdsl.runtime.dist.group import init_group, leave_group
from zdsl.runtime.dist.spawn import run_ranks
from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.batch import as_batch
from zdsl.runtime.models.gpt import GPT
from zdsl.runtime.state.optim import make_torch_optimizer


def default_batch(data, seed: int, step: int, micro: int, rank: int, world: int, batch: int) -> Batch:
    """The micro-batch ``zdsl run`` trains on: the data source's ``(idx, targets)``."""
    return as_batch(make_batch(data, seed, step, micro, rank, world, batch))


def ddp_train(model_kw: dict, data, *, seed: int, steps: int, batch: int, accumulate: int,
              optimizer: dict, rank: int, world: int, build=None,
              norms: list | None = None, make=default_batch,
              frozen=frozenset()) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train with DDP inside an initialised process group; returns (final fp32 params, losses).

    ``build()``: the model instead of ``GPT(**model_kw, seed=seed)`` (a user's model, built
    from the run's seed). ``norms``: a list that gets each step's ``clip_grad_norm_`` total.
    ``make``: each micro-batch, called as :func:`default_batch` (give zdsl's side the same).
    ``frozen``: parameter names set to ``requires_grad=False`` (fine-tuning, torch's way)."""
    model = build() if build is not None else GPT(**model_kw, seed=seed)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    ddp = DDP(model)
    opt = make_torch_optimizer(model.parameters(), optimizer)
    clip = optimizer.get("clip")
    losses = []
    for step in range(steps):
        loss = _micro_batches(ddp, data, seed, step, rank, world, batch, accumulate, make=make)
        if clip is not None:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(float(total))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _micro_batches(ddp, data, seed: int, step: int, rank: int, world: int, batch: int, accumulate: int,
                   scale: float | None = None, make=default_batch) -> torch.Tensor:
    """One step's forward and backward over its micro-batches, gradients reduced on the last one
    only (``no_sync`` before it), the loss divided by ``accumulate`` (and its gradient multiplied
    by ``scale``, fp16's loss scale); returns the step's mean loss. The model runs as a plain
    module, through its own ``forward``: ``forward(batch)`` when that takes one argument, else
    ``forward(input_ids, labels)``."""
    required = [p for p in inspect.signature(ddp.module.forward).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    batch_form = len(required) == 1
    losses = []
    for micro in range(accumulate):
        b = make(data, seed, step, micro, rank, world, batch)
        sync = contextlib.nullcontext() if micro == accumulate - 1 else ddp.no_sync()
        with sync:
            loss = ddp(b) if batch_form else ddp(b.input_ids, b.labels)
            scaled = loss / accumulate if accumulate > 1 else loss
            if scale is None:
                scaled.backward()
            else:
                scaled.backward(torch.tensor(scale, dtype=scaled.dtype))
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def fp16_train(model_kw: dict, data, *, seed: int, steps: int, batch: int, accumulate: int, optimizer: dict,
               rank: int, world: int, scale: float = 2.0 ** 16, growth_interval: int = 2000
               ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """fp16 mixed precision the textbook way, on DDP: returns (final fp32 master params, per step
    ``loss``, ``grad_norm`` (of the unscaled gradients), ``skipped``, ``loss_scale`` (after the
    step's update: the next step's scale)).

    DDP trains an fp16 copy of the model; the loss is multiplied by the loss scale before
    backward; the fp16 gradients (averaged by DDP) are checked for inf/nan, and on overflow the
    step is skipped and the scale halved (never below 1); otherwise they become fp32 gradients of
    an fp32 master copy, divided by the scale, clipped with ``clip_grad_norm_``, stepped by the
    torch optimizer, and the master is copied back into the fp16 model. ``growth_interval``
    clean steps in a row double the scale. As torch.amp's GradScaler, written out: GradScaler
    refuses fp16 gradients."""
    master = GPT(**model_kw, seed=seed)
    model = copy.deepcopy(master).half()
    ddp = DDP(model)
    masters, halves = list(master.parameters()), list(model.parameters())
    opt = make_torch_optimizer(masters, optimizer)
    clip = optimizer.get("clip")
    clean, out = 0, []
    for step in range(steps):
        row = {"loss": float(_micro_batches(ddp, data, seed, step, rank, world, batch, accumulate, scale))}
        overflow = not all(bool(torch.isfinite(h.grad).all()) for h in halves)
        if overflow:
            scale, clean = max(scale * 0.5, 1.0), 0
            row.update(skipped=True, grad_norm=None)
        else:
            for m, h in zip(masters, halves):
                m.grad = h.grad.float() * (1.0 / scale)
            if clip is not None:
                row["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(masters, clip))
            else:
                row["grad_norm"] = float(torch.nn.utils.get_total_norm([m.grad for m in masters]))
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m, h in zip(masters, halves):
                    h.copy_(m)
            row["skipped"] = False
            clean += 1
            if clean >= growth_interval:
                scale, clean = scale * 2.0, 0
        model.zero_grad(set_to_none=True)
        row["loss_scale"] = scale      # the next step's
        out.append(row)
    return {n: p.detach().clone() for n, p in master.named_parameters()}, out


def run_steps(graph, state, schedule, rank: int, world: int, make=default_batch) -> list[dict]:
    """zdsl's side, as ``zdsl run`` trains: the trio executor (compute in lane worker threads,
    collectives in flight beside them) over the schedule's steps; each step's ``step_end()``.
    ``make``: each micro-batch, as for :func:`ddp_train`."""
    import trio

    from zdsl.runtime.exec.executor import Executor
    executor = Executor(graph, state, rank)
    t = schedule.train

    async def loop():
        rows = []
        for step in range(t.steps):
            state.step_begin(step, [make(schedule.data, t.seed, step, m, rank, world, t.batch)
                                    for m in range(t.accumulate)])
            await executor.run_step()
            rows.append(state.step_end())
        return rows

    return trio.run(loop)


GROUP_TIMEOUT_S = 300.0   # a collective waiting longer fails the test instead of hanging it


def _in_group(rank: int, world: int, fn, args: tuple):
    torch.set_num_threads(1)
    try:
        init_group(rank, world, torch.device("cpu"), GROUP_TIMEOUT_S)   # rendezvous: the spawner's rank variables
        return fn(rank, world, *args)
    finally:
        leave_group()


def spawn(fn, world: int, *args):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; a list of the results by rank.
    A rank that fails raises ``RankFailed`` (a RuntimeError) with its traceback.

    ``fn`` must be importable (a module-level function)."""
    return run_ranks(_in_group, world, fn, args)
