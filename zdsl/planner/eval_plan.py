"""What ``zdsl plan`` says of a schedule's evaluation (``eval``): one line, or its JSON.

The evaluation graph (``zdsl/compile/eval_graph.py``) is simulated as the step is: its
predicted time per eval batch and per evaluation (K batches), and its peak memory per
tier, which counts the training's model states it keeps allocated beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

from zdsl.compile.eval_graph import eval_peak
from zdsl.ir import TIERS, TaskGraph
from zdsl.lang.sizes import human_bytes
from zdsl.planner.report import fmt_s


@dataclass
class EvalPlan:
    every: int
    batches: int
    ops: int
    batch_s: float                  # one eval batch, predicted
    peak: dict[str, int]            # tier -> bytes (with the training states held beside it)

    @property
    def eval_s(self) -> float:
        return self.batch_s * self.batches

    def to_json(self) -> dict:
        return {"every": self.every, "batches": self.batches, "ops": self.ops, "predicted_batch_s": self.batch_s,
                "predicted_eval_s": self.eval_s, "peak": self.peak}

    def line(self) -> str:
        peak = "  ".join(f"{tier} {human_bytes(self.peak[tier])}" for tier in TIERS if self.peak.get(tier))
        return (f"eval every {self.every} steps, {self.batches} batch{'es' if self.batches != 1 else ''}: "
                f"forward-only graph of {self.ops:,} ops, predicted {fmt_s(self.eval_s)} "
                f"({fmt_s(self.batch_s)} a batch); peak {peak}")


def eval_plan(train: TaskGraph, evaluation: TaskGraph, schedule, sim) -> EvalPlan:
    """The plan of a compiled evaluation (``Compiled.eval_graph`` and ``eval_sim``)."""
    return EvalPlan(every=schedule.eval.every, batches=schedule.eval.batches, ops=len(evaluation.ops),
                    batch_s=sim.step_s, peak=eval_peak(train, evaluation, sim))
