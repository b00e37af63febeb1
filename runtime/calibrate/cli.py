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
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from zdsl import env
from zdsl.schedule import MACHINE_OPTIONS
from zdsl.schedule import MACHINE_SHAPE_FIELDS

from zdsl.schedule import MachineProfile

from zdsl.lang.sizes import human_bytes
from zdsl.planner.calibration_fit import LATENCY_FIELDS, compute_excess, fit_overhead, scaled_latencies
from zdsl.sim.simulate import simulate
from zdsl.runtime.calibrate.measure import (COLLECTIVES, DISK_SIZES, TABLE_CONTEXT, CalibrationError, Settings,
                                            compute_dtype, measure_collectives, measure_compute,
                                            measure_compute_table, measure_copy, measure_disk, measure_optimizer,
                                            table_batch)
from zdsl.runtime.calibrate.ranks import joined, restore_cores
from zdsl.runtime.calibrate.reference import (REFERENCE_WIDTH, REMEASURE_PAUSE_S, REMEASURES, RUNTIME_BLOCKS,
                                              RUNTIME_STEPS, VARIANTS, VARIANTS_AFTER_BLOCK, WARM_UP_STEPS,
                                              WIDE_STEPS, WIDE_WIDTH, is_off_usual, measure_runtime,
                                              measure_variants, off_usual_by, reference_graph, reference_times,
                                              unsteadiness, variant_steps)
from zdsl.runtime.calibrate.slow_spell import kept_try, remeasure
from zdsl.runtime.dist.spawn import LocalRanks
from zdsl.runtime.dist.spawn import RankFailed
from zdsl.runtime.dist.spawn import free_port

ZS_KEYS = {field: key for key, field in MACHINE_OPTIONS}   # MachineProfile field -> .zs keyword


@dataclass
class Calibration:
    """The measured profile and how each number was obtained."""
    profile: MachineProfile
    details: dict = field(default_factory=dict)

    def fields(self) -> dict:
        """The MachineProfile fields, as the schedule dataclass names them."""
        return asdict(self.profile)

    def machine_statement(self) -> str:
        p = self.profile
        args = ", ".join(f"{ZS_KEYS[k]}={_value(getattr(p, k))}" for k in ZS_KEYS if k not in MACHINE_SHAPE_FIELDS
                         or getattr(p, k))
        return f"machine {p.name}({args})"

    def to_zs(self) -> str:
        """The text of ``machine.zs``: comments saying how, then one statement, a setting a line."""
        from zdsl.check.printer import wrap_statement
        lines = [f"# {line}" for line in self.details.get("notes", [])]
        return "\n".join(lines + wrap_statement(self.machine_statement())) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e5 else f"{v:.3g}"   # widths, counts: exact


def _value(v) -> str:
    """A keyword's value as the statement writes it: a number, or a tuple of numbers."""
    return f"({', '.join(_num(x) for x in v)})" if isinstance(v, tuple) else _num(v)


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
    from zdsl.runtime.run.cli import configure_rank_logging
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

def _summarise(raw: list[dict], s: Settings, backend: str, world: int) -> Calibration:
    # The ranks' medians, averaged: on a shared machine one rank's window can catch a burst
    # of outside load, and taking the slowest rank then overstates every op of a step.
    mean = lambda get: statistics.fmean(get(r) for r in raw)  # noqa: E731
    first = raw[0]
    cuda = first["device"].startswith("cuda")
    comp = first["compute"]
    block = mean(lambda r: r["compute"]["block_flops"] or r["compute"]["mm_flops"])
    mm = mean(lambda r: r["compute"]["mm_flops"])
    host = mean(lambda r: (r.get("host_compute") or r["compute"])["block_flops"]
                or (r.get("host_compute") or r["compute"])["mm_flops"])
    adam = mean(lambda r: r["optimizer"]["adam_bandwidth"])
    pcie = mean(lambda r: r["copy"]["pcie"])
    disk = {key: mean(lambda r: r["disk"][key])
            for key in ("disk_read", "disk_write", "disk_read_latency", "disk_write_latency",
                        "disk_read_cpu", "disk_write_cpu")}
    host_adam = mean(lambda r: r["optimizer"]["host_adam_bandwidth"])
    profile = MachineProfile(name="cuda" if cuda else "cpu", flops=block, host_flops=host,
                             pcie_bandwidth=pcie, **disk, memory_bandwidth=adam,
                             host_memory_bandwidth=host_adam, cores=_cores_per_rank(world),
                             comm_slots=first.get("comm_slots", 1))
    table = first["compute_table"]
    profile.flops_widths = tuple(float(w) for w in table["widths"])
    for precision in ("fp32", "bf16", "fp16"):
        if precision in table:
            setattr(profile, f"flops_{precision}", tuple(mean(lambda r: r["compute_table"][precision][i])
                                                         for i in range(len(table["widths"]))))
    # the compute tables by all ranks at once, each on its share of the cores, and by rank 0 alone
    # with every core (one rank measured them alone: its tables are those)
    if not cuda:
        profile.compute_ranks = world
        for precision in ("fp32", "bf16", "fp16"):
            if precision in first.get("compute_alone", {}):
                setattr(profile, f"flops_alone_{precision}", tuple(first["compute_alone"][precision]))
    # the disk shared by all ranks (disk_read, disk_write: each one's share) and one rank's alone
    alone = first.get("disk_alone") or first["disk"]
    profile.disk_ranks = world
    profile.disk_read_alone, profile.disk_write_alone = alone["disk_read"], alone["disk_write"]
    if world > 1:   # each kind of collective its own (latency, bandwidth); one rank keeps the defaults
        fit = {name: (mean(lambda r: r["collectives"][name][0]), mean(lambda r: r["collectives"][name][1]))
               for name in COLLECTIVES}
        profile.link_latency, profile.link_bandwidth = fit["all_gather"]
        profile.scatter_latency, profile.scatter_bandwidth = fit["reduce_scatter"]
        profile.reduce_latency, profile.reduce_bandwidth = fit["all_reduce"]
    step_s, block_s, lane_op_s, comm_service_s, comm_loaded_s = reference_times(raw)
    profile.wake_latency = mean(lambda r: statistics.median(b.get("wake_s", 0.0) for b in r["runtime"]))
    profile.loop_overhead = mean(lambda r: statistics.median(b.get("loop_s", 0.0) for b in r["runtime"]))
    blocks = len(block_s)
    device = "cuda" if cuda else "cpu"
    graph = reference_graph(world, device).graph
    # the cost per collective fitted to the reference and its variants at once (fit_overhead's ``also``)
    variants = variant_steps(raw, step_s) if "runtime_variants" in first else {}
    also = tuple((reference_graph(world, device, REFERENCE_WIDTH, clip, stage).graph, variants[name])
                 for name, clip, stage in VARIANTS) if variants else ()
    if "runtime_wide" in first:
        wide = reference_graph(world, "cpu", WIDE_WIDTH).graph
        wide_cpu = {i: mean(lambda r: r["runtime_wide"]["compute_cpu_s"][i])
                    for i in first["runtime_wide"]["compute_cpu_s"]}
        # the fixed costs (fitted on the small step) and the excess (on the wide one) each take a
        # share of the other's time: fitted in turn, then the step's costs once more with the excess
        for _ in range(2):
            fit = fit_overhead(graph, profile, step_s, lane_op_s, comm_service_s, comm_loaded_s, also)
            profile.op_overhead, profile.kernel_overhead = fit.op, fit.kernel
            profile.compute_excess = compute_excess(wide, profile, wide_cpu)
    fit = fit_overhead(graph, profile, step_s, lane_op_s, comm_service_s, comm_loaded_s, also)
    profile.op_overhead, profile.kernel_overhead, bare_s = fit.op, fit.kernel, fit.bare_s
    measured_latency = profile.link_latency
    scaled = scaled_latencies(profile, fit.latency_scale)    # the same unless they overshot the reference
    for name in LATENCY_FIELDS:
        setattr(profile, name, getattr(scaled, name))
    profile.comm_under_load = fit.under_load
    profile.comm_overhead = fit.comm if fit.comm >= 0 else fit.op   # written out: the statement has no "unset"
    profile.scatter_overhead = fit.scatter if fit.scatter >= 0 else profile.comm_overhead
    import torch
    shape = comp["shape"]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    notes = [
        f"machine profile measured by `zdsl calibrate{' --quick' if s.quick else ''}` "
        f"on {platform.node() or 'this machine'}, {when}",
        f"torch {torch.__version__}, backend {backend}, {world} rank(s) measuring at once on {first['device']}, "
        f"{first['threads']} thread(s) per rank; each rate is the mean of the ranks' medians",
        f"  flops       {comp.get('measured', '')}width {shape['width']}, heads {shape['heads']}, "
        f"context {shape['context']}, batch {shape['batch']}, {comp['dtype']}",
        f"              (torch.mm alone at its shapes: {_num(mm)} flop/s"
        + (f"; {comp['block_note']})" if comp.get("block_note") else ")"),
        *([f"              the slope of its time over batch {', '.join(str(n) for n in comp['batches'])} "
            f"(kernels are charged apart; batch {shape['batch']}'s flops over its time: "
            f"{_num(comp['flops_at_batch'])} flop/s)"] if comp.get("batches") else []),
        f"  flops_*     a GPT block's forward+backward (heads width/64, context {table['context']}, batch "
        f"{', '.join(str(b) for b in table['batches'])}) at flops_widths in "
        f"{', '.join(p for p in ('fp32', 'bf16', 'fp16') if p in table)}: one batch's flops over its time less the "
        f"block's kernels' fixed {table['fixed_s'] * 1e3:.2f} ms; zdsl plan prices a unit at its precision's rate at "
        "its width (log-log between them)",
        *([f"  flops_alone_*  the same by rank 0 alone with every core ({first['compute_alone']['cores']} "
            f"cores, {first['compute_alone']['threads']} threads) after the others measured (flops_*: each of "
            f"compute_ranks={world} ranks on its share): zdsl plan prices a schedule of fewer ranks, more cores "
            f"each, with them ({', '.join(_alone_gains(profile))})"] if first.get("compute_alone") else []),
        f"  memory_bw   AdamW step on {first['optimizer']['adam_numel']} fp32 elements, "
        f"counted as 16 bytes each (moments, parameter, gradient)"
        + (": the device's; host_memory_bw the host's (runtime/offload/host_adam.py)" if cuda
           else ", the runtime's host step (runtime/offload/host_adam.py)"),
        f"  pcie        {first['copy']['copy_note']}"
        + (f"; h2d {_num(first['copy']['h2d'])} B/s, d2h {_num(first['copy']['d2h'])} B/s" if cuda else ""),
    ]
    if world > 1:
        c = first["collectives"]
        notes += [f"  link        all_gather (link, latency), reduce_scatter (scatter_*) and all_reduce (reduce_*) "
                  f"of {human_bytes(c['sizes'][0])} to {human_bytes(c['sizes'][-1])},",
                  "              each fitted to latency + payload*(n-1)/n / link (the runtime's own collectives)"]
    else:
        notes.append("  link        default (one rank: no collectives to measure)")
    notes.append(f"  cores       {_num(profile.cores)} per rank ({os.cpu_count()} cores, {world} rank(s)): "
                 "lanes running at once share them")
    notes.append(f"  comm_slots  {profile.comm_slots}: collectives the {backend} backend runs at once"
                 + (" (its worker threads)" if backend == "gloo" else " (one stream)"))
    if profile.comm_under_load:
        notes.append(f"  comm_under_load  {_num(profile.comm_under_load)}: the share of its rate a collective keeps "
                     "while compute fills the cores (the slope of each reference collective's time beyond its rate "
                     "against the time compute ran beside it)")
    if fit.latency_scale < 1.0:
        notes.append(f"  latency     the collectives' latencies scaled by {fit.latency_scale:.2f} (all-gather "
                     f"{measured_latency * 1e3:.2f} -> {profile.link_latency * 1e3:.2f} ms): as measured they predict "
                     "the reference step slower than it ran (calls that each waited for a core under outside load)")
    notes.append(f"  wake        {_num(profile.wake_latency)} s: the mean of how long an op of the reference started "
                 "after its input from another lane ended (the runtime's hop between lanes)")
    notes.append(f"  loop        {_num(profile.loop_overhead)} s: the event loop's CPU time per op of the reference step "
                 "(its thread's, over the step's ops): what a free costs, on its rank's cores")
    notes.append(f"  overhead    per op run in a lane's thread and kernel_overhead per kernel a compute op dispatches "
                 "(the line through each one's time beyond its rated time against its kernels), "
                 "comm_overhead per collective (then fitted to the step) and scatter_overhead per reduce-scatter "
                 "(comm_overhead plus the median of what each took beyond its rated time less the other "
                 f"collectives' median), on a tiny ZeRO-3 GPT (width 64, 2 layers, {first['runtime'][0]['ops']} ops)")
    notes.append(f"              run by the executor: measured {step_s * 1e3:.1f} ms a step, of which its "
                 f"lane ops {sum(lane_op_s.values()) * 1e3:.1f} ms; rates alone predict {bare_s * 1e3:.1f} ms")
    tries, usual = first.get("reference_tries", []), s.usual_reference_s
    again = len(tries) > 1 and kept_try(tries) > 0          # a set measured again was kept
    notes.append(f"              (the median of {blocks} blocks of {len(first['runtime'][0]['steps'])} steps, "
                 f"{'in a row in fresh ranks' if again else 'spread over the calibration'}: "
                 f"{', '.join(f'{b * 1e3:.1f}' for b in block_s)} ms)")
    if len(tries) > 1 and usual is None:
        notes.append(f"              (no earlier calibration of this machine to compare with: the set measured "
                     f"{len(tries)} times, in fresh ranks after the first, "
                     f"{', '.join(f'{t * 1e3:.1f}' for t in tries)} ms; the median kept)")
    elif len(tries) > 1:
        slower = tries[0] > usual
        notes.append(f"              the first set ran {tries[0] * 1e3:.1f} ms a step, "
                     f"{off_usual_by(tries[0], usual):.0%} {'slower' if slower else 'faster'} "
                     f"than this machine's usual {usual * 1e3:.1f} ms (its latest calibrations' median): "
                     f"{'slow rank processes or a slow spell' if slower else 'a fast moment'} of the host; "
                     f"measured again in fresh ranks after {REMEASURE_PAUSE_S:.0f} s pauses: "
                     f"{', '.join(f'{t * 1e3:.1f}' for t in tries[1:])} ms; the median set kept")
    elif usual is not None:
        notes.append(f"              (this machine's usual reference step: {usual * 1e3:.1f} ms, its latest "
                     "calibrations' median)")
    if also:
        errors = [simulate(g, profile).step_s / sec - 1 for g, sec in ((graph, step_s), *also)]
        notes.append("              comm_overhead fitted to it and to the same model stepped "
                     + " and ".join(f"{name} ({sec * 1e3:.1f} ms)" for (name, _, _), (_, sec) in zip(VARIANTS, also))
                     + f", taken in turn step by step with it: predicted {', '.join(f'{e:+.0%}' for e in errors)}")
    if "runtime_wide" in first:
        notes.append(f"  compute_excess  {_num(profile.compute_excess)}: a forward or backward in the runtime takes "
                     "(1 + this) x its rated time: the same step at width "
                     f"{WIDE_WIDTH} ({len(first['runtime_wide']['steps'])} steps), its units' CPU time in their "
                     "thread less the fixed costs above, against their rated time")
    disk = first["disk"]
    notes.append(f"  disk        the runtime's swapper ({'O_DIRECT' if disk['direct'] else 'buffered: no O_DIRECT here'}, "
                 f"{human_bytes(s.block)} requests, {s.depth} in flight) writing and reading "
                 f"{', '.join(human_bytes(n) for n in disk['sizes'])} per rank in {disk['rounds']} interleaved "
                 "rounds, each direction fitted to latency + bytes / rate")
    notes.append(f"              in {s.disk_folder or tempfile.gettempdir()}; disk_read_cpu, disk_write_cpu: "
                 f"1 - (a GPT block's forward+backward alone) / (beside back-to-back {human_bytes(DISK_SIZES[2])} "
                 f"transfers), the median of {disk['rounds']} rounds: "
                 f"{disk['beside_compute']['alone_s'] * 1e3:.2f} ms alone, "
                 + ", ".join(f"{t * 1e3:.2f} beside {w}s" for w, t in disk['beside_compute']['beside_s'].items()))
    notes.append(f"  disk_*_alone  the same transfers by one rank with the disk to itself "
                 f"(disk_read, disk_write: each of disk_ranks={world} ranks' share, all at once); zdsl plan uses "
                 "the one-rank rates for a one-rank schedule, the aggregate split over its ranks for others")
    details = {"notes": notes, "ranks": raw, "backend": backend, "mm_flops": mm, "block_flops": block,
               "reference": (world, step_s), "usual_reference_s": usual, "off_usual": is_off_usual(step_s, usual),
               "block_steps": block_s}
    return Calibration(profile, details)


def _alone_gains(profile: MachineProfile) -> list[str]:
    """The alone tables against the shared ones at the widest width: ``bf16 at width 2048: 2.4e+11 flop/s, 1.40x``."""
    out = []
    for precision in ("fp32", "bf16", "fp16"):
        shared, alone = getattr(profile, f"flops_{precision}"), getattr(profile, f"flops_alone_{precision}")
        if shared and alone:
            out.append(f"{precision} at width {_num(profile.flops_widths[-1])}: {_num(alone[-1])} flop/s, "
                       f"{alone[-1] / shared[-1]:.2f}x")
    return out


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
            from zdsl.runtime.dist.affinity import bind_rank
            bind_rank(rank, world)


def _cores_per_rank(world: int) -> float:
    """The rank's share of this machine's cores (what its lanes compete for)."""
    return round((os.cpu_count() or 1) / max(world, 1), 3)


def calibrate(backend: str = "auto", ranks: int = 2, disk_folder: str | None = None, quick: bool = False,
              progress: bool = True, **shape) -> Calibration:
    """Measure this machine with ``ranks`` processes; returns the profile and how it was measured.

    ``shape`` sets the model size the compute rate is measured at (width,
    heads, context, batch; default: the size of the CPU example programs, or
    GPT-2 small on CUDA) and the NVMe request size and depth (block, depth).
    ``disk_folder`` should be where NVMe swap files go.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

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
                import torch             # after the ranks started, so they import torch meanwhile
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
    return _summarise(result["ranks"], s, chosen, ranks)


def _usual_reference(ranks: int) -> float | None:
    """This machine's usual reference step at ``ranks`` ranks, from the calibrations cached where
    ``cache_profile`` writes (none where the cache is off)."""
    if env.get("ZDSL_CALIBRATE") == "0":
        return None
    from zdsl.sim.profile_cache import usual_reference
    usual = usual_reference(ranks)
    return usual[0] if usual else None


def _in_words(failures: list[RankFailed]) -> str:
    """The ranks' failures, one line each (their tracebacks stay in the rank)."""
    return "\n".join(f"rank {f.rank}: {f.error}" if f.error is not None else str(f) for f in failures)


def shape_of_schedule(path: str) -> tuple[dict, int, str | None]:
    """(model shape and NVMe request settings, ranks, NVMe folder) of a schedule file."""
    from zdsl.check.checker import load_schedule
    from zdsl.lang.errors import ZsError
    try:
        schedule, _ = load_schedule(path)
    except ZsError as e:
        raise CalibrationError(f"{path}: {e}") from None
    except OSError as e:
        raise CalibrationError(f"cannot read {path}: {e.strerror}") from None
    shape: dict = {}
    if schedule.model.kind == "gpt":
        from zdsl.schedule import GPT_DEFAULTS
        args = {**GPT_DEFAULTS, **schedule.model.args}
        shape.update(width=args["width"], heads=args["heads"], context=args["context"],
                     layers=args["layers"], vocab=args["vocab"])
    shape["batch"] = schedule.train.batch
    shape["precision"] = schedule.train.precision
    folder = None
    for placement in schedule.placement.values():
        if placement.tier == "nvme":
            shape.update(block=placement.block_bytes, depth=placement.queue_depth)
            folder = placement.paths[0]     # one drive's rate: the planner adds up distinct drives
    if folder and not os.path.isdir(folder):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            folder = None
    return shape, schedule.ranks, folder


def cache_profile(cal: Calibration) -> str:
    """Cache the profile where ``zdsl plan`` finds it (zdsl.sim.profile_cache); says where, or why not."""
    from zdsl.sim.profile_cache import add_reference, profile_path, read_profile, write_profile
    if env.get("ZDSL_CALIBRATE") == "0":
        return "not cached for zdsl plan: ZDSL_CALIBRATE=0"
    reference = cal.details.get("reference")
    try:
        # measured off the machine's usual (slower or faster, after its tries): a cached profile of
        # its usual speed is kept, as the host's spells and fast moments last seconds, not as long
        # as a plan is used; the reference joins the history (after more as far off, the usual
        # moves and one is cached)
        kept = read_profile(profile_path()) if cal.details.get("off_usual") else None
        if kept is not None:
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
    shape, ranks = {}, 2
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
