"""``eval every N steps on SOURCE batches=K``: the validation loss, on the training's own buffers.

After step ``s`` with ``(s + 1) % N == 0``, and after the last step, every rank runs the
schedule's forward-only graph (``zdsl/compile/eval_graph.py``) once per eval batch, with its
own executor, on the same :class:`~zdsl.runtime.state.rank.RankState`: the same parameter
shards on the same tiers, gathered, copied and read as the training forward does.

* Eval batch ``i`` of rank ``r`` is ``make_batch(SOURCE, seed, step=i, micro=0, r, world,
  batch)``: every evaluation sees the same K batches (so successive values compare the
  model, not the sample), the ranks together the same ``K * world * batch`` sequences.
* ``val_loss`` weighs every counted label the same, as one process would over the union of
  those sequences: the sum over batches and ranks of (a batch's loss x its counted labels,
  those not ``-100``), over the total count (one all-gather of two numbers per rank). A
  model's loss is taken as the mean over its counted labels, as ``causal_lm_loss`` and
  torch's losses compute it.
* Nothing of training changes: no gradient, no optimizer step, units in eval mode, the
  random generators put back (``RankState.evaluation``); the next step has the bits it
  would have had without evaluating.
"""
from __future__ import annotations

import torch

from zdsl.ir import TaskGraph
from zdsl.runtime.dist.collectives import all_gather
from zdsl.runtime.exec.errors import OpError
from zdsl.runtime.exec.executor import Executor
from zdsl.runtime.exec.hb_check import streams_for
from zdsl.runtime.models.batch import IGNORE_INDEX, Batch, as_batch


class EvalError(RuntimeError):
    """An op of the evaluation graph failed; names the rank, the op and the eval batch."""


class Evaluator:
    """Runs a schedule's evaluation on one rank; every rank calls :meth:`run` at the same steps."""

    def __init__(self, graph: TaskGraph, spec, state, *, seed: int, rank: int, world: int, batch: int,
                 device: torch.device, make_batch, run_streams=None):
        """``spec``: the schedule's ``EvalSpec`` (every, data, batches); ``make_batch``: the data
        sources' entry point (``runtime/data``); ``run_streams``: the training executor's stream
        seam (its happens-before checker orders this graph too)."""
        self.graph, self.spec, self.state = graph, spec, state
        self.seed, self.rank, self.world, self.batch, self.device = seed, rank, world, batch, device
        self.make_batch = make_batch
        # no progress board: the launcher reads it as the training graph's ops and collectives; no
        # injected fault (ZDSL_FAULT names a training op and step)
        self.executor = Executor(graph, state, rank, record=False,
                                 streams=streams_for(run_streams, graph, device, "evaluation"))
        self.executor.fault = None

    def due(self, step: int, steps: int) -> bool:
        """Whether an evaluation follows step ``step`` (0-based) of ``steps``."""
        return (step + 1) % self.spec.every == 0 or step == steps - 1

    def eval_batch(self, i: int) -> Batch:
        return as_batch(self.make_batch(self.spec.data, self.seed, i, 0, self.rank, self.world, self.batch))

    async def run(self, after_step: int) -> float:
        """The validation loss over the K eval batches of every rank (the same on every rank)."""
        total, count = 0.0, 0
        if self.device.type == "cuda":      # training's kernels on its own lane streams come first
            torch.cuda.synchronize(self.device)
        with self.state.evaluation():
            for i in range(self.spec.batches):
                b = self.eval_batch(i)
                self.state.eval_begin(b)
                try:
                    await self.executor.run_step()
                except OpError as exc:          # the op is the evaluation graph's: say so
                    raise EvalError(f"{exc} (evaluating after step {after_step + 1}, eval batch {i + 1} "
                                    f"of {self.spec.batches})") from exc
                loss = float(self.state.eval_end())
                n = counted(b.loss_labels())
                if n:
                    total += loss * n
                    count += n
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        mine = torch.tensor([total, float(count)], dtype=torch.float64, device=self.device)
        every = torch.empty(2 * self.world, dtype=torch.float64, device=self.device)
        all_gather(every, mine)
        rows = every.view(self.world, 2).cpu().tolist()
        total, count = sum(r[0] for r in rows), sum(r[1] for r in rows)    # in rank order: the same bits everywhere
        return total / count if count else float("nan")


def counted(labels: torch.Tensor) -> int:
    """Labels the loss counts: those not ``IGNORE_INDEX`` (every one for float targets)."""
    if labels.is_floating_point():
        return labels.numel()
    return int((labels != IGNORE_INDEX).sum())
