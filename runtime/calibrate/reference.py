"""The reference step of ``zdsl calibrate``: a tiny ZeRO-3 GPT trained through the real executor,
whose measured op times the planner's overhead fits (zdsl/planner/calibration_fit.py) invert."""
from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time

import trio

from zdsl.driver import compile_file
from zdsl.machine_profile import MachineProfile
from zdsl.planner.calibration_fit import comm_intervals, comm_ops, comm_under_compute, lane_ops, wake_delays
from zdsl.runtime.calibrate.measure import CalibrationError, Settings
from zdsl.runtime.data import make_batch
from zdsl.runtime.exec.executor import Executor
from zdsl.runtime.proc.guard import run_stoppable
from zdsl.sim.lanes import slots_of

# Reference steps (full, quick), split into RUNTIME_BLOCKS blocks spread over the calibration,
# since the host's speed moves from one half second to the next and one block can sit in a spell.
# A fresh run's first steps are slower than its later ones, so each block drops WARM_UP_STEPS and
# keeps enough after them (16 a quick block) that the reference matches the same schedule run
# beside the programs (benchmarks/prediction_error.py's drift column).
RUNTIME_STEPS = {False: 240, True: 60}
RUNTIME_BLOCKS = 3
# The variants (``VARIANTS``) are measured beside the reference in one block, right after this one.
VARIANTS_AFTER_BLOCK = 1
WARM_UP_STEPS = 4
# A reference step this much slower than the machine's usual one (its cached calibrations' median)
# is taken in a slow spell, and one this much faster (step x (1 + this) < usual) in a fast moment:
# measured REMEASURES times more in fresh ranks after pauses, and the median try's set kept
# (slow_spell.py). 12%: above how far a host's usual speed moves from one day to the next, below
# how far its spells and fast moments move the reference (benchmarks/prediction_error.py's drift).
SLOW_SPELL = 0.12
# A set whose slowest block ran this much slower than its fastest was measured while the host's
# speed moved: calibrate warns that plans made with it are that uncertain. Past 1.3x, programs
# planned with the set tend to miss their runs by more than the 15% target
# (benchmarks/prediction_error.py).
UNSTEADY = 1.3
REMEASURES = 2
REMEASURE_PAUSE_S = 5.0


# The graph the per-op overhead is fitted on: small enough that fixed costs dominate. It clips
# gradients, as most recipes do (HF's max_grad_norm=1.0, DeepSpeed's gradient_clipping), so the fit
# covers the norm ops and the norm's all-reduce too: without them the costs fitted for a step's
# lane ops and collectives priced a clipped program's norms at a compute op's hand-off and its
# scalar all-reduce at a gathered unit's, and clipped programs (programs/quickstart.zs) were
# planned slow while the reference matched (benchmarks/prediction_error.py). Its step count only
# has to be valid: measure_runtime runs as many steps as each block needs.
REFERENCE = """schedule calibrate_reference "zdsl calibrate: a tiny ZeRO-3 step, what the runtime costs per op"
model     gpt(layers=2, width={width}, heads={heads}, vocab=256, context=32)
data      synthetic(vocab=256, context=32)
train     steps={steps}, batch=4, precision=fp32, seed=0
optimizer adamw(lr=1e-3{clip})
ranks     {ranks} on {device}
zero      {stage}
"""

# The same model stepped other ways, whose steps the cost per collective is fitted to beside the
# reference's (calibration_fit.fit_overhead's ``also``): (name, clip, ZeRO stage). Unclipped, a
# unit's step runs in the backward right after its reduce-scatter, with no norms' tail; ZeRO-1
# all-reduces gradients and gathers the stepped shards once a step. Fitted on the clipped ZeRO-3
# step alone, programs that do not clip were planned short, and ZeRO-1 ones too once small
# collectives went through shared memory (benchmarks/prediction_error.py shows both).
VARIANTS = (("unclipped", False, 3), ("zero1", False, 1))


REFERENCE_WIDTH = 64
# The wide step: the reference at a width where a unit's forward and backward outweigh their
# kernels' fixed costs several times over, for ``compute_excess``; (full, quick) steps after
# WARM_UP_STEPS.
WIDE_WIDTH = 256
WIDE_STEPS = {False: 36, True: 12}


def reference_text(steps: int, ranks: int, device: str, width: int = REFERENCE_WIDTH, clip: bool = True,
                   stage: int = 3) -> str:
    """The reference schedule's source at ``width``: heads 64 wide (as the compute test's block), at
    least the width-64 step's 4; without gradient clipping where ``clip`` is off; ZeRO ``stage``."""
    return REFERENCE.format(steps=steps, ranks=ranks, device=device, width=width, heads=max(4, width // 64),
                            clip=", clip=1.0" if clip else "", stage=stage)


@functools.lru_cache(maxsize=None)
def reference_graph(ranks: int, device: str, width: int = REFERENCE_WIDTH, clip: bool = True, stage: int = 3):
    """The compiled reference schedule at ``width`` (unclipped where ``clip`` is off, at ZeRO
    ``stage``): once per process, for the runtime blocks and the fit alike (nothing that runs it
    changes it)."""
    with tempfile.TemporaryDirectory(prefix="zdsl-calibrate-") as tmp:
        path = os.path.join(tmp, "reference.zs")
        with open(path, "w", encoding="utf-8") as f:
            f.write(reference_text(RUNTIME_STEPS[False], ranks, device, width, clip, stage))
        compiled = compile_file(path, {}, simulate=False)
    if not compiled.ok:
        raise CalibrationError("the reference schedule does not compile: "
                               + "; ".join(d.message for d in compiled.diagnostics if d.is_error))
    return compiled


def _stepper(compiled, device, rank: int, world: int):
    """(the rank's state, an async function running step ``n`` of ``compiled`` through the
    executor and returning (its record, the event loop's CPU seconds in its ops))."""
    from zdsl.runtime.exec.streams import lane_streams
    from zdsl.runtime.models.batch import as_batch
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState
    graph, schedule = compiled.graph, compiled.schedule
    state = RankState(graph, build_model(schedule.model, seed=0), rank=rank, world=world, device=device)
    executor = Executor(graph, state, rank, streams=lane_streams(graph, device))
    t = schedule.train

    async def step(n: int):
        batches = [as_batch(make_batch(schedule.data, t.seed, n, m, rank, world, t.batch)).to(device)
                   for m in range(t.accumulate)]
        state.step_begin(n, batches)
        begin = time.thread_time()
        record = await executor.run_step()
        loop_cpu = time.thread_time() - begin
        state.step_end()
        return record, loop_cpu
    return state, step


def _aligner(device, world: int):
    """What `zdsl run` does after each step, gathering its metrics: the ranks start the next aligned."""
    import torch

    from zdsl.runtime.dist.collectives import all_gather
    # on the run's device: NCCL gathers only CUDA tensors (gloo takes CPU ones)
    mine, gathered = torch.zeros(8, device=device), torch.zeros(8 * world, device=device)
    return (lambda: all_gather(gathered, mine)) if world > 1 else (lambda: None)


def measure_runtime(device, s: Settings, rank: int, world: int, steps: int, slots: int = 1,
                    width: int = REFERENCE_WIDTH, compute_cpu: bool = False) -> dict:
    """Step times of ``steps`` steps of the reference schedule at ``width`` through the real
    executor (all ranks at once); ``slots``: collectives the backend runs at once (for their
    service times; a shared-memory pair runs one: ``slots_of``). ``compute_cpu``: each compute
    op's CPU time in its thread too (the wide step's, for ``compute_excess``; not the blocks' the
    overheads are fitted on, whose op times it would add to)."""
    import torch
    compiled = reference_graph(world, device.type, width, True, 3)
    graph = compiled.graph
    state, step = _stepper(compiled, device, rank, world)
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
    align = _aligner(device, world)

    async def loop() -> list:
        out = []
        for n in range(steps):
            out.append(await step(n))
            align()
        return out

    done = trio.run(run_stoppable, loop)
    records = [r for r, _ in done][WARM_UP_STEPS:]      # the first steps allocate and warm up
    loop_cpu = [c for _, c in done][WARM_UP_STEPS:]
    state = step = None     # drop the run's buffers before the next width
    if device.type == "cuda":
        torch.cuda.empty_cache()
    slots = slots_of(graph, MachineProfile.of(name=device.type, comm_slots=slots))
    intervals = [comm_intervals(graph, t, slots) for t in records]       # once a step, for both below
    loaded = [comm_under_compute(graph, t, iv) for t, iv in zip(records, intervals)]
    return {"step_s": statistics.median(t.seconds for t in records), "steps": [t.seconds for t in records],
            "lane_op_s": {i: statistics.median(t.timings[i].end - t.timings[i].start for t in records)
                          for i in lane_ops(graph)},
            "comm_service_s": {i: statistics.median(iv[i][1] - iv[i][0] for iv in intervals) for i in comm_ops(graph)},
            "comm_loaded_s": {i: statistics.median(x[i] for x in loaded) for i in comm_ops(graph)},
            # the mean, as for the collectives: a step pays each hop's tail too
            "wake_s": statistics.fmean([w for t in records for w in wake_delays(graph, t)] or [0.0]),
            "loop_s": statistics.median(loop_cpu) / len(graph.ops),
            "ops": len(graph.ops),
            "compute_cpu_s": {i: statistics.median(ts[WARM_UP_STEPS:] or ts) for i, ts in cpu_s.items()}}


def measure_variants(device, s: Settings, rank: int, world: int, steps: int) -> dict:
    """Step times of the reference and of each of its :data:`VARIANTS`, ``steps`` each after
    warm-up, taken in turn step by step (reference, unclipped, zero1, reference, ...), so that
    the host's speed, which moves from one second to the next, is the same for each's steps; by
    name (the reference's: ``"reference"``)."""
    kinds = (("reference", True, 3), *VARIANTS)
    steppers = {name: _stepper(reference_graph(world, device.type, REFERENCE_WIDTH, clip, stage), device, rank,
                              world)[1]
                for name, clip, stage in kinds}
    align = _aligner(device, world)

    async def loop() -> dict:
        times: dict[str, list[float]] = {name: [] for name in steppers}
        for n in range(WARM_UP_STEPS + steps):
            for name, step in steppers.items():
                record, _ = await step(n)
                times[name].append(record.seconds)
                align()
        return {name: ts[WARM_UP_STEPS:] for name, ts in times.items()}
    return {"steps": trio.run(run_stoppable, loop)}


def measure_set(device, s: Settings, rank: int, world: int, slots: int = 1) -> tuple[list[dict], dict]:
    """(the reference's blocks, the variants measured after block :data:`VARIANTS_AFTER_BLOCK`)
    one after another: a set as calibrate spreads it over its run."""
    steps = RUNTIME_STEPS[s.quick] // RUNTIME_BLOCKS
    blocks = [measure_runtime(device, s, rank, world, steps, slots) for _ in range(VARIANTS_AFTER_BLOCK + 1)]
    variants = measure_variants(device, s, rank, world, steps)
    blocks += [measure_runtime(device, s, rank, world, steps, slots)
               for _ in range(RUNTIME_BLOCKS - VARIANTS_AFTER_BLOCK - 1)]
    return blocks, variants


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


def unsteadiness(block_s: list[float]) -> float | None:
    """The slowest block's step over the fastest's where that exceeds :data:`UNSTEADY`, else None."""
    spread = max(block_s) / min(block_s) if block_s and min(block_s) > 0 else 1.0
    return spread if spread > UNSTEADY else None


def off_usual_by(step_s: float, usual_s: float) -> float:
    """How much slower a reference step of ``step_s`` ran than the machine's usual ``usual_s``
    (``step_s`` over it, less 1), or faster (``usual_s`` over ``step_s``, less 1)."""
    return max(step_s / usual_s, usual_s / step_s) - 1


def is_off_usual(step_s: float, usual_s: float | None) -> bool:
    """Whether a reference step of ``step_s`` is a slow spell or a fast moment: off the machine's
    usual ``usual_s`` by more than :data:`SLOW_SPELL` (:func:`off_usual_by`; never, with no usual
    step to compare with)."""
    return usual_s is not None and off_usual_by(step_s, usual_s) > SLOW_SPELL


def block_steps(raw: list[dict]) -> list[float]:
    """Each block's step (:func:`block_step`) from the ranks' blocks (``raw[rank]["runtime"]``)."""
    return [block_step([r["runtime"][b] for r in raw]) for b in range(len(raw[0]["runtime"]))]


def set_step(raw: list[dict]) -> float:
    """The reference step of the ranks' set of blocks, as :func:`reference_times` takes it: the
    median block's."""
    return statistics.median(block_steps(raw))


def variant_steps(raw: list[dict], reference_s: float) -> dict[str, float]:
    """Each variant's step (``raw[rank]["runtime_variants"]``) at the reference step's moment: the
    median over rounds of its step over the reference's step of the same round (each the slowest
    rank's), times ``reference_s``; by name."""
    every = [r["runtime_variants"]["steps"] for r in raw]
    slowest = {name: [max(times) for times in zip(*(e[name] for e in every))] for name in every[0]}
    reference = slowest.pop("reference")
    return {name: statistics.median(v / r for v, r in zip(steps, reference)) * reference_s
            for name, steps in slowest.items()}
