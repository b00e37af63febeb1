"""The machine profile: the rates the planner's cost model (zdsl/sim) prices a step with.

Grouped as the cost model reads them: compute, collectives (a link per level: within a node,
across nodes), copies between host and device, the disk, and the runtime's own costs. A value
the profile may lack is ``None`` ("not given") and the group's derived property says what is
used instead, so no reader decodes a sentinel.

One wire format, flat (:data:`WIRE_FIELDS`): the graph's config, the calibration cache and the
``machine`` statement's keywords (:data:`MACHINE_OPTIONS`) all name a value by it. Reading it
(:meth:`MachineProfile.of_fields`) takes the sentinels older writers used for "not given"
(-1 for the fixed costs of a collective, 0 for the rest), so a cached profile of before loads.
Bytes per second, flop per second, seconds.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class ComputeRates:
    """What the device and the host compute at; optionally by model width and precision."""
    flops: float = 5e10                    # device matmul rate (where no table gives one)
    host_flops: float = 5e10               # host compute rate (forward/backward on the host lane)
    memory_bandwidth: float = 1e10         # elementwise work on the device (the optimizer step)
    host_memory_bandwidth: float | None = None   # the optimizer step on the host; None: memory_bandwidth
    # By the schedule's shape (zdsl.sim.rates): a block's forward+backward rate at each width
    widths: tuple[float, ...] = ()         # model widths the tables were measured at (increasing)
    fp32: tuple[float, ...] = ()
    bf16: tuple[float, ...] = ()
    fp16: tuple[float, ...] = ()
    ranks: int | None = None               # ranks measuring at once (each on its share of the cores)
    alone_fp32: tuple[float, ...] = ()     # the same tables by one rank alone with every core of the node
    alone_bf16: tuple[float, ...] = ()
    alone_fp16: tuple[float, ...] = ()

    @property
    def host_memory(self) -> float:
        """The host optimizer step's rate."""
        return self.memory_bandwidth if self.host_memory_bandwidth is None else self.host_memory_bandwidth

    def table(self, precision: str, alone: bool = False) -> tuple[float, ...]:
        """The rates in ``precision``, one per width (empty: none, or not one per width);
        ``alone``: one rank's with every core of the node."""
        rates = getattr(self, f"{'alone_' if alone else ''}{precision}", ())
        return rates if rates and len(rates) == len(self.widths) else ()


@dataclass
class Link:
    """One level's collective rates: bytes a second each rank moves on the wire, seconds per
    collective. The all-gather's always; a reduce-scatter's and an all-reduce's where measured
    apart (on gloo the runtime reduce-scatters with an all-reduce)."""
    bandwidth: float = 2e9
    latency: float = 5e-5
    scatter_bandwidth: float | None = None   # None: bandwidth
    scatter_latency: float | None = None     # None: latency
    reduce_bandwidth: float | None = None    # None: a ring, a reduce-scatter then an all-gather
    reduce_latency: float | None = None      # None: latency (with reduce_bandwidth)

    @property
    def scatter(self) -> tuple[float, float]:
        """(latency, bandwidth) of a reduce-scatter."""
        return (self.latency if self.scatter_latency is None else self.scatter_latency,
                self.bandwidth if self.scatter_bandwidth is None else self.scatter_bandwidth)

    @property
    def reduce(self) -> tuple[float, float] | None:
        """(latency, bandwidth) of an all-reduce measured apart; None: a ring's two halves."""
        if self.reduce_bandwidth is None:
            return None
        return (self.latency if self.reduce_latency is None else self.reduce_latency, self.reduce_bandwidth)


@dataclass
class CollectiveRates:
    """Collectives: the link within a node (on one node, every collective's), the one across
    nodes (``cluster_link``, ``cluster_latency``: bytes a second each rank moves to other nodes,
    e.g. its share of the node's InfiniBand), and how the backend runs them."""
    node: Link = field(default_factory=Link)
    cluster_bandwidth: float | None = None   # a collective whose group spans nodes; None: the node's
    cluster_latency: float | None = None     # the same; None: the node's
    slots: int = 2                           # collectives the backend runs at once (gloo: 2 threads; NCCL: 1)
    under_load: float | None = None          # with shared cores: a collective's rate while compute fills
    #                                          them; None: a fair share like any op

    def level(self, crosses_nodes: bool) -> Link:
        """The link a collective runs on: across nodes one whose ranks span nodes. The cluster
        link has no rates of its own for reduce-scatters and all-reduces: rings over its rate."""
        if not crosses_nodes or (self.cluster_bandwidth is None and self.cluster_latency is None):
            return self.node
        return Link(bandwidth=self.node.bandwidth if self.cluster_bandwidth is None else self.cluster_bandwidth,
                    latency=self.node.latency if self.cluster_latency is None else self.cluster_latency)


@dataclass
class CopyRates:
    """Copies between host and device: PCIe on CUDA; calibrate's memcpy on a cpu machine."""
    pcie_bandwidth: float = 1e10


@dataclass
class DiskRates:
    """The NVMe disk one folder is on, as ``ranks`` ranks shared it when measured."""
    read: float = 1.5e9
    write: float = 2e9
    read_latency: float = 0.0             # seconds per transfer (an nvme.read) beyond its bytes' time
    write_latency: float = 0.0            # the same per nvme.write
    read_cpu: float = 0.1                 # cores an nvme.read keeps busy (system calls, checksums)
    write_cpu: float = 0.1                # the same for an nvme.write
    ranks: int | None = None              # ranks sharing the disk when read/write were measured; None: unknown
    read_alone: float | None = None       # one rank reading with the disk to itself; None: not measured
    write_alone: float | None = None      # the same writing


@dataclass
class RuntimeCosts:
    """What the runtime itself costs per op, and the cores its lanes share."""
    op: float = 0.0                       # seconds to start and finish an op
    kernel: float = 0.0                   # seconds per kernel (aten op) a compute op dispatches
    compute_excess: float = 0.0           # the runtime's compute ops take (1 + this) x their rated time
    comm: float | None = None             # a collective's fixed cost; None: op
    scatter: float | None = None          # a reduce-scatter's; None: comm's
    cores: float | None = None            # CPU cores per rank the lanes share; None: lanes independent
    wake: float = 0.0                     # seconds an op starts after an input made on another lane ended
    loop: float = 0.0                     # the event loop's CPU seconds per op (a free's whole cost)

    @property
    def comm_fixed(self) -> float:
        return self.op if self.comm is None else self.comm

    @property
    def scatter_fixed(self) -> float:
        return self.comm_fixed if self.scatter is None else self.scatter

    @property
    def shared_cores(self) -> float:
        """The cores lanes share; 0 where they do not."""
        return self.cores or 0.0


# Wire name (config, cache, ``machine`` keywords via MACHINE_OPTIONS) -> attribute path.
WIRE_FIELDS = {
    "flops": "compute.flops", "host_flops": "compute.host_flops",
    "memory_bandwidth": "compute.memory_bandwidth", "host_memory_bandwidth": "compute.host_memory_bandwidth",
    "flops_widths": "compute.widths", "flops_fp32": "compute.fp32", "flops_bf16": "compute.bf16",
    "flops_fp16": "compute.fp16", "compute_ranks": "compute.ranks", "flops_alone_fp32": "compute.alone_fp32",
    "flops_alone_bf16": "compute.alone_bf16", "flops_alone_fp16": "compute.alone_fp16",
    "link_bandwidth": "collectives.node.bandwidth", "link_latency": "collectives.node.latency",
    "scatter_bandwidth": "collectives.node.scatter_bandwidth", "scatter_latency": "collectives.node.scatter_latency",
    "reduce_bandwidth": "collectives.node.reduce_bandwidth", "reduce_latency": "collectives.node.reduce_latency",
    "cluster_bandwidth": "collectives.cluster_bandwidth", "cluster_latency": "collectives.cluster_latency",
    "comm_slots": "collectives.slots", "comm_under_load": "collectives.under_load",
    "pcie_bandwidth": "copies.pcie_bandwidth",
    "disk_read": "disk.read", "disk_write": "disk.write",
    "disk_read_latency": "disk.read_latency", "disk_write_latency": "disk.write_latency",
    "disk_read_cpu": "disk.read_cpu", "disk_write_cpu": "disk.write_cpu", "disk_ranks": "disk.ranks",
    "disk_read_alone": "disk.read_alone", "disk_write_alone": "disk.write_alone",
    "op_overhead": "costs.op", "kernel_overhead": "costs.kernel", "compute_excess": "costs.compute_excess",
    "comm_overhead": "costs.comm", "scatter_overhead": "costs.scatter", "cores": "costs.cores",
    "wake_latency": "costs.wake", "loop_overhead": "costs.loop",
}
# Optional values a fixed cost may be 0 of: their older "not given" was -1 (any value below 0).
NEGATIVE_UNSET = ("comm_overhead", "scatter_overhead")


@dataclass
class MachineProfile:
    """Rates the cost model uses, grouped (see the module docstring)."""
    name: str = "cpu"                     # "cpu" or "cuda": which lanes run on the host
    compute: ComputeRates = field(default_factory=ComputeRates)
    collectives: CollectiveRates = field(default_factory=CollectiveRates)
    copies: CopyRates = field(default_factory=CopyRates)
    disk: DiskRates = field(default_factory=DiskRates)
    costs: RuntimeCosts = field(default_factory=RuntimeCosts)

    @classmethod
    def of(cls, name: str = "cpu", **fields) -> "MachineProfile":
        """The default profile with ``fields`` (wire names) set; an unknown name is a TypeError."""
        return cls(name=name).with_fields(**fields)

    def with_fields(self, **fields) -> "MachineProfile":
        """A copy with ``fields`` (wire names) set; a value read as "not given" (:func:`_given`) unsets it."""
        out = copy.deepcopy(self)
        for wire, value in fields.items():
            if wire == "name":
                out.name = value
                continue
            if wire not in WIRE_FIELDS:
                raise TypeError(f"MachineProfile has no field {wire!r}")
            *groups, attr = WIRE_FIELDS[wire].split(".")
            holder = out
            for group in groups:
                holder = getattr(holder, group)
            setattr(holder, attr, _given(wire, value))
        return out

    def value(self, wire: str):
        """The value of the wire-named field (None: not given)."""
        holder = self
        for part in WIRE_FIELDS[wire].split("."):
            holder = getattr(holder, part)
        return holder

    def to_config(self) -> dict:
        """Plain JSON, flat by wire name: the values given (None and empty tables left out)."""
        raw: dict[str, object] = {"name": self.name}
        for wire in WIRE_FIELDS:
            v = self.value(wire)
            if v is not None and v != ():
                raw[wire] = list(v) if isinstance(v, tuple) else v
        return raw

    @classmethod
    def of_fields(cls, raw: dict) -> "MachineProfile":
        """A profile from flat wire fields (unknown ones left out, lists as tuples, the older
        "not given" sentinels as not given)."""
        return cls(name=raw.get("name", "cpu")).with_fields(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in WIRE_FIELDS})

    @classmethod
    def of_config(cls, config: dict | None) -> "MachineProfile":
        """The profile a compiled graph's config carries (the schedule's ``machine``), else the defaults."""
        raw = (config or {}).get("machine")
        return cls.of_fields(raw) if isinstance(raw, dict) else cls()


def _given(wire: str, value):
    """``value`` for an optional field, None where it says "not given": the older writers' -1
    for a collective's fixed costs, 0 for the other optional values (no rate, count or share is 0)."""
    default = _DEFAULT.value(wire) if wire in WIRE_FIELDS else value
    if default is not None or value is None or isinstance(value, tuple):
        return value
    return None if (value < 0 if wire in NEGATIVE_UNSET else value <= 0) else value


_DEFAULT = MachineProfile()


# ``machine cpu(KEY=...)`` keyword -> wire name, in the order they are written.
MACHINE_OPTIONS = (
    ("flops", "flops"), ("host_flops", "host_flops"),
    ("link", "link_bandwidth"), ("latency", "link_latency"),
    ("scatter_link", "scatter_bandwidth"), ("scatter_latency", "scatter_latency"),
    ("reduce_link", "reduce_bandwidth"), ("reduce_latency", "reduce_latency"),
    ("cluster_link", "cluster_bandwidth"), ("cluster_latency", "cluster_latency"),
    ("pcie", "pcie_bandwidth"), ("disk_read", "disk_read"), ("disk_write", "disk_write"),
    ("disk_read_latency", "disk_read_latency"), ("disk_write_latency", "disk_write_latency"),
    ("disk_read_cpu", "disk_read_cpu"), ("disk_write_cpu", "disk_write_cpu"),
    ("memory_bw", "memory_bandwidth"), ("host_memory_bw", "host_memory_bandwidth"),
    ("overhead", "op_overhead"), ("kernel_overhead", "kernel_overhead"), ("compute_excess", "compute_excess"),
    ("comm_overhead", "comm_overhead"), ("scatter_overhead", "scatter_overhead"),
    ("cores", "cores"), ("comm_slots", "comm_slots"), ("comm_under_load", "comm_under_load"),
    ("wake", "wake_latency"), ("loop", "loop_overhead"),
    ("flops_widths", "flops_widths"), ("flops_fp32", "flops_fp32"), ("flops_bf16", "flops_bf16"),
    ("flops_fp16", "flops_fp16"), ("compute_ranks", "compute_ranks"),
    ("flops_alone_fp32", "flops_alone_fp32"), ("flops_alone_bf16", "flops_alone_bf16"),
    ("flops_alone_fp16", "flops_alone_fp16"),
    ("disk_ranks", "disk_ranks"), ("disk_read_alone", "disk_read_alone"), ("disk_write_alone", "disk_write_alone"),
)
# ``link LEVEL=(RATE, LATENCY)``: the ``machine`` keywords of each level's rate and latency. The
# statement and the keywords set the same fields (zdsl/check/machine.py reads both through one function).
LINK_LEVELS = {"node": ("link", "latency"), "cluster": ("cluster_link", "cluster_latency")}


def given_links(schedule) -> dict[str, float]:
    """The wire fields a ``link`` statement gave ``schedule`` (its ``link.LEVEL`` spans), as its
    profile holds them: to set on the profile the schedule is planned with where that is not its
    own (this machine's calibrated one, where it has no ``machine`` statement)."""
    wires = dict(MACHINE_OPTIONS)
    return {wires[key]: schedule.machine.value(wires[key]) for level, keys in LINK_LEVELS.items()
            if f"link.{level}" in schedule.spans for key in keys}


# Keywords (each its wire name) whose value is a tuple of numbers, one per ``flops_widths``:
# ``flops_bf16=(5e10, 2e11, 3e11)``.
MACHINE_TUPLES = ("flops_widths", "flops_fp32", "flops_bf16", "flops_fp16",
                  "flops_alone_fp32", "flops_alone_bf16", "flops_alone_fp16")
# The fields that give a rate by the schedule's shape (zdsl.sim.rates); unset: rates as given.
MACHINE_SHAPE_FIELDS = (*MACHINE_TUPLES, "compute_ranks", "disk_ranks", "disk_read_alone", "disk_write_alone")
# Keywords calibrate leaves to the user: it measures one machine, and the link across nodes is not on it.
MACHINE_NOT_MEASURED = ("cluster_link", "cluster_latency")
# Keywords that may be 0 (a fixed cost, sharing off, or "not given"); other rates must be > 0.
MACHINE_MAY_BE_ZERO = ("overhead", "kernel_overhead", "compute_excess", "comm_overhead", "scatter_overhead", "cores",
                       "comm_under_load", "wake", "loop",
                       "scatter_link", "scatter_latency", "reduce_link", "reduce_latency", "host_memory_bw",
                       "disk_read_latency", "disk_write_latency", "disk_read_cpu", "disk_write_cpu",
                       "compute_ranks", "disk_ranks", "disk_read_alone", "disk_write_alone")
