"""The reference step of ``zdsl calibrate``: a tiny ZeRO-3 GPT trained through the real executor,
whose measured op times the planner's overhead fits (zdsl/planner/calibration_fit.py) invert."""
from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time

from zdsl.planner.calibration_fit import comm_intervals, comm_ops, comm_under_compute, lane_ops, wake_delays
from zdsl.planner.lanes import slots_of
from zdsl.schedule import MachineProfile
from zdsl.runtime.calibrate.measure import CalibrationError, Settings


# Reference steps (full, quick), ~10 ms each here. The host's speed moves from one half second to
# the next: 48 steps in one block put the reference 50% off the programs run beside it. A fresh
# run's first ten steps are slower than its later ones (10.2-14.8 ms against 9.0-9.5 here), so
# quick blocks of 6 steps after 2 put the reference 7% slow, median of eight rounds, against the
# same schedule run beside the programs (benchmarks/prediction_error.py's drift): now 16 after 4.
RUNTIME_STEPS = {False: 240, True: 60}
RUNTIME_BLOCKS = 3
# The unclipped reference (its steps run in the backward, each after its unit's reduce-scatter,
# without the norms' tail) is one block, right after this clipped one.
UNCLIPPED_AFTER_BLOCK = 1
WARM_UP_STEPS = 4
# A reference step this much slower than the machine's usual one (its cached calibrations' median)
# is taken in a slow spell: measured again in fresh ranks after a pause, up to REMEASURES times,
# and the fastest set kept (slow_spell.py). 12%: this host's usual speed moved 10% from one day to
# the next; the spells put the reference 15-30% slow.
SLOW_SPELL = 0.12
REMEASURES = 2
REMEASURE_PAUSE_S = 5.0


# The graph the per-op overhead is fitted on: small enough that fixed costs dominate. It clips
# gradients, as most recipes do (HF's max_grad_norm=1.0, DeepSpeed's gradient_clipping), so the fit
# covers the norm ops and the norm's all-reduce too: without them the costs fitted for a step's
# lane ops and collectives priced a clipped program's norms at a compute op's hand-off and its
# scalar all-reduce at a gathered unit's (programs/quickstart.zs, which is this with clip=1.0,
# planned 16-20% slow in three quiet rounds while the reference matched). Its step count only
# has to be valid: measure_runtime runs as many steps as each block needs.
REFERENCE = """schedule calibrate_reference "zdsl calibrate: a tiny ZeRO-3 step, what the runtime costs per op"
model     gpt(layers=2, width={width}, heads={heads}, vocab=256, context=32)
data      synthetic(vocab=256, context=32)
train     steps={steps}, batch=4, precision=fp32, seed=0
optimizer adamw(lr=1e-3{clip})
ranks     {ranks} on {device}
zero      3
"""


REFERENCE_WIDTH = 64
# The wide step: the reference at a width where a unit's forward and backward outweigh their
# kernels' fixed costs (2.6 and 5.5 ms against ~0.4 here), for ``compute_excess``; (full, quick)
# steps after WARM_UP_STEPS (29 ms a step here).
WIDE_WIDTH = 256
WIDE_STEPS = {False: 36, True: 12}


def reference_text(steps: int, ranks: int, device: str, width: int = REFERENCE_WIDTH, clip: bool = True) -> str:
    """The reference schedule's source at ``width``: heads 64 wide (as the compute test's block), at
    least the width-64 step's 4; without gradient clipping where ``clip`` is off."""
    return REFERENCE.format(steps=steps, ranks=ranks, device=device, width=width, heads=max(4, width // 64),
                            clip=", clip=1.0" if clip else "")


@functools.lru_cache(maxsize=None)
def reference_graph(ranks: int, device: str, width: int = REFERENCE_WIDTH, clip: bool = True):
    """The compiled reference schedule at ``width`` (unclipped where ``clip`` is off): once per
    process, for the runtime blocks and the fit alike (nothing that runs it changes it)."""
    from zdsl.driver import compile_file
    with tempfile.TemporaryDirectory(prefix="zdsl-calibrate-") as tmp:
        path = os.path.join(tmp, "reference.zs")
        with open(path, "w", encoding="utf-8") as f:
            f.write(reference_text(RUNTIME_STEPS[False], ranks, device, width, clip))
        compiled = compile_file(path, {}, simulate=False)
    if not compiled.ok:
        raise CalibrationError("the reference schedule does not compile: "
                               + "; ".join(d.message for d in compiled.diagnostics if d.is_error))
    return compiled


def measure_runtime(device, s: Settings, rank: int, world: int, steps: int, slots: int = 1,
                    width: int = REFERENCE_WIDTH, compute_cpu: bool = False, clip: bool = True) -> dict:
    """Step times of ``steps`` steps of the reference schedule at ``width`` (unclipped where
    ``clip`` is off) through the real executor (all ranks at once); ``slots``: collectives the
    backend runs at once (for their service times; a shared-memory pair runs one: ``slots_of``).
    ``compute_cpu``: each compute op's CPU time in its thread too (the wide step's, for
    ``compute_excess``; not the blocks' the overheads are fitted on, whose op times it would add to)."""
    import torch
    import trio

    from zdsl.runtime.data import make_batch
    from zdsl.runtime.exec.executor import Executor
    from zdsl.runtime.models.batch import as_batch
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState
    from zdsl.runtime.dist.collectives import all_gather
    from zdsl.runtime.exec.streams import lane_streams
    from zdsl.runtime.run.guard import run_stoppable
    compiled = reference_graph(world, device.type, width, clip)
    graph, schedule = compiled.graph, compiled.schedule
    state = RankState(graph, build_model(schedule.model, seed=0), rank=rank, world=world, device=device)
    executor = Executor(graph, state, rank, streams=lane_streams(graph, device))
    # each compute op's CPU time in its thread (not its wall time: the lane's thread also waits
    # for the core while other threads run, which the planner's sharing of the core prices)
    cpu_s: dict[int, list[float]] = {}
    if compute_cpu:
        run_compute = state.run_compute

        def timed_compute(op) -> None:
            begin = time.thread_time()
            run_compute(op)
            cpu_s.setdefault(op.id, []).append(time.thread_time() - begin)
        state.run_compute = timed_compute
    t = schedule.train
    # on the run's device: NCCL gathers only CUDA tensors (gloo takes CPU ones)
    mine = torch.zeros(8, device=device)
    gathered = torch.zeros(8 * world, device=device)

    loop_cpu: list[float] = []          # the event loop's (this thread's) CPU seconds in each step's ops

    async def loop() -> list:
        records = []
        for step in range(steps):
            batches = [as_batch(make_batch(schedule.data, t.seed, step, m, rank, world, t.batch)).to(device)
                       for m in range(t.accumulate)]
            state.step_begin(step, batches)
            begin = time.thread_time()
            records.append(await executor.run_step())
            loop_cpu.append(time.thread_time() - begin)
            state.step_end()
            if world > 1:                 # `zdsl run` gathers each step's metrics: ranks start aligned
                all_gather(gathered, mine)
        return records

    records = trio.run(run_stoppable, loop)[WARM_UP_STEPS:]    # the first steps allocate and warm up
    del state, executor
    if device.type == "cuda":
        torch.cuda.empty_cache()
    slots = slots_of(graph, MachineProfile(name=device.type, comm_slots=slots))
    intervals = [comm_intervals(graph, t, slots) for t in records]       # once a step, for both below
    loaded = [comm_under_compute(graph, t, iv) for t, iv in zip(records, intervals)]
    return {"step_s": statistics.median(t.seconds for t in records), "steps": [t.seconds for t in records],
            "lane_op_s": {i: statistics.median(t.timings[i].end - t.timings[i].start for t in records)
                          for i in lane_ops(graph)},
            "comm_service_s": {i: statistics.median(iv[i][1] - iv[i][0] for iv in intervals) for i in comm_ops(graph)},
            "comm_loaded_s": {i: statistics.median(x[i] for x in loaded) for i in comm_ops(graph)},
            # the mean, as for the collectives: a step pays each hop's tail too
            "wake_s": statistics.fmean([w for t in records for w in wake_delays(graph, t)] or [0.0]),
            "loop_s": statistics.median(loop_cpu[WARM_UP_STEPS:]) / len(graph.ops),   # the steps records keeps
            "ops": len(graph.ops),
            "compute_cpu_s": {i: statistics.median(ts[WARM_UP_STEPS:] or ts) for i, ts in cpu_s.items()}}


def measure_set(device, s: Settings, rank: int, world: int, slots: int = 1) -> tuple[list[dict], dict]:
    """(the clipped blocks, the unclipped block after block :data:`UNCLIPPED_AFTER_BLOCK`) of the
    reference step, one after another: a set as calibrate spreads it over its run."""
    steps = RUNTIME_STEPS[s.quick] // RUNTIME_BLOCKS
    blocks = [measure_runtime(device, s, rank, world, steps, slots) for _ in range(UNCLIPPED_AFTER_BLOCK + 1)]
    unclipped = measure_runtime(device, s, rank, world, steps, slots, clip=False)
    blocks += [measure_runtime(device, s, rank, world, steps, slots)
               for _ in range(RUNTIME_BLOCKS - UNCLIPPED_AFTER_BLOCK - 1)]
    return blocks, unclipped


def reference_times(raw: list[dict]) -> tuple[float, list[float], dict[int, float], dict[int, float],
                                               dict[int, float]]:
    """(reference step, each block's step, each lane op's seconds, each collective's service
    seconds, and of those the seconds a compute op ran beside it) from the ranks' runtime blocks.

    A step lasts as long as its slowest rank: a block's step is the median over its steps of the
    slowest rank's time, the figure `zdsl run --metrics` reports (its ``step_s``). The reference
    step is the median of the blocks' steps, so one block caught in a burst of outside load does
    not move it. A lane op's (or collective's) seconds: the mean over ranks of the median over
    blocks of its medians.
    """
    block_s = block_steps(raw)

    def per_op(key: str) -> dict[int, float]:
        return {i: statistics.fmean(statistics.median(blk[key][i] for blk in r["runtime"]) for r in raw)
                for i in raw[0]["runtime"][0].get(key, {})}
    return (statistics.median(block_s), block_s, per_op("lane_op_s"), per_op("comm_service_s"),
            per_op("comm_loaded_s"))


def block_step(blocks: list[dict]) -> float:
    """One block's step from each rank's record of it: the median over its steps of the slowest
    rank's time (a step lasts as long as its slowest rank)."""
    return statistics.median(max(times) for times in zip(*(b["steps"] for b in blocks)))


def is_slow_spell(step_s: float, usual_s: float | None) -> bool:
    """Whether a reference step of ``step_s`` is slower than the machine's usual ``usual_s`` by
    more than :data:`SLOW_SPELL` (never, with no usual step to compare with)."""
    return usual_s is not None and step_s > usual_s * (1 + SLOW_SPELL)


def block_steps(raw: list[dict]) -> list[float]:
    """Each block's step (:func:`block_step`) from the ranks' blocks (``raw[rank]["runtime"]``)."""
    return [block_step([r["runtime"][b] for r in raw]) for b in range(len(raw[0]["runtime"]))]


def set_step(raw: list[dict]) -> float:
    """The reference step of the ranks' set of blocks, as :func:`reference_times` takes it: the
    median block's."""
    return statistics.median(block_steps(raw))


def unclipped_step(raw: list[dict], reference_s: float) -> float:
    """The unclipped reference's step at the clipped one's moment: its block's step times
    ``reference_s`` over the clipped block measured just before it (the middle one), so the host's
    speed in that minute cancels out."""
    before = block_step([r["runtime"][UNCLIPPED_AFTER_BLOCK] for r in raw])
    return block_step([r["runtime_unclipped"] for r in raw]) * reference_s / before
