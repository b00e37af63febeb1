"""Steps of a graph run under the happens-before checker on this CPU rank, as ``zdsl run`` runs them
with ``ZDSL_HB_CHECK=1`` (the checker itself: ``runtime/exec/hb_check.py``), with the schedule's
evaluation between them where an evaluation graph is given."""
from __future__ import annotations

import torch
import trio

from zdsl.ir import TaskGraph
from zdsl.runtime.data import make_batch
from zdsl.runtime.exec.executor import Executor
from zdsl.runtime.exec.hb_check import HBChecker
from zdsl.runtime.models.batch import as_batch
from zdsl.runtime.models.protocol import build_model
from zdsl.runtime.proc.guard import run_stoppable
from zdsl.runtime.run.evaluate import Evaluator
from zdsl.runtime.state.rank import RankState


def check_steps(graph: TaskGraph, schedule, rank: int = 0, world: int = 1, steps: int = 1,
                record_streams: bool = True, seen_as: TaskGraph | None = None,
                eval_graph: TaskGraph | None = None) -> HBChecker:
    """Run ``steps`` steps of ``graph`` on this CPU rank (its process group joined) under the
    checker, as ``zdsl run`` would with ``ZDSL_HB_CHECK=1``; raises :class:`HBRaceError` at the
    first step with a race. ``seen_as``: the graph the checker orders by, if not ``graph``.
    ``eval_graph``: the schedule's evaluation (``schedule.eval``), run where ``zdsl run`` runs it."""
    train = graph.config["train"]
    torch.manual_seed(train["seed"])
    model = build_model(schedule.model, seed=train["seed"], lazy=True)
    state = RankState(graph, model, rank=rank, world=world, device=torch.device("cpu"))
    try:
        with HBChecker(seen_as or graph, state, rank, record_streams) as checker:
            executor = Executor(graph, state, rank, streams=checker)
            evaluator = None if eval_graph is None else Evaluator(
                eval_graph, schedule.eval, state, seed=train["seed"], rank=rank, world=world, batch=train["batch"],
                device=torch.device("cpu"), make_batch=make_batch, run_streams=checker)
            for step in range(steps):
                batches = [as_batch(make_batch(schedule.data, train["seed"], step, m, rank, world, train["batch"]))
                           for m in range(train["accumulate"])]
                state.step_begin(step, batches)
                trio.run(run_stoppable, executor.run_step)
                state.step_end()
                if evaluator is not None and evaluator.due(step, steps):
                    trio.run(evaluator.run, step)
    finally:
        state.close_swap()
    return checker
