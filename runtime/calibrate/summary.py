"""What the ranks of ``zdsl calibrate`` measured, summarised: a :class:`MachineProfile` and notes
saying how each of its figures was obtained (the comments above the ``machine`` statement).

A rate is the mean over the ranks of each rank's median; the runtime's fixed costs are fitted
to the reference step and its variants (``zdsl.planner.calibration_fit``). ``summarise`` sets
the profile's figures in the order the fits need (rates first, then the costs fitted with
them), and writes the notes once the profile is whole.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import tempfile
from dataclasses import dataclass, field

from zdsl.check.printer import wrap_statement
from zdsl.lang.sizes import human_bytes
from zdsl.machine_profile import (
    MACHINE_MAY_BE_ZERO,
    MACHINE_OPTIONS,
    MACHINE_SHAPE_FIELDS,
    NEGATIVE_UNSET,
    MachineProfile,
)
from zdsl.planner.calibration_fit import OverheadFit, compute_excess, fit_overhead, scaled_latencies
from zdsl.runtime.calibrate.measure import COLLECTIVES, DISK_SIZES, Settings
from zdsl.runtime.calibrate.reference import (
    REFERENCE_WIDTH,
    REMEASURE_PAUSE_S,
    VARIANTS,
    WIDE_WIDTH,
    is_off_usual,
    off_usual_by,
    reference_graph,
    reference_times,
    variant_steps,
)
from zdsl.runtime.calibrate.slow_spell import kept_try
from zdsl.sim.simulate import simulate

ZS_KEYS = {field: key for key, field in MACHINE_OPTIONS}   # MachineProfile wire field -> .zs keyword
PRECISIONS = ("fp32", "bf16", "fp16")                      # the compute tables', in the notes' order


@dataclass
class Calibration:
    """The measured profile and how each number was obtained."""
    profile: MachineProfile
    details: dict = field(default_factory=dict)

    def fields(self) -> dict:
        """The MachineProfile's fields by their wire names (what the cache holds)."""
        return self.profile.to_config()

    def machine_statement(self) -> str:
        """Every figure (a shape field where measured); a rate not given as the statement says
        so, 0, and a collective's fixed cost not given left out (its 0 is a cost)."""
        p, args = self.profile, []
        for wire, key in ZS_KEYS.items():
            v = p.value(wire)
            if v is None and key in MACHINE_MAY_BE_ZERO and wire not in NEGATIVE_UNSET:
                v = 0.0
            if v is not None and (v or wire not in MACHINE_SHAPE_FIELDS):
                args.append(f"{key}={_value(v)}")
        return f"machine {p.name}({', '.join(args)})"

    def to_zs(self) -> str:
        """The text of ``machine.zs``: comments saying how, then one statement, a setting a line."""
        lines = [f"# {line}" for line in self.details.get("notes", [])]
        across = ["# across nodes (ranks N, P per node) is not on this machine: give your network's rate per rank",
                  "# and its latency, e.g. link cluster=(2.5e10, 2e-5)"]
        return "\n".join(lines + wrap_statement(self.machine_statement()) + across) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e5 else f"{v:.3g}"   # widths, counts: exact


def _value(v) -> str:
    """A keyword's value as the statement writes it: a number, or a tuple of numbers."""
    return f"({', '.join(_num(x) for x in v)})" if isinstance(v, tuple) else _num(v)


def summarise(raw: list[dict], s: Settings, backend: str, world: int) -> Calibration:
    """The profile that ``raw`` (each rank's measurements, rank 0's first) gives, with notes.

    ``s``: the settings measured with; ``backend``: the collectives' backend; ``world``: how
    many ranks measured at once. ``raw`` is read, never changed."""
    first = raw[0]
    block = _mean(raw, lambda r: r["compute"]["block_flops"] or r["compute"]["mm_flops"])
    mm = _mean(raw, lambda r: r["compute"]["mm_flops"])
    profile = _shared_rates(raw, world, block)
    _set_compute_tables(profile, raw, world)
    _set_disk_shares(profile, first, world)
    _set_collectives(profile, raw, world)
    ref = _fit_reference(profile, raw, world)
    notes = [*_heading_notes(s, backend, world, first), *_compute_notes(profile, first, world, mm),
             *_memory_and_copy_notes(first), *_link_notes(first, world), *_sharing_notes(profile, world, backend),
             *_overhead_notes(profile, ref, first), *_reference_step_notes(ref, first, s),
             *_variant_notes(profile, ref), *_excess_notes(profile, first), *_disk_notes(first, s, world)]
    usual = s.usual_reference_s
    details = {"notes": notes, "ranks": raw, "backend": backend, "mm_flops": mm, "block_flops": block,
               "reference": (world, ref.step_s), "usual_reference_s": usual,
               "off_usual": is_off_usual(ref.step_s, usual), "block_steps": ref.block_s}
    return Calibration(profile, details)


# -- the profile's figures --------------------------------------------------------------------

def _mean(raw: list[dict], get) -> float:
    """The ranks' medians, averaged: on a shared machine one rank's window can catch a burst
    of outside load, and taking the slowest rank then overstates every op of a step."""
    return statistics.fmean(get(r) for r in raw)


def _on_cuda(first: dict) -> bool:
    return first["device"].startswith("cuda")


def _shared_rates(raw: list[dict], world: int, block: float) -> MachineProfile:
    """A profile of the rates every rank measured at once: compute (``block``), host compute,
    the AdamW step's memory bandwidth (device and host), host-device copies and the disk."""
    first = raw[0]
    host = _mean(raw, lambda r: (r.get("host_compute") or r["compute"])["block_flops"]
                 or (r.get("host_compute") or r["compute"])["mm_flops"])
    adam = _mean(raw, lambda r: r["optimizer"]["adam_bandwidth"])
    pcie = _mean(raw, lambda r: r["copy"]["pcie"])
    disk = {key: _mean(raw, lambda r: r["disk"][key])
            for key in ("disk_read", "disk_write", "disk_read_latency", "disk_write_latency",
                        "disk_read_cpu", "disk_write_cpu")}
    host_adam = _mean(raw, lambda r: r["optimizer"]["host_adam_bandwidth"])
    return MachineProfile.of(name="cuda" if _on_cuda(first) else "cpu", flops=block, host_flops=host,
                             pcie_bandwidth=pcie, **disk, memory_bandwidth=adam,
                             host_memory_bandwidth=host_adam, cores=_cores_per_rank(world),
                             comm_slots=first.get("comm_slots", 1))


def _set_compute_tables(profile: MachineProfile, raw: list[dict], world: int) -> None:
    """The compute tables (flops by width in each precision) by all ranks at once, each on its
    share of the cores, and on a CPU by rank 0 alone with every core (one rank measured them
    alone: its tables are those)."""
    first = raw[0]
    table = first["compute_table"]
    compute = profile.compute
    compute.widths = tuple(float(w) for w in table["widths"])
    for precision in PRECISIONS:
        if precision in table:
            setattr(compute, precision, tuple(_mean(raw, lambda r: r["compute_table"][precision][i])
                                              for i in range(len(table["widths"]))))
    if not _on_cuda(first):
        compute.ranks = world
        for precision in PRECISIONS:
            if precision in first.get("compute_alone", {}):
                setattr(compute, f"alone_{precision}", tuple(first["compute_alone"][precision]))


def _set_disk_shares(profile: MachineProfile, first: dict, world: int) -> None:
    """The disk shared by all ranks (disk_read, disk_write: each one's share) and one rank's alone."""
    alone = first.get("disk_alone") or first["disk"]
    profile.disk.ranks = world
    profile.disk.read_alone, profile.disk.write_alone = alone["disk_read"], alone["disk_write"]


def _set_collectives(profile: MachineProfile, raw: list[dict], world: int) -> None:
    """Each kind of collective its own (latency, bandwidth); one rank keeps the defaults."""
    if world <= 1:
        return
    fit = {name: (_mean(raw, lambda r: r["collectives"][name][0]), _mean(raw, lambda r: r["collectives"][name][1]))
           for name in COLLECTIVES}
    link = profile.collectives.node
    link.latency, link.bandwidth = fit["all_gather"]
    link.scatter_latency, link.scatter_bandwidth = fit["reduce_scatter"]
    link.reduce_latency, link.reduce_bandwidth = fit["all_reduce"]


@dataclass
class _ReferenceFit:
    """The reference step as measured, and the fit of the runtime's fixed costs to it."""
    graph: object                  # the reference step's TaskGraph
    step_s: float
    block_s: list[float]           # each block's step (s)
    lane_op_s: dict
    also: tuple                    # (graph, step s) of each variant fitted with it
    fit: OverheadFit
    measured_latency: float        # the all-gather's latency before the fit scaled the latencies


def _fit_reference(profile: MachineProfile, raw: list[dict], world: int) -> _ReferenceFit:
    """Set the runtime's costs (wake, loop, per op, kernel and collective, the compute excess,
    the collectives' latencies and rate under load) fitted to the reference step."""
    first = raw[0]
    step_s, block_s, lane_op_s, comm_service_s, comm_loaded_s = reference_times(raw)
    costs = profile.costs
    costs.wake = _mean(raw, lambda r: statistics.median(b.get("wake_s", 0.0) for b in r["runtime"]))
    costs.loop = _mean(raw, lambda r: statistics.median(b.get("loop_s", 0.0) for b in r["runtime"]))
    device = "cuda" if _on_cuda(first) else "cpu"
    graph = reference_graph(world, device).graph
    also = _variants_fitted_with(raw, world, device, step_s)
    times = (step_s, lane_op_s, comm_service_s, comm_loaded_s)
    if "runtime_wide" in first:
        _fit_compute_excess(profile, raw, world, graph, times, also)
    fit = fit_overhead(graph, profile, *times, also=also)
    costs.op, costs.kernel = fit.op, fit.kernel
    measured_latency = profile.collectives.node.latency
    # the same unless they overshot the reference: only the link's latencies differ
    profile.collectives.node = scaled_latencies(profile, fit.latency_scale).collectives.node
    profile.collectives.under_load = fit.under_load or None
    costs.comm = fit.comm if fit.comm >= 0 else fit.op   # written out, as calibrate fitted it
    costs.scatter = fit.scatter if fit.scatter >= 0 else costs.comm
    return _ReferenceFit(graph, step_s, block_s, lane_op_s, also, fit, measured_latency)


def _variants_fitted_with(raw: list[dict], world: int, device: str, step_s: float) -> tuple:
    """The cost per collective is fitted to the reference and its variants at once
    (fit_overhead's ``also``): each variant's graph and its step beside the reference's."""
    variants = variant_steps(raw, step_s) if "runtime_variants" in raw[0] else {}
    return tuple((reference_graph(world, device, REFERENCE_WIDTH, clip, stage).graph, variants[name])
                 for name, clip, stage in VARIANTS) if variants else ()


def _fit_compute_excess(profile: MachineProfile, raw: list[dict], world: int, graph,
                        times: tuple[float, dict[int, float], dict[int, float], dict[int, float]],
                        also: tuple) -> None:
    """The fixed costs (fitted on the small step) and the excess (on the wide one) each take a
    share of the other's time: fitted in turn, before the step's costs once more with the excess."""
    wide = reference_graph(world, "cpu", WIDE_WIDTH).graph
    wide_cpu = {i: _mean(raw, lambda r: r["runtime_wide"]["compute_cpu_s"][i])
                for i in raw[0]["runtime_wide"]["compute_cpu_s"]}
    for _ in range(2):
        fit = fit_overhead(graph, profile, *times, also=also)
        profile.costs.op, profile.costs.kernel = fit.op, fit.kernel
        profile.costs.compute_excess = compute_excess(wide, profile, wide_cpu)


def _cores_per_rank(world: int) -> float:
    """The rank's share of this machine's cores (what its lanes compete for)."""
    return round((os.cpu_count() or 1) / max(world, 1), 3)


# -- the notes: how each figure was measured ---------------------------------------------------

def _heading_notes(s: Settings, backend: str, world: int, first: dict) -> list[str]:
    """Who measured, where, when and with what."""
    import torch
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"machine profile measured by `zdsl calibrate{' --quick' if s.quick else ''}` "
        f"on {platform.node() or 'this machine'}, {when}",
        f"torch {torch.__version__}, backend {backend}, {world} rank(s) measuring at once on {first['device']}, "
        f"{first['threads']} thread(s) per rank; each rate is the mean of the ranks' medians",
    ]


def _compute_notes(profile: MachineProfile, first: dict, world: int, mm: float) -> list[str]:
    """flops, the compute tables flops_* and the alone ones flops_alone_*."""
    comp = first["compute"]
    shape = comp["shape"]
    table = first["compute_table"]
    return [
        f"  flops       {comp.get('measured', '')}width {shape['width']}, heads {shape['heads']}, "
        f"context {shape['context']}, batch {shape['batch']}, {comp['dtype']}",
        f"              (torch.mm alone at its shapes: {_num(mm)} flop/s"
        + (f"; {comp['block_note']})" if comp.get("block_note") else ")"),
        *([f"              the slope of its time over batch {', '.join(str(n) for n in comp['batches'])} "
            f"(kernels are charged apart; batch {shape['batch']}'s flops over its time: "
            f"{_num(comp['flops_at_batch'])} flop/s)"] if comp.get("batches") else []),
        f"  flops_*     a GPT block's forward+backward (heads width/64, context {table['context']}, batch "
        f"{', '.join(str(b) for b in table['batches'])}) at flops_widths in "
        f"{', '.join(p for p in PRECISIONS if p in table)}: one batch's flops over its time less the "
        f"block's kernels' fixed {table['fixed_s'] * 1e3:.2f} ms; zdsl plan prices a unit at its precision's rate at "
        "its width (log-log between them)",
        *([f"  flops_alone_*  the same by rank 0 alone with every core ({first['compute_alone']['cores']} "
            f"cores, {first['compute_alone']['threads']} threads) after the others measured (flops_*: each of "
            f"compute_ranks={world} ranks on its share): zdsl plan prices a schedule of fewer ranks, more cores "
            f"each, with them ({', '.join(_alone_gains(profile))})"] if first.get("compute_alone") else []),
    ]


def _alone_gains(profile: MachineProfile) -> list[str]:
    """The alone tables against the shared ones at the widest width: ``bf16 at width 2048: 2.4e+11 flop/s, 1.40x``."""
    out = []
    for precision in PRECISIONS:
        shared, alone = getattr(profile.compute, precision), getattr(profile.compute, f"alone_{precision}")
        if shared and alone:
            out.append(f"{precision} at width {_num(profile.compute.widths[-1])}: {_num(alone[-1])} flop/s, "
                       f"{alone[-1] / shared[-1]:.2f}x")
    return out


def _memory_and_copy_notes(first: dict) -> list[str]:
    """memory_bw (the AdamW step) and pcie (host-device copies)."""
    cuda = _on_cuda(first)
    return [
        f"  memory_bw   AdamW step on {first['optimizer']['adam_numel']} fp32 elements, "
        f"counted as 16 bytes each (moments, parameter, gradient)"
        + (": the device's; host_memory_bw the host's (runtime/offload/host_adam.py)" if cuda
           else ", the runtime's host step (runtime/offload/host_adam.py)"),
        f"  pcie        {first['copy']['copy_note']}"
        + (f"; h2d {_num(first['copy']['h2d'])} B/s, d2h {_num(first['copy']['d2h'])} B/s" if cuda else ""),
    ]


def _link_notes(first: dict, world: int) -> list[str]:
    """The collectives' latency and bandwidth of each kind (defaults at one rank)."""
    if world <= 1:
        return ["  link        default (one rank: no collectives to measure)"]
    c = first["collectives"]
    return [f"  link        all_gather (link, latency), reduce_scatter (scatter_*) and all_reduce (reduce_*) "
            f"of {human_bytes(c['sizes'][0])} to {human_bytes(c['sizes'][-1])},",
            "              each fitted to latency + payload*(n-1)/n / link (the runtime's own collectives)"]


def _sharing_notes(profile: MachineProfile, world: int, backend: str) -> list[str]:
    """What a rank's lanes share: its cores, the backend's slots, a collective's rate under load."""
    cores = profile.costs.cores
    assert cores is not None, "a calibrated profile has the rank's share of the cores (_cores_per_rank)"
    notes = [f"  cores       {_num(cores)} per rank ({os.cpu_count()} cores, {world} rank(s)): "
             "lanes running at once share them",
             f"  comm_slots  {profile.collectives.slots}: collectives the {backend} backend runs at once"
             + (" (its worker threads)" if backend == "gloo" else " (one stream)")]
    if profile.collectives.under_load:
        notes.append(f"  comm_under_load  {_num(profile.collectives.under_load)}: "
                     "the share of its rate a collective keeps "
                     "while compute fills the cores (the slope of each reference collective's time beyond its rate "
                     "against the time compute ran beside it)")
    return notes


def _overhead_notes(profile: MachineProfile, ref: _ReferenceFit, first: dict) -> list[str]:
    """The latencies' scale where the fit scaled them, wake, loop and the per-op fixed costs."""
    notes = []
    if ref.fit.latency_scale < 1.0:
        notes.append(f"  latency     the collectives' latencies scaled by {ref.fit.latency_scale:.2f} (all-gather "
                     f"{ref.measured_latency * 1e3:.2f} -> {profile.collectives.node.latency * 1e3:.2f} ms): "
                     "as measured they "
                     "predict the reference step slower than it ran (calls that each waited for a core under "
                     "outside load)")
    notes.append(f"  wake        {_num(profile.costs.wake)} s: the mean of how long an op of the reference started "
                 "after its input from another lane ended (the runtime's hop between lanes)")
    notes.append(f"  loop        {_num(profile.costs.loop)} s: the event loop's CPU time per op of the reference "
                 "step (its thread's, over the step's ops): what a free costs, on its rank's cores")
    notes.append(f"  overhead    per op run in a lane's thread and kernel_overhead per kernel a compute op dispatches "
                 "(the line through each one's time beyond its rated time against its kernels), "
                 "comm_overhead per collective (then fitted to the step) and scatter_overhead per reduce-scatter "
                 "(comm_overhead plus the median of what each took beyond its rated time less the other "
                 f"collectives' median), on a tiny ZeRO-3 GPT (width 64, 2 layers, {first['runtime'][0]['ops']} ops)")
    notes.append(f"              run by the executor: measured {ref.step_s * 1e3:.1f} ms a step, of which its "
                 f"lane ops {sum(ref.lane_op_s.values()) * 1e3:.1f} ms; rates alone predict "
                 f"{ref.fit.bare_s * 1e3:.1f} ms")
    return notes


def _reference_step_notes(ref: _ReferenceFit, first: dict, s: Settings) -> list[str]:
    """The reference step's blocks, and how its set compared with this machine's usual step."""
    tries, usual = first.get("reference_tries", []), s.usual_reference_s
    again = len(tries) > 1 and kept_try(tries) > 0          # a set measured again was kept
    notes = [f"              (the median of {len(ref.block_s)} blocks of {len(first['runtime'][0]['steps'])} steps, "
             f"{'in a row in fresh ranks' if again else 'spread over the calibration'}: "
             f"{', '.join(f'{b * 1e3:.1f}' for b in ref.block_s)} ms)"]
    if len(tries) > 1 and usual is None:
        notes.append(f"              (no earlier calibration of this machine to compare with: the set measured "
                     f"{len(tries)} times, in fresh ranks after the first, "
                     f"{', '.join(f'{t * 1e3:.1f}' for t in tries)} ms; the median kept)")
    elif usual is not None and len(tries) > 1:
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
    return notes


def _variant_notes(profile: MachineProfile, ref: _ReferenceFit) -> list[str]:
    """How far the fitted profile predicts the reference step and each variant fitted with it."""
    if not ref.also:
        return []
    errors = [simulate(g, profile).step_s / sec - 1 for g, sec in ((ref.graph, ref.step_s), *ref.also)]
    return ["              comm_overhead fitted to it and to the same model stepped "
            + " and ".join(f"{name} ({sec * 1e3:.1f} ms)" for (name, _, _), (_, sec) in zip(VARIANTS, ref.also))
            + f", taken in turn step by step with it: predicted {', '.join(f'{e:+.0%}' for e in errors)}"]


def _excess_notes(profile: MachineProfile, first: dict) -> list[str]:
    """compute_excess, where the wide step measured it."""
    if "runtime_wide" not in first:
        return []
    return [f"  compute_excess  {_num(profile.costs.compute_excess)}: a forward or backward in the runtime takes "
            "(1 + this) x its rated time: the same step at width "
            f"{WIDE_WIDTH} ({len(first['runtime_wide']['steps'])} steps), its units' CPU time in their "
            "thread less the fixed costs above, against their rated time"]


def _disk_notes(first: dict, s: Settings, world: int) -> list[str]:
    """The disk: shared by the ranks, its CPU cost beside compute, and one rank's alone."""
    disk = first["disk"]
    return [
        f"  disk        the runtime's swapper ({'O_DIRECT' if disk['direct'] else 'buffered: no O_DIRECT here'}, "
        f"{human_bytes(s.block)} requests, {s.depth} in flight) writing and reading "
        f"{', '.join(human_bytes(n) for n in disk['sizes'])} per rank in {disk['rounds']} interleaved "
        "rounds, each direction fitted to latency + bytes / rate",
        f"              in {s.disk_folder or tempfile.gettempdir()}; disk_read_cpu, disk_write_cpu: "
        f"1 - (a GPT block's forward+backward alone) / (beside back-to-back {human_bytes(DISK_SIZES[2])} "
        f"transfers), the median of {disk['rounds']} rounds: "
        f"{disk['beside_compute']['alone_s'] * 1e3:.2f} ms alone, "
        + ", ".join(f"{t * 1e3:.2f} beside {w}s" for w, t in disk['beside_compute']['beside_s'].items()),
        f"  disk_*_alone  the same transfers by one rank with the disk to itself "
        f"(disk_read, disk_write: each of disk_ranks={world} ranks' share, all at once); zdsl plan uses "
        "the one-rank rates for a one-rank schedule, the aggregate split over its ranks for others",
    ]
