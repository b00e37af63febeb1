"""Measure this machine for the planner's cost model: ``zdsl calibrate``.

The planner (``zdsl.sim.simulate.op_duration``) prices every op with a
handful of rates from :class:`zdsl.schedule.MachineProfile`. Its predictions
are only as good as those rates, so each is measured here *the way the
planner uses it*, under the conditions of a real run:

* ``flops``: forward + backward of the schedule's GPT (``--schedule``), or
  of one GPT block of the given size, against the flops the compiler
  charges for it (3x the analytic forward flops), i.e. the rate
  ``op.flops / flops`` needs: on CPU the slope of its time over several
  batch sizes (each kernel's fixed cost is charged apart, below), on CUDA
  one batch's flops over its time. Plain ``torch.mm`` at the block's shapes
  is reported beside it (the ceiling). bf16 on CUDA; on CPU the
  schedule's precision (``--schedule``), else fp32.
* ``flops_widths``, ``flops_fp32``/``flops_bf16`` (and ``flops_fp16`` on CUDA):
  a GPT block's forward+backward at a few widths in each precision
  (``measure_compute_table``), so that one profile prices a schedule of
  another size or precision (``zdsl.sim.rates``); the default block
  (width 64, fp32) is its first entry, the same number as ``flops``.
  Measured by every rank at once, each on its share of the cores
  (``compute_ranks`` of them), and then by rank 0 alone with every core
  and a torch thread on each (``flops_alone_*``: a one-rank schedule's).
* ``host_flops``: the same on the host CPU (the device rate on a CPU box).
* ``memory_bw``/``host_memory_bw``: an AdamW step on a flat fp32 shard,
  counted as the planner counts a ``compute.step`` (moments + parameter +
  gradient bytes): the runtime's host kernel (``host_adam``), and on CUDA
  the device's step for ``memory_bw``.
* ``link``/``latency``, ``scatter_*``, ``reduce_*``: ``all_gather``,
  ``reduce_scatter`` and ``all_reduce`` (the runtime's own) of several sizes
  between the ranks, each fitted to ``latency + payload*(n-1)/n / link``.
* ``pcie``: pinned host<->device copies on CUDA; a memory copy on CPU
  (what a "copy to device" costs there).
* ``disk_read``/``disk_write`` and their ``*_latency``: the NVMe tier's
  own swapper writing and reading transfers of 256 KiB to 16 MiB
  (``O_DIRECT`` requests of the schedule's block size, several in flight),
  each direction fitted to ``latency + bytes / rate``, by every rank at once
  (each one's share, ``disk_ranks`` of them) and then by rank 0 alone
  (``disk_*_alone``: a one-rank schedule's); ``disk_*_cpu``
  the share of a core a transfer takes from a GPT block's forward+backward
  run beside it.
* ``overhead``: what the runtime itself costs per op (dispatch, worker
  hand-off, completion, a collective's wake-up), which rates cannot see and
  which dominates small models. Measured by training a tiny ZeRO-3 GPT
  (``REFERENCE``) through the real executor, in three blocks of steps spread
  over the calibration (first, middle, last; their median; measured twice
  more in fresh ranks, after pauses, the median try's set kept, where their
  step is more than 12% slower than this machine's usual one, the median of
  its latest cached calibrations, or as far faster, or where there is none:
  ``slow_spell.py``):
  ``overhead``
  per lane op and ``kernel_overhead`` per kernel a compute op dispatches
  are the line through each op's time beyond its rated time against its
  kernels, ``loop`` the event loop's thread's CPU time in each step's ops
  over the step's ops (what a free costs; the loop works for every op),
  ``comm_overhead`` per collective the cost that then makes the planner's
  predictions of that graph and of the same model stepped other ways
  (``reference.VARIANTS``: unclipped, ZeRO-1; measured after the middle
  block, in turn step by step with the reference, each taken as its ratio
  to the reference's step beside it) match their measured steps, their
  geometric mean error 0, and
  ``scatter_overhead`` per reduce-scatter that plus what a reduce-scatter
  took beyond its rated time more than the other collectives did.
  Each of these four fixed costs is clamped at 0, and 0 is a sensible,
  valid result (the language allows a fixed cost of 0: ``MACHINE_MAY_BE_ZERO``
  in ``zdsl/schedule.py``): it says the rates alone already account for
  the measured time, and noise put the fitted line below 0. It happens
  often on shared cores: ``kernel_overhead`` when the ops' excess does not
  rise with their kernel count, ``scatter_overhead`` when reduce-scatters
  took *less* beyond their own measured rate (``scatter_*``, which already
  holds their reduction's cost) than the other collectives did. Rates are
  never 0 and never negative (each fit keeps them positive), so the
  statement written is always one the checker accepts.
* ``compute_excess`` (CPU; 0 where not measured): how much longer than its
  rated time a unit's forward or backward takes in the runtime (activations
  gone cold between a unit's forward and its backward, the executor's
  bookkeeping, the rank's other threads on its core): the same step at
  ``WIDE_WIDTH``, where a unit's compute outweighs its kernels' fixed costs,
  its units' CPU time in their thread less those costs, over their rated
  time. The width-64 step cannot tell it from a cost per kernel (its units'
  compute is a third of their time), so without it every wider unit is
  planned short, backwards more than forwards.
* ``cores``: the rank's share of the host's cores (ranks are bound to it).
* ``comm_under_load``: on CPU, the share of its rate a collective keeps
  while compute fills those cores: gloo's threads wait for a core rather
  than take a fair share. The slope of each reference collective's time
  beyond its rate against the seconds a compute op ran beside it.

All ranks measure at once (one process per rank, the runtime's thread
count per rank), because that is how they contend for cores, memory and
disk in a run; a rate is the mean over ranks of each rank's median. The output is a ``machine``
statement that a schedule includes (``include "machine.zs"``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from zdsl import env
from zdsl.check.checker import load_schedule
from zdsl.lang.errors import ZsError
from zdsl.runtime.calibrate.measure import (
    TABLE_CONTEXT,
    CalibrationError,
    Settings,
    compute_dtype,
    measure_collectives,
    measure_compute,
    measure_compute_table,
    measure_copy,
    measure_disk,
    measure_optimizer,
    table_batch,
)
from zdsl.runtime.calibrate.ranks import joined, restore_cores
from zdsl.runtime.calibrate.reference import (
    REMEASURES,
    RUNTIME_BLOCKS,
    RUNTIME_STEPS,
    VARIANTS_AFTER_BLOCK,
    WARM_UP_STEPS,
    WIDE_STEPS,
    WIDE_WIDTH,
    measure_runtime,
    measure_variants,
    off_usual_by,
    unsteadiness,
)
from zdsl.runtime.calibrate.slow_spell import remeasure
from zdsl.runtime.calibrate.summary import ZS_KEYS, Calibration, summarise  # noqa: F401 (ZS_KEYS: re-exported)
from zdsl.runtime.dist.affinity import bind_rank
from zdsl.runtime.dist.spawn import LocalRanks, RankFailed, free_port
from zdsl.runtime.run.cli import configure_rank_logging
from zdsl.schedule import GPT_DEFAULTS
from zdsl.sim.profile_cache import add_reference, profile_path, read_profile, usual_reference, write_profile

# -- one rank ---------------------------------------------------------------------------------

STEPS = ("compute", "optimizer", "copy", "collectives", "disk", "disk alone", "compute alone", "runtime")


def _run_rank(rank: int, world: int, port: int, s: Settings, backend: str, report) -> dict:
    """Every measurement on one rank, in lock step with the others; returns this rank's numbers."""
    import torch
    import torch.distributed as dist

    with joined(rank, world, port, s, backend) as me:
        device, threads, unbound, slots = me.device, me.threads, me.unbound, me.slots
        out: dict = {"threads": threads, "device": str(device), "seconds": {}, "comm_slots": slots}
        clock = [time.perf_counter()]

        def barrier(done: str | None = None) -> None:
            if world > 1:
                dist.barrier()
            if done:
                out["seconds"][done] = time.perf_counter() - clock[0]
                clock[0] = time.perf_counter()
        barrier("start")
        # The reference step in blocks spread over the calibration (first, middle, last), so that a
        # burst of outside load during one of them moves the median less
        block_steps = RUNTIME_STEPS[s.quick] // RUNTIME_BLOCKS
        early = [measure_runtime(device, s, rank, world, block_steps, slots)]
        barrier("runtime (first block)")
        report("compute")
        out["compute"] = measure_compute(device, s, compute_dtype(device, s.precision))
        out["compute_table"] = measure_compute_table(device, s, *_known_table_rates(out["compute"]))
        if device.type == "cuda":
            small = dataclasses.replace(s, width=None, heads=None, context=None, batch=None, layers=None)
            out["host_compute"] = measure_compute(torch.device("cpu"), small, torch.float32)
        barrier("compute")
        report("optimizer")
        out["optimizer"] = measure_optimizer(device, s)
        barrier("optimizer")
        report("copy")
        out["copy"] = measure_copy(device, s)
        barrier("copy")
        report("collectives")
        if world > 1:
            out["collectives"] = measure_collectives(device if backend == "nccl" else torch.device("cpu"),
                                                     s, rank, world)
        barrier("collectives")
        if device.type == "cpu":    # a GPU's kernels run beside the host's launches: no excess to see
            out["runtime_wide"] = measure_runtime(device, s, rank, world, WARM_UP_STEPS + WIDE_STEPS[s.quick],
                                                  slots, width=WIDE_WIDTH, compute_cpu=True)
        barrier("runtime (wide)")
        early.append(measure_runtime(device, s, rank, world, block_steps, slots))
        barrier("runtime (middle block)")
        assert len(early) == VARIANTS_AFTER_BLOCK + 1
        out["runtime_variants"] = measure_variants(device, s, rank, world, block_steps)
        barrier("runtime (variants)")
        report("disk")
        out["disk"] = measure_disk(s.disk_folder or tempfile.gettempdir(), s, rank,
                                   dist.barrier if world > 1 else (lambda: None))
        barrier("disk")
        if world > 1:   # one rank with the disk and the node to itself: what a one-rank schedule's ops get
            report("disk alone")
            if rank == 0:       # with every core, as a one-rank run has them (its swapper checksums on them)
                with _every_core(unbound, device, rank, world):
                    out["disk_alone"] = measure_disk(s.disk_folder or tempfile.gettempdir(), s, rank, beside=False)
                    if device.type == "cpu":        # a GPU's rate does not depend on the host's cores
                        report("compute alone")
                        out["compute_alone"] = {**measure_compute_table(device, s, out["compute_table"]["fixed_s"]),
                                                "threads": torch.get_num_threads(),
                                                "cores": len(unbound) if unbound else os.cpu_count() or 1}
            barrier("disk alone")
        report("runtime")
        out["runtime"] = [*early, measure_runtime(device, s, rank, world, block_steps, slots)]
        barrier("runtime")
        if world > 1:
            every: list = [None] * world
            dist.all_gather_object(every, out)
            return {"ranks": every}
        return {"ranks": [out]}


def _child(rank: int, world: int, port: int, s: Settings) -> None:
    """A spawned rank (1..world-1); rank 0 gathers its numbers, and a failure is reported to it
    by the spawner (runtime/dist/spawn.py)."""
    configure_rank_logging(rank)      # warnings only, as rank 0's (the swapper logs its opening)
    _run_rank(rank, world, port, s, _pick_backend(s), lambda step: None)


def _pick_backend(s: Settings) -> str:
    import torch
    if s.backend == "nccl" or (s.backend == "auto" and torch.cuda.is_available()
                               and torch.cuda.device_count() >= s.ranks):
        if not torch.cuda.is_available():
            raise CalibrationError("backend nccl needs CUDA, and torch sees no CUDA device; use --backend gloo")
        if torch.cuda.device_count() < s.ranks and s.ranks > 1:
            raise CalibrationError(f"nccl needs one GPU per rank: {torch.cuda.device_count()} GPU(s) for "
                                   f"{s.ranks} ranks; use --ranks {torch.cuda.device_count()} or --backend gloo")
        return "nccl"
    return "gloo"


def _known_table_rates(compute: dict) -> tuple[float, dict]:
    """(the block's fixed seconds, the table's rates already measured) from :func:`measure_compute`:
    the default calibration's block (width 64, fp32) is the table's first entry, the same number
    as ``flops``, so the programs of that size are priced as before."""
    shape = compute["shape"]
    if shape.get("layers") or "fixed_s" not in compute:
        return 0.0, {}
    from zdsl.runtime.state.precision import DTYPES
    precision = {str(dtype).removeprefix("torch."): name for name, dtype in DTYPES.items()}[compute["dtype"]]
    known = {}
    if compute.get("block_flops") and shape["context"] == TABLE_CONTEXT["cpu"] \
            and shape["batch"] == table_batch("cpu", shape["width"]):
        known[(precision, shape["width"])] = compute["block_flops"]
    return compute["fixed_s"], known


# -- putting it together ----------------------------------------------------------------------

@contextlib.contextmanager
def _every_core(unbound: set[int] | None, device, rank: int, world: int):
    """Rank 0 with every core of the node and a torch thread on each, as a one-rank run has them
    (runtime/dist/affinity.set_cpu_threads: an explicit OMP_NUM_THREADS wins); its share and
    thread count back after."""
    import torch
    threads = torch.get_num_threads()
    restore_cores(unbound)
    if env.raw("OMP_NUM_THREADS") is None:
        torch.set_num_threads(len(unbound) if unbound else os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if device.type == "cpu":
            bind_rank(rank, world)


def calibrate(backend: str = "auto", ranks: int = 2, disk_folder: str | None = None, quick: bool = False,
              progress: bool = True, **shape) -> Calibration:
    """Measure this machine with ``ranks`` processes; returns the profile and how it was measured.

    ``shape`` sets the model size the compute rate is measured at (width,
    heads, context, batch; default: the size of the CPU example programs, or
    GPT-2 small on CUDA) and the NVMe request size and depth (block, depth).
    ``disk_folder`` should be where NVMe swap files go.
    """
    s = Settings(ranks=ranks, backend=backend, disk_folder=disk_folder, quick=quick,
                 usual_reference_s=_usual_reference(ranks), **shape)
    from zdsl.runtime.dist.collectives import check_settings
    try:
        check_settings()
    except ValueError as e:
        raise CalibrationError(str(e)) from None
    if ranks < 1:
        raise CalibrationError("ranks must be at least 1")
    if backend not in ("auto", "gloo", "nccl"):
        raise CalibrationError(f"unknown backend {backend!r}: use gloo, nccl or auto")
    if disk_folder is not None and not os.path.isdir(disk_folder):
        raise CalibrationError(f"disk folder {disk_folder} does not exist")
    bar = Progress(SpinnerColumn(), TextColumn("calibrating [bold]{task.description}"), BarColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True, disable=not progress)
    threads_before = None
    cores_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    port = free_port()
    children = LocalRanks(_child, ranks, (port, s), first=1, port=port)      # rank 0 measures here
    try:
        with bar:
            with children:
                task = bar.add_task("starting ranks", total=len(STEPS) + 1)
                import torch  # after the ranks started, so they import torch meanwhile
                threads_before = torch.get_num_threads()
                chosen = _pick_backend(s)
                labels = {"compute": "compute (matmul, GPT block)", "optimizer": "memory (AdamW step)",
                          "copy": "host-device copies", "collectives": f"collectives ({chosen}, {ranks} ranks)",
                          "disk": "disk (O_DIRECT)", "disk alone": "disk (one rank alone)",
                          "compute alone": "compute (one rank, every core)",
                          "runtime": "runtime (a tiny ZeRO-3 step, per-op cost)"}

                def report(step: str) -> None:
                    bar.update(task, description=labels[step], advance=1)
                try:
                    result = _run_rank(0, ranks, port, s, chosen, report)
                except Exception as e:
                    cause = _in_words(children.failures())
                    if isinstance(e, CalibrationError) and not cause:
                        raise
                    raise CalibrationError(f"rank 0: {type(e).__name__}: {e}"
                                           + (f"\n{cause}" if cause else "")) from None
                try:
                    children.join(timeout_s=s.timeout_s)
                except RankFailed as failed:
                    raise CalibrationError(f"a rank failed after measuring:\n{_in_words([failed])}") from None
            result["ranks"][0]["reference_tries"] = remeasure(
                result["ranks"], s, chosen,
                lambda: bar.update(task, description="runtime again, in fresh ranks"))
            bar.update(task, description="done", advance=1)
    finally:
        if threads_before is not None:
            torch.set_num_threads(threads_before)
        restore_cores(cores_before)
    return summarise(result["ranks"], s, chosen, ranks)


def _usual_reference(ranks: int) -> float | None:
    """This machine's usual reference step at ``ranks`` ranks, from the calibrations cached where
    ``cache_profile`` writes (none where the cache is off)."""
    if env.get("ZDSL_CALIBRATE") == "0":
        return None
    usual = usual_reference(ranks)
    return usual[0] if usual else None


def _in_words(failures: list[RankFailed]) -> str:
    """The ranks' failures, one line each (their tracebacks stay in the rank)."""
    return "\n".join(f"rank {f.rank}: {f.error}" if f.error is not None else str(f) for f in failures)


def shape_of_schedule(path: str) -> tuple[dict[str, Any], int, str | None]:
    """(model shape and NVMe request settings, ranks, NVMe folder) of a schedule file."""
    try:
        schedule, _ = load_schedule(path)
    except ZsError as e:
        raise CalibrationError(f"{path}: {e}") from None
    except OSError as e:
        raise CalibrationError(f"cannot read {path}: {e.strerror}") from None
    shape: dict[str, Any] = {}
    if schedule.model.kind == "gpt":
        args = {**GPT_DEFAULTS, **schedule.model.args}
        shape.update(width=args["width"], heads=args["heads"], context=args["context"],
                     layers=args["layers"], vocab=args["vocab"])
    shape["batch"] = schedule.train.batch
    shape["precision"] = schedule.train.precision
    folder = None
    places = [(state, p) for state, p in schedule.placement.items() if p.tier == "nvme"]
    if places:
        state, measured = places[0]
        shape.update(block=measured.block_bytes, depth=measured.queue_depth)
        folder = measured.paths[0]     # one drive's rate: the planner adds up distinct drives
        others = [f"the {possessive(s)} ({describe_nvme(p)})" for s, p in places[1:]
                  if (p.paths[0], p.block_bytes, p.queue_depth) != (folder, measured.block_bytes, measured.queue_depth)]
        if others:
            print(f"zdsl calibrate: the profile holds one disk rate, measured with the {possessive(state)} placement "
                  f"({describe_nvme(measured)}); it plans {', '.join(others)} too", file=sys.stderr)
    if folder and not os.path.isdir(folder):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            folder = None
    return shape, schedule.ranks, folder


def possessive(state: str) -> str:
    return f"{state}'" if state.endswith("s") else f"{state}'s"


def describe_nvme(place) -> str:
    """An NVMe placement as calibrate names it: its first folder, block and depth."""
    return f"{place.paths[0]}, block {place.block_bytes >> 10} KiB, depth {place.queue_depth}"


def cache_profile(cal: Calibration) -> str:
    """Cache the profile where ``zdsl plan`` finds it (zdsl.sim.profile_cache); says where, or why not."""
    if env.get("ZDSL_CALIBRATE") == "0":
        return "not cached for zdsl plan: ZDSL_CALIBRATE=0"
    reference = cal.details.get("reference")
    try:
        # measured off the machine's usual (slower or faster, after its tries): a cached profile of
        # its usual speed is kept, as the host's spells and fast moments last seconds, not as long
        # as a plan is used; the reference joins the history (after more as far off, the usual
        # moves and one is cached)
        kept = read_profile(profile_path()) if cal.details.get("off_usual") else None
        if kept is not None and reference is not None:     # off the usual: its reference was measured
            add_reference(reference)
            side = "slower" if reference[1] > cal.details["usual_reference_s"] else "faster"
            return (f"not cached: the profile cached {kept[1]} (in {profile_path()}) is kept for zdsl plan, tune "
                    f"and run --trace, as this one was measured {side} than the machine's usual")
        path = write_profile(cal.fields(), cal.machine_statement(), reference=reference)
        return f"cached for zdsl plan, tune and run --trace in {path}"
    except (OSError, ValueError) as e:
        return f"not cached: {getattr(e, 'strerror', None) or e}"


def main(argv: list[str] | None = None) -> int:
    """``zdsl calibrate [--out machine.zs] [--quick]``; exit 0 on success, 2 on a stated failure."""
    ap = argparse.ArgumentParser(prog="zdsl calibrate",
                                 description="Measure this machine and write a `machine` profile for schedules.")
    ap.add_argument("--out", help="file to write (default: print the profile)")
    ap.add_argument("--quick", action="store_true", help="shorter, noisier measurements (about 30 s on 2 cores)")
    ap.add_argument("--ranks", type=int, default=None,
                    help="processes measuring at once (default: the schedule's ranks, else 2)")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    ap.add_argument("--disk", dest="disk_folder", default=None,
                    help="folder for the disk test: where NVMe offload will swap (default: temp folder)")
    for name in ("layers", "width", "heads", "vocab", "context", "batch"):
        ap.add_argument(f"--{name}", type=int, default=None, help=f"model {name} the compute rate is measured at")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                    help="precision a CPU's compute rate is measured in (default: the schedule's, else fp32)")
    ap.add_argument("--schedule", metavar="FILE.zs",
                    help="measure at this schedule's model size, ranks and NVMe folder, block and depth")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    shape: dict[str, Any] = {}
    ranks = 2
    if a.schedule:
        try:
            shape, ranks, folder = shape_of_schedule(a.schedule)
        except CalibrationError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        a.disk_folder = a.disk_folder or folder
    a.ranks = ranks if a.ranks is None else a.ranks
    shape.update({k: getattr(a, k) for k in ("layers", "width", "heads", "vocab", "context", "batch", "precision")
                  if getattr(a, k) is not None})
    start = time.perf_counter()
    try:
        cal = calibrate(a.backend, a.ranks, a.disk_folder, a.quick, progress=not a.no_progress, **shape)
    except CalibrationError as e:
        print(f"error: calibration failed: {e}", file=sys.stderr)
        return 2
    text = cal.to_zs()
    if cal.details.get("off_usual"):
        _, step_s = cal.details["reference"]
        usual = cal.details["usual_reference_s"]
        side = "slower" if step_s > usual else "faster"
        print(f"warning: the reference step ran {step_s * 1e3:.1f} ms, {off_usual_by(step_s, usual):.0%} {side} "
              f"than this machine's usual {usual * 1e3:.1f} ms, after {REMEASURES} more tries in fresh ranks: "
              f"plans made with this profile would predict steps that much {side} than the machine's usual speed; "
              "`zdsl calibrate` again once the host is quieter",
              file=sys.stderr)
    unsteady = unsteadiness(cal.details.get("block_steps", []))
    if unsteady:
        print(f"warning: the reference step's blocks ran "
              f"{', '.join(f'{b * 1e3:.1f}' for b in cal.details['block_steps'])} ms: the host's speed moved "
              f"{unsteady:.2f}x while it was measured, and programs planned with this profile can run that much "
              "off their predictions; `zdsl calibrate` again when the machine is quieter", file=sys.stderr)
    cached = cache_profile(cal)
    if a.out:
        try:
            with open(a.out, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            print(f"error: cannot write {a.out}: {e.strerror}", file=sys.stderr)
            return 2
        print(f"{cal.machine_statement()}\nwrote {a.out} in {time.perf_counter() - start:.1f} s; "
              f"use it with: include \"{a.out}\"; {cached}", file=sys.stderr)
    else:
        sys.stdout.write(text)
        print(cached, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
