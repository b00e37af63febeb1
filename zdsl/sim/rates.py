"""The rates a schedule's ops get from a machine profile that was measured at another shape.

A profile measures each rate at one setting: the compute rate at some model widths and
precisions, the disk at some number of ranks sharing it. A schedule of another shape is priced
at its own: its compute ops at the rate of its precision, interpolated (log-log) at its unit's
width, in the table of as many ranks as it runs (one alone with every core, else theirs); its
disk transfers at the rate of as many ranks as it runs (one alone, else each rank's share of the
aggregate), and its lanes share the node's cores divided by its ranks. Where the profile lacks
what the schedule needs, the plain ``flops``, ``disk_read`` and ``disk_write`` (or the tables of
the ranks it was measured by) are used as given, and :func:`gaps` says so. A placement striped
over folders on several drives moves its bytes at the sum of their rates (:func:`disk_drives`).
"""
from __future__ import annotations

import functools
import math

from zdsl.ir import BUFFER_KINDS, TaskGraph
from zdsl.lang.sizes import human_bytes
from zdsl.machine_profile import PRECISIONS, MachineProfile
from zdsl.schedule import GPT_DEFAULTS, Placement, nvme_placements
from zdsl.swap_folders import device_of


def precision_of(graph: TaskGraph) -> str:
    return (graph.config.get("train") or {}).get("precision", "fp32")


def compute_tables(machine: MachineProfile, ranks: int) -> MachineProfile:
    """``machine`` with the compute tables a rank of a ``ranks``-rank schedule gets: the profile's
    tables were measured by ``compute_ranks`` ranks at once, each on its share of the node's
    cores; a schedule of fewer ranks has more cores each, and a one-rank one all of them, which
    the ``flops_alone_*`` tables measured (programs/capacity.zs's forward ran at 243 GFLOP/s
    on two cores against the one-core table's 173.5). Between the two, log-log in cores per rank;
    unchanged for as many ranks or more, or where the profile lacks the alone table."""
    compute = machine.compute
    measured = compute.ranks or 0
    if measured <= 1 or ranks >= measured:
        return machine
    # log(cores per rank) from the shared tables' (node / measured) to the alone tables' (node)
    t = 1.0 if ranks <= 1 else math.log(measured / ranks) / math.log(measured)
    tables = {}
    for precision in PRECISIONS:
        shared, alone = compute.table(precision), compute.table(precision, alone=True)
        if shared and alone:
            tables[f"flops_{precision}"] = alone if t == 1.0 else tuple(
                math.exp(math.log(s) + t * (math.log(a) - math.log(s))) for s, a in zip(shared, alone))
    return machine.with_fields(**tables, compute_ranks=ranks) if tables else machine


def flops_at(widths: tuple[float, ...], rates: tuple[float, ...], width: float) -> float:
    """The rate at ``width``: log-log linear between the measured widths, the end's outside them."""
    if width <= widths[0] or len(widths) == 1:
        return rates[0]
    for (w0, r0), (w1, r1) in zip(zip(widths, rates), zip(widths[1:], rates[1:])):
        if width <= w1:
            t = math.log(width / w0) / math.log(w1 / w0)
            return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
    return rates[-1]


def micro_batch_shape(graph: TaskGraph) -> tuple[int, int]:
    """(sequences per micro-batch, tokens per sequence: the data's context, else the model's)."""
    config = graph.config
    context = ((config.get("data") or {}).get("args") or {}).get("context") \
        or ((config.get("model") or {}).get("args") or {}).get("context") or GPT_DEFAULTS["context"]
    return max(1, int((config.get("train") or {}).get("batch", 1))), max(1, int(context))


def unit_widths(graph: TaskGraph) -> list[float]:
    """Per unit, the width of the GPT block whose forward does as many flops per token (24 w^2
    for its 12 w^2 weights, 2 T w for causal attention over T tokens: zdsl/model/units.py): the
    size of its matrix products, which sets how near the machine's peak they run. A block's is
    its width; a head of vocabulary V, about sqrt(width V / 12)."""
    batch, context = micro_batch_shape(graph)
    out = []
    for u in graph.units:
        per_token = u.fwd_flops / (batch * context)
        out.append((math.sqrt(4.0 * context * context + 96.0 * per_token) - 2.0 * context) / 48.0)
    return out


def device_flops(graph: TaskGraph, machine: MachineProfile) -> list[float]:
    """Per unit, the device's compute rate for its forward, backward and recompute: the profile's
    table in the schedule's precision at the unit's width; empty without one (``flops`` then)."""
    table = machine.compute.table(precision_of(graph))
    if not table:
        return []
    return [flops_at(machine.compute.widths, table, w) for w in unit_widths(graph)]


def uses_nvme(graph: TaskGraph) -> bool:
    return any(b.tier == "nvme" for b in graph.buffers.values())


def disk_rates(machine: MachineProfile, ranks: int) -> tuple[float, float]:
    """(read, write) bytes a second one rank moves while ``ranks`` ranks of the node use the disk:
    the one-rank rates alone; else the aggregate the profile measured (its ``disk_ranks`` ranks'
    shares) split over ``ranks``; the profile's as given where it lacks the one it needs."""
    disk = machine.disk
    if disk.ranks is None or ranks == disk.ranks:
        return disk.read, disk.write
    if ranks == 1:
        return (disk.read if disk.read_alone is None else disk.read_alone,
                disk.write if disk.write_alone is None else disk.write_alone)
    scale = disk.ranks / ranks
    return disk.read * scale, disk.write * scale


def cores_per_rank(machine: MachineProfile, ranks: int) -> float | None:
    """Cores each of ``ranks`` ranks of the node has for its lanes: calibrate measures with its
    ``disk_ranks`` ranks on the node, each bound to its share (``cores``), and a run of another
    number of ranks divides the same cores (runtime/dist/affinity.py: cpu_count // ranks threads
    each). A one-rank schedule planned on one core of a two-rank profile shared it among its
    copies, norms, host step and compute, which a one-rank run does on two: programs/capacity.zs's
    device-to-host copies planned at 2.7x their measured time, the forward at 1.9x."""
    cores, measured = machine.costs.cores, machine.disk.ranks
    if cores is None or measured is None or ranks == measured:
        return cores
    return cores * measured / ranks


def for_graph(machine: MachineProfile, graph: TaskGraph) -> MachineProfile:
    """``machine`` with its disk rates, cores and compute tables for the graph's ranks (every rank
    of a schedule is on one node and does its own NVMe I/O), as measured with that many
    (``disk_ranks``, ``compute_ranks``), so resolving it again changes nothing."""
    machine = compute_tables(machine, graph.ranks)
    read, write = disk_rates(machine, graph.ranks)
    cores = cores_per_rank(machine, graph.ranks)
    if (read, write, cores) == (machine.disk.read, machine.disk.write, machine.costs.cores):
        return machine
    return machine.with_fields(disk_read=read, disk_write=write, cores=cores, disk_ranks=graph.ranks)


def gaps(machine: MachineProfile, graph: TaskGraph) -> list[str]:
    """What the profile lacks that the schedule needs, and what was used instead (one line each)."""
    out = []
    precision = precision_of(graph)
    compute, disk = machine.compute, machine.disk
    if compute.widths and not compute.table(precision):
        have = [p for p in PRECISIONS if compute.table(p)]
        why = ("zdsl calibrate does not measure fp16 on a CPU, where its kernels are a slow fallback"
               if precision == "fp16" and machine.name == "cpu" else "calibrate: zdsl calibrate")
        out.append(f"the profile has no {precision} compute rate (it has {', '.join(have) or 'none'} by width): "
                   f"used flops={compute.flops:.3g} at every width; {why}")
    elif compute.widths and 0 < graph.ranks < (compute.ranks or 0) \
            and not compute.table(precision, alone=True):
        out.append(f"the profile has no {precision} compute rate of one rank alone (flops_alone_{precision}): used "
                   f"each of {compute.ranks} ranks' rate on its share of the cores, where this schedule's "
                   f"{graph.ranks} rank(s) have more; calibrate: zdsl calibrate")
    if uses_nvme(graph) and disk.ranks is not None and graph.ranks != disk.ranks:
        if graph.ranks == 1 and (disk.read_alone is None or disk.write_alone is None):
            out.append(f"the profile has no one-rank disk rate (disk_read_alone, disk_write_alone): used each of "
                       f"{disk.ranks} ranks' share of the disk; calibrate: zdsl calibrate --ranks 1")
    return out


def nvme_state(graph: TaskGraph, op) -> str | None:
    """The state whose NVMe buffer an ``nvme.read`` reads or an ``nvme.write`` writes."""
    for name in (*op.reads, *op.writes):
        buf = graph.buffers.get(name)
        if buf is not None and buf.tier == "nvme":
            return BUFFER_KINDS.get(buf.kind)
    return None


def drives(paths: tuple[str, ...]) -> float:
    """How many drives' rates a placement striped evenly over ``paths`` gets: its folders over the
    most of them on one device (``st_dev``), which that device's share of the blocks waits for: two
    folders on two drives 2, on one drive 1, three folders on two drives 1.5. The profile's disk
    rates are one drive's (calibrate measures one folder)."""
    per_device: dict[object, int] = {}
    for folder in paths:
        device = device_of(folder)
        key = folder if device is None else device
        per_device[key] = per_device.get(key, 0) + 1
    return len(paths) / max(per_device.values()) if per_device else 1.0


def disk_drives(graph: TaskGraph, op) -> float:
    """The drives an NVMe transfer's bytes are spread over (:func:`drives` of its state's placement)."""
    raw = (graph.config.get("placement") or {}).get(nvme_state(graph, op))
    paths = Placement.of_config(raw).paths if raw else ()
    return _drives_cached(paths) if len(paths) > 1 else 1.0


@functools.lru_cache(maxsize=64)
def _drives_cached(paths: tuple[str, ...]) -> float:
    return drives(paths)


def nvme_lines(graph: TaskGraph) -> list[str]:
    """Per NVMe placement: its state(s), folders, block and depth, and the drives its folders are on."""
    by_place: dict[tuple, list[str]] = {}
    places = nvme_placements(graph.config)
    for state, place in places.items():
        by_place.setdefault(place.swap_key, []).append(state)
    out = []
    for (paths, block, depth, _), states in by_place.items():
        line = f"nvme: {', '.join(states)} -> {', '.join(paths)} (block {human_bytes(block)}, depth {depth})"
        if len(paths) > 1:
            n = drives(paths)
            line += (f": striped over {len(paths)} folders on {n:g} drives, disk rates x{n:g}" if n > 1 else
                     f": striped over {len(paths)} folders on one device (st_dev), no faster than one folder")
        out.append(line)
    return out
