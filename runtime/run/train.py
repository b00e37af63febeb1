"""One rank's training loop: join the group, agree on the graph, run the steps.

The launcher (``runtime/run/launch.py``) starts one process per rank with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as
torchrun does; each process compiles the same schedule, so before the first
step the ranks exchange a hash of their graphs and stop, all of them, if
any differ.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Protocol

import torch
import trio

from zdsl import env
from zdsl.ir import TIERS, TaskGraph
from zdsl.lr import LrSchedule
from zdsl.observe.overlap import analyze
from zdsl.runtime.checkpoint.checkpointer import Checkpointer, resume
from zdsl.runtime.data import make_batch
from zdsl.runtime.dist.affinity import set_cpu_threads
from zdsl.runtime.dist.collectives import all_gather, check_settings
from zdsl.runtime.dist.group import init_group, leave_group
from zdsl.runtime.exec.executor import Executor, StepRecord
from zdsl.runtime.exec.hb_check import run_streams
from zdsl.runtime.exec.tracing import write_measured_trace
from zdsl.runtime.models.batch import as_batch
from zdsl.runtime.models.protocol import build_model
from zdsl.runtime.offload.host_adam import limit_host_threads
from zdsl.runtime.proc.board import STEP, STEP_DONE, rank_board
from zdsl.runtime.proc.guard import run_stoppable
from zdsl.runtime.run.evaluate import Evaluator
from zdsl.runtime.run.tensorboard import TensorBoardWriter
from zdsl.runtime.state.rank import RankState
from zdsl.schedule import Schedule


class LaunchError(RuntimeError):
    """The ranks cannot start together (wrong world size, differing graphs)."""


@dataclass
class RunOptions:
    metrics: str | None = None          # JSONL, one line per step (rank 0 writes)
    tensorboard: str | None = None      # a folder of TensorBoard runs, one per invocation (rank 0 writes)
    trace: str | None = None            # Chrome trace of the measured ops
    timeline: str | None = None         # SVG of one measured step
    export: str | None = None           # safetensors of the final full fp32 state dict
    progress: bool = True
    timeout_s: float = 120.0            # a collective that waits longer fails (a dead peer)
    trace_steps: int = 3                # how many steps (the last ones) go into the trace
    checkpoint_dir: str | None = None   # save here every `checkpoint_every` steps
    checkpoint_every: int = 0
    checkpoint_keep: int = 0
    resume: str | None = None           # a checkpoint root (newest complete) or one step folder
    fresh_optimizer: bool = False       # resume the weights only; the optimizer's state starts at zero


@dataclass
class StepMetrics:
    step: int
    loss: float
    step_s: float
    tokens_per_s: float
    skipped: bool
    grad_norm: float | None
    peak_bytes: dict = field(default_factory=dict)   # rank -> tier -> bytes
    overlap: dict | None = None                      # efficiency, lower bound, rank 0's lanes and critical path
    lr: float | None = None                          # the step's learning rate (zdsl/lr.py)
    val_loss: float | None = None                    # after an evaluation (runtime/run/evaluate.py), else None


def env_rank() -> tuple[int, int]:
    rank, world, _, _ = (launcher_variable(key) for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    return int(rank), int(world)


def launcher_variable(key: str) -> str:
    value = env.raw(key)
    if value is None:
        raise LaunchError(f"{key} is not set; start ranks with `zdsl run` or torchrun")
    return value


def pick_device(choice: str, rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise LaunchError("the schedule asks for `ranks N on cuda` but no CUDA device is visible")
        local = int(env.raw("LOCAL_RANK") or rank) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def agree_on_graph(graph: TaskGraph, rank: int, world: int, device: torch.device) -> None:
    """Every rank must run the same graph; say which ranks differ if not."""
    digest = bytes.fromhex(graph.digest())
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=device)
    every = torch.empty(world * len(digest), dtype=torch.uint8, device=device)
    all_gather(every, mine)
    rows = every.view(world, -1).cpu()
    groups: dict[bytes, list[int]] = {}
    for r in range(world):
        groups.setdefault(bytes(rows[r].tolist()), []).append(r)
    if len(groups) > 1:
        desc = "; ".join(f"ranks {v} have graph {k.hex()[:12]}" for k, v in groups.items())
        raise LaunchError(f"the ranks compiled different task graphs ({desc}); "
                          "run the same schedule file and --set overrides on every rank")


def join_launched(graph: TaskGraph, timeout_s: float) -> tuple[int, int, torch.device]:
    """This process as a launcher started it (``zdsl run``, torchrun): its rank, the world and
    its device, with the process group joined; the caller leaves it (:func:`leave_group`)."""
    rank, world = env_rank()
    if world != graph.ranks:
        raise LaunchError(f"the schedule was compiled for {graph.ranks} ranks but {world} were launched; "
                          f"launch {graph.ranks} ranks or set `ranks {world}` (--set ranks={world})")
    device = prepare_host(graph, rank, world)
    init_group(rank, world, device, timeout_s)
    return rank, world, device


def prepare_host(graph: TaskGraph, rank: int, world: int) -> torch.device:
    """The rank's device, its share of the host's cores and the collectives' settings checked:
    what a rank does before it joins its group."""
    device = pick_device(graph.config.get("device", "auto"), rank)
    if device.type == "cpu":
        set_cpu_threads(rank, world)
    else:
        limit_host_threads(rank, world)
    try:
        check_settings()
    except ValueError as e:
        raise LaunchError(str(e)) from None
    return device


@dataclass
class RankRun:
    """One rank ready to run steps: its agreed graph, its state and the executor that runs the graph
    on it. ``zdsl run`` (:class:`TrainLoop`) and the Python API (``runtime/api/``) both step through
    it: :meth:`begin_step`, then :meth:`run_step` (on the trio loop), then :meth:`end_step`."""
    graph: TaskGraph
    schedule: Schedule
    units: list
    rank: int
    world: int
    device: torch.device
    model: object                   # the model whose parameters now live in ``state``
    state: RankState
    executor: Executor
    rates: LrSchedule               # from the global step: a resumed run continues it

    def begin_step(self, step: int, batches, timed: bool) -> float:
        """Set the step's learning rate and micro-batches (None: a user loop feeds them one at a
        time) and prepare the executor; returns the learning rate. On the trio thread."""
        lr = self.rates.at(step)
        for opt in self.state.optims:
            opt.set_lr(lr)
        self.state.step_begin(step, batches)
        executor = self.executor
        if executor.board is not None:
            executor.board[STEP] = step
        executor.record = timed
        if executor.streams is not None:
            executor.streams.timing = timed   # untimed steps order with cheaper CUDA events
        executor.begin_step()
        return lr

    async def run_step(self) -> StepRecord:
        """Run the step :meth:`begin_step` prepared."""
        return await self.executor.run_begun()

    def end_step(self, step: int) -> dict:
        """The step's results (``RankState.step_end``: loss, skipped, grad_norm, loss_scale)."""
        result = self.state.step_end()
        if self.executor.board is not None:
            self.executor.board[STEP_DONE] = step
        return result


def open_rank(stack: contextlib.ExitStack, graph: TaskGraph, schedule, units, rank: int, world: int,
              device: torch.device, *, model=None, eval_graph: TaskGraph | None = None) -> RankRun:
    """Agree on the graph with every rank, build the rank's state from ``model`` (None: the
    schedule's ``model``, built from the run's seed, unit by unit) and its executor. What must be
    undone (NVMe swap files, CUDA streams) is put on ``stack``. Every rank calls it together."""
    cfg = graph.config
    agree_on_graph(graph, rank, world, device)
    if eval_graph is not None:
        agree_on_graph(eval_graph, rank, world, device)
    torch.manual_seed(cfg["train"]["seed"])     # what the model and its units draw (dropout): the same every run
    if model is None:
        model = build_model(schedule.model, seed=cfg["train"]["seed"], lazy=True)   # RankState: unit by unit
    state = RankState(graph, model, rank=rank, world=world, device=device)
    stack.callback(state.close_swap)    # even when the step failed (ranks end by os._exit: no atexit)
    streams = stack.enter_context(run_streams(graph, device, state, rank))   # CUDA's, or ZDSL_HB_CHECK's
    executor = Executor(graph, state, rank, record=True, streams=streams, board=rank_board())
    return RankRun(graph, schedule, units, rank, world, device, model, state, executor,
                   LrSchedule.of(cfg["optimizer"], cfg["train"]["steps"]))


def train_rank(graph: TaskGraph, schedule, units, options: RunOptions, reporter=None,
               eval_graph: TaskGraph | None = None) -> list[StepMetrics]:
    """Train on this rank; returns the per-step metrics (complete on rank 0). ``eval_graph``: the
    schedule's forward-only graph (``eval``), run by ``runtime/run/evaluate.py``."""
    rank, world, device = join_launched(graph, options.timeout_s)
    with contextlib.ExitStack() as stack:
        stack.callback(leave_group)
        run = open_rank(stack, graph, schedule, units, rank, world, device, eval_graph=eval_graph)
        scalars = None
        if rank == 0 and options.tensorboard:
            scalars = stack.enter_context(TensorBoardWriter(options.tensorboard, schedule.name))
        evaluator = None
        if eval_graph is not None and schedule.eval is not None:
            evaluator = Evaluator(eval_graph, schedule.eval, run.state, seed=graph.config["train"]["seed"],
                                  rank=rank, world=world, batch=graph.config["train"]["batch"], device=device,
                                  make_batch=make_batch, run_streams=run.executor.streams)
        loop = TrainLoop(run, options, reporter, scalars, evaluator)
        return trio.run(run_stoppable, loop.train)


class StepReporter(Protocol):
    """What the loop tells rank 0's progress display (runtime/run/progress.py's Reporter, which
    imports this module)."""
    checkpoint_costs: list

    def step(self, m: StepMetrics) -> None: ...


@dataclass
class TrainLoop:
    """``zdsl run``'s loop on one rank: the schedule's data, steps, metrics, checkpoints, evaluation."""
    run: RankRun
    options: RunOptions
    reporter: StepReporter | None = None          # rank 0's
    scalars: TensorBoardWriter | None = None      # rank 0's
    evaluator: Evaluator | None = None
    records: list = field(default_factory=list)      # (step, StepRecord) kept for --trace/--timeline

    def say(self, text: str) -> None:
        if self.run.rank == 0:
            print(f"zdsl: {text}", flush=True)

    async def train(self) -> list[StepMetrics]:
        run, options = self.run, self.options
        steps = run.graph.config["train"]["steps"]
        history: list[StepMetrics] = []
        first = self.resume(steps)
        if first >= steps:
            if options.export:
                run.state.export(options.export)
            return history
        checkpointer = None
        if options.checkpoint_dir and options.checkpoint_every > 0:
            checkpointer = Checkpointer(options.checkpoint_dir, options.checkpoint_every, options.checkpoint_keep,
                                        run.graph, run.units, run.rank, run.world, self.say)
        for step in range(first, steps):
            metrics = await self.step(step, steps)
            history.append(metrics)
            if run.rank == 0 and self.reporter is not None:
                self.reporter.step(metrics)
            if self.scalars is not None:
                self.scalars.step(metrics)
            if checkpointer is not None and (step + 1) % checkpointer.every == 0:
                checkpointer.save(step + 1, run.state)
        if checkpointer is not None:
            checkpointer.wait()
            if self.reporter is not None and checkpointer.costs:
                self.reporter.checkpoint_costs = checkpointer.costs
        if options.export:
            run.state.export(options.export)
        if options.trace or options.timeline:
            write_measured_trace(run.graph, self.records, run.rank, run.world, options, run.state)
        return history

    def resume(self, steps: int) -> int:
        """The first step to run: 0, or the step after ``--resume``'s checkpoint."""
        run, options = self.run, self.options
        if not options.resume:
            return 0
        first = resume(options.resume, run.graph, run.state, run.rank, run.world, self.say,
                       fresh_optimizer=options.fresh_optimizer)
        self.say(f"resumed at step {first} from {options.resume}" if first < steps else
                 f"{options.resume} already completed {first} steps and the schedule trains {steps}: nothing "
                 f"left to train (--set steps=N with N > {first} trains on)")
        return first

    async def step(self, step: int, steps: int) -> StepMetrics:
        """One step of the schedule's data: run, then its metrics gathered over the ranks."""
        run, options = self.run, self.options
        train = run.graph.config["train"]
        batches = [as_batch(make_batch(run.schedule.data, train["seed"], step, m, run.rank, run.world,
                                            train["batch"])).to(run.device)
                   for m in range(train["accumulate"])]
        lr = run.begin_step(step, batches, timed_step(options, step, steps))
        record = await run.run_step()
        result = run.end_step(step)
        if options.trace or options.timeline:
            self.records.append((step, record))
            self.records = self.records[-options.trace_steps:]
        # the overlap report costs O(ops): every step when metrics are written, else the last step
        overlap = analyze(run.graph, [(t.start, t.end) for t in record.timings], rank=run.rank,
                          step_time=record.seconds) if record.timings and (options.metrics or step == steps - 1) \
            else None
        metrics = gather_metrics(step, record, result, run.state, run.world, run.device,
                                 tokens=label_count(batches), overlap=overlap)
        metrics.lr = lr
        if self.evaluator is not None and self.evaluator.due(step, steps):
            metrics.val_loss = await self.evaluator.run(step)
        return metrics


def timed_step(options, step: int, steps: int) -> bool:
    """Whether a step's op times are read: every step with ``--metrics`` (the overlap figures),
    the steps ``--trace``/``--timeline`` keep, and the last (the summary's overlap)."""
    kept = (options.trace or options.timeline) and step >= steps - options.trace_steps
    return bool(options.metrics or kept or step == steps - 1)


def label_count(batches) -> int:
    """A step's tokens for tokens/s: its labels' elements (``batch x context`` of a token source; a
    classifier's ``python(...)`` data, one label per sample, counts samples)."""
    return sum(b.labels.numel() for b in batches)


# the allocator's peaks a CUDA rank reports beside its logical bytes per tier (``peak_bytes``)
ALLOCATOR_PEAKS = {"device_allocated": "peak_allocated", "device_reserved": "peak_reserved"}


def gather_metrics(step, record: StepRecord, result: dict, state, world, device, tokens,
                   overlap=None) -> StepMetrics:
    """Loss averaged over ranks, every rank's peak bytes per tier and overlap (one small all-gather)."""
    report = state.memory_report()
    peaks = report.get("peak", report)
    allocator = report.get("allocator", {})      # CUDA: what the caching allocator really holds
    row = [float(result["loss"]), record.seconds] + [float(peaks.get(t, 0)) for t in TIERS]
    row += [float(allocator.get(key, 0)) for key in ALLOCATOR_PEAKS.values()]
    row += [overlap.lower_bound, overlap.efficiency] if overlap is not None else [-1.0, -1.0]
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    every = torch.empty(world * len(row), dtype=torch.float64, device=device)
    all_gather(every, mine)
    table = every.view(world, -1).cpu().tolist()
    loss = sum(r[0] for r in table) / world
    step_s = max(r[1] for r in table)
    peak = {r: {t: int(table[r][2 + i]) for i, t in enumerate(TIERS)} for r in range(world)}
    if allocator:
        for r in range(world):
            peak[r].update({name: int(table[r][2 + len(TIERS) + i]) for i, name in enumerate(ALLOCATOR_PEAKS)})
    summary = None
    if overlap is not None:
        # the step is as slow as its slowest rank (zdsl.observe.overlap.summarize, from the gathered figures)
        lower = max(r[2 + len(TIERS) + len(ALLOCATOR_PEAKS)] for r in table)
        summary = {"overlap_efficiency": min(1.0, lower / step_s) if step_s > 0 else 1.0,
                   "lower_bound_s": lower, "rank0": overlap.to_metrics() if state.rank == 0 else None}
    return StepMetrics(step=step, loss=loss, step_s=step_s, tokens_per_s=tokens * world / step_s,
                       skipped=bool(result.get("skipped", False)), grad_norm=result.get("grad_norm"),
                       peak_bytes=peak, overlap=summary)


def metrics_line(m: StepMetrics) -> str:
    return json.dumps({"step": m.step, "loss": m.loss, "step_s": m.step_s, "tokens_per_s": m.tokens_per_s,
                       "skipped": m.skipped, "grad_norm": m.grad_norm, "lr": m.lr, "val_loss": m.val_loss,
                       "peak_bytes": {str(r): v for r, v in m.peak_bytes.items()}, "overlap": m.overlap})


