"""The executor's own cost per op: a real compiled graph run against a state whose ops do nothing.

What remains is dispatch: awaiting deps, thread hand-offs for compute, copy
and nvme lanes, watcher tasks for collectives. Target: under 50 us per op on
CPU. Prints the median over steps.

    python benchmarks/executor_overhead.py [--layers 48] [--steps 20]
"""
from __future__ import annotations

import argparse
import statistics

import trio

from zdsl.driver import compile_schedule
from zdsl.runtime.exec.executor import Executor
from zdsl.schedule import Placement
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec
from zdsl.model.units import gpt_units


class DoneWork:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class NullState:
    """Every op returns at once: what the executor costs by itself."""

    def run_compute(self, op):
        pass

    def start_collective(self, op):
        return DoneWork()

    def run_copy(self, op):
        pass

    def run_nvme(self, op):
        pass

    def free(self, op):
        pass


def measure(schedule: Schedule, layers: int, steps: int) -> tuple[int, float]:
    graph = compile_schedule(schedule, gpt_units(layers=layers, width=64, heads=4, vocab=256, context=32))
    executor = Executor(graph, NullState(), rank=0, record=True)

    async def run():
        times = []
        for _ in range(steps):
            rec = await executor.run_step()
            times.append(rec.seconds)
        return times

    times = trio.run(run)
    return len(graph.ops), statistics.median(times[2:] or times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cases = {
        "zero 3": Schedule("zero3", ranks=2, stage=3, train=TrainSpec(batch=1)),
        "zero 3, optimizer + params on nvme": Schedule(
            "nvme", ranks=2, stage=3, train=TrainSpec(batch=1),
            placement={"optimizer": Placement("nvme", "/tmp/x"), "parameters": Placement("nvme", "/tmp/x")}),
        "zero 1, accumulate 4": Schedule("zero1", ranks=2, stage=1, train=TrainSpec(batch=1, accumulate=4)),
    }
    print(f"{'schedule':40s} {'ops':>6s} {'step ms':>9s} {'us/op':>7s}")
    worst = 0.0
    for name, s in cases.items():
        n, t = measure(s, args.layers, args.steps)
        per = t / n * 1e6
        worst = max(worst, per)
        print(f"{name:40s} {n:6d} {t * 1e3:9.2f} {per:7.1f}")
    print(f"executor overhead: {worst:.1f} us/op (target < 50)")


if __name__ == "__main__":
    main()
