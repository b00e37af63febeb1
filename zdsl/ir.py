"""The task graph: the contract between the compiler and the runtime.

Plain dataclasses, serialisable to JSON, identical on every rank (SPMD: a
rank's shard index is bound only at run time).

Buffers are named ``<state>[<unit>]`` with an optional ``@<tier>`` suffix for
a staging copy away from the state's home tier, e.g. ``param_shard[3]``,
``param_full[3]``, ``grad_shard[3]@host``, ``optim[3]``, ``act[4]``.
The graph covers one optimizer step (all micro-batches); the runtime runs
it once per step.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field

# Tiers, nearest the compute first.
TIERS = ("device", "host", "nvme")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}   # bytes per element of each precision

# Lanes per device. Within a lane ops run in graph order; across lanes only
# dependencies order them.
LANES = ("compute", "comm", "h2d", "d2h", "nvme", "host")

# Buffer kinds. ``state`` says which model state a buffer is part of (for the
# planner's split of memory into parameters, gradients and optimizer), or
# None for working buffers.
BUFFER_KINDS = {
    "param_shard": "parameters",   # this rank's shard of a unit's parameters (compute dtype)
    "param_full": "parameters",    # a unit's gathered parameters (model state at stages 0-2, working at 3)
    "param_sec": "parameters",     # hpZ: this rank's node-local slice of a unit's gathered parameters
    "grad_full": "gradients",      # a unit's full gradient (model state at stages 0-1, working at 2-3)
    "grad_shard": "gradients",     # this rank's reduced gradient shard
    "optim": "optimizer",          # fp32 master shard (mixed precision) and moments
    "act": None,                   # a unit's saved input (and autograd's saved tensors unless recomputed)
    "act_grad": None,              # gradient w.r.t. a unit's input
    "norm": None,                  # the global gradient norm / overflow flag (a scalar)
    "loss": None,                  # the step's loss (a scalar)
    "act_inner": None,             # a unit's saved tensors re-materialised by recompute
    "token": None,                 # zero-byte ordering token (an `overlap` policy that forbids overlap)
}

# Op kinds and the lane each runs on by default.
OP_LANES = {
    "compute.forward": "compute",
    "compute.backward": "compute",
    "compute.recompute": "compute",
    "compute.norm": "compute",
    "compute.step": "compute",      # lane "host" when the step runs on the host
    "comm.all_gather": "comm",
    "comm.reduce_scatter": "comm",
    "comm.all_reduce": "comm",
    "copy.h2d": "h2d",
    "copy.d2h": "d2h",
    "nvme.read": "nvme",
    "nvme.write": "nvme",
    "mem.free": "compute",          # frees are bookkeeping; lane chosen by the lowering
}

COLLECTIVE_KINDS = ("comm.all_gather", "comm.reduce_scatter", "comm.all_reduce")

# The ranks a collective runs over (``Op.group``), the same string on every rank:
#   "all"         every rank;
#   "within:S"    the S consecutive ranks holding this rank (ranks [r//S*S, r//S*S+S)): a node is
#                 within:per_node, MiCS's group(K) within:K;
#   "across:S"    the ranks with this rank's index within its S-group (r' % S == r % S): the
#                 replicas of one shard (the all-reduce of HSDP's and MiCS's gradient shards).
# A group of every rank is always "all" (within:world is never written), so a flat schedule's
# graph is the graph it was before groups existed.
ALL = "all"


def within(size: int, world: int) -> str:
    """The group of ``size`` consecutive ranks ("all" when that is every rank)."""
    return ALL if size >= world else f"within:{size}"


def across(size: int) -> str:
    """The replicas of one shard of a ``size``-rank shard group."""
    return f"across:{size}"


@functools.lru_cache(maxsize=256)
def parse_group(group: str) -> tuple[str, int]:
    """("all", 0), ("within", S) or ("across", S); ValueError for anything else. Cached: a
    schedule has a few groups and the compiler and planner ask it of every collective."""
    if group == ALL:
        return ALL, 0
    kind, _, size = group.partition(":")
    if kind not in ("within", "across") or not size.isdigit() or int(size) < 1:
        raise ValueError(f"not a collective group: {group!r}")
    return kind, int(size)


@functools.lru_cache(maxsize=256)
def group_size(group: str, world: int) -> int:
    """How many ranks ``group`` holds in a run of ``world``. Cached as :func:`parse_group`."""
    kind, size = parse_group(group)
    return world if kind == ALL else size if kind == "within" else world // size


def group_ranks(group: str, rank: int, world: int) -> list[int]:
    """The ranks of ``rank``'s ``group`` in a run of ``world``, in rank order."""
    kind, size = parse_group(group)
    if kind == ALL:
        return list(range(world))
    if kind == "within":
        first = rank // size * size
        return list(range(first, first + size))
    return list(range(rank % size, world, size))


def group_members(group: str, world: int) -> list[list[int]]:
    """Every member set of ``group`` (each rank in exactly one), in the order of their lowest rank:
    the order every rank creates their process groups in."""
    kind, size = parse_group(group)
    if kind == ALL:
        return [list(range(world))]
    if kind == "within":
        return [list(range(first, first + size)) for first in range(0, world, size)]
    return [list(range(first, world, size)) for first in range(size)]


@functools.lru_cache(maxsize=256)
def crosses_nodes(group: str, world: int, per_node: int) -> bool:
    """Some member set of ``group`` lies on more than one node (``per_node`` ranks each, in rank
    order; 0: one node holds every rank). Cached: a plan asks it of every collective, at up to
    O(world) a question."""
    if not per_node or per_node >= world:
        return False
    kind, size = parse_group(group)
    if kind == ALL:
        return True
    if kind == "within":
        return any(first // per_node != (first + size - 1) // per_node for first in range(0, world, size))
    return any(first // per_node != (first + world - size) // per_node for first in range(size))


def resolve_over(over: str | None, world: int, per_node: int | None) -> str:
    """A schedule's shard group (``all``, ``node``, ``group(K)``; None: all) as an op's group:
    a node is ``per_node`` consecutive ranks (all of them where ``per_node`` is unset)."""
    if over in (None, ALL):
        return ALL
    if over == "node":
        return within(per_node or world, world)
    if over.startswith("group(") and over.endswith(")") and over[6:-1].isdigit():
        return within(int(over[6:-1]), world)
    raise ValueError(f"not a shard group: {over!r}")


def buffer_name(kind: str, unit: int | None = None, tier: str | None = None) -> str:
    """``param_full[3]``, ``grad_shard[3]@host``, ``norm``."""
    name = kind if unit is None else f"{kind}[{unit}]"
    return name if tier is None else f"{name}@{tier}"


def optimizer_bytes_per_param(kind: str, momentum: float, master: bool) -> int:
    """fp32 bytes of optimizer state per parameter: the moments (Adam/AdamW two, SGD with
    momentum one, plain SGD none), plus 4 when an fp32 master copy lives with them."""
    if kind in ("adam", "adamw"):
        moments = 8
    elif kind == "sgd":
        moments = 4 if momentum else 0
    else:
        raise ValueError(f"unknown optimizer {kind!r}")
    return moments + (4 if master else 0)


def parse_buffer_name(name: str) -> tuple[str, int | None, str | None]:
    """Inverse of :func:`buffer_name`."""
    base, _, tier = name.partition("@")
    if "[" in base:
        kind, _, rest = base.partition("[")
        return kind, int(rest.rstrip("]")), tier or None
    return base, None, tier or None


@dataclass
class Buffer:
    name: str                 # unique in the graph, see buffer_name()
    kind: str                 # one of BUFFER_KINDS
    unit: int | None
    tier: str                 # one of TIERS
    bytes: int                # bytes this buffer holds on one rank when live
    persistent: bool = False  # model state: live for the whole step, never freed
    dtype: str = "fp32"       # "fp32", "bf16", "fp16"
    # a host buffer is page-locked where the device is CUDA (fast, asynchronous copies) unless the
    # placement that put it there says ``pinned=false``
    pinned: bool = True

    @property
    def state(self) -> str | None:
        """parameters / gradients / optimizer for model states, else None."""
        return BUFFER_KINDS[self.kind] if self.persistent else None


@dataclass
class Op:
    id: int                   # position in issue order (graph order)
    kind: str                 # one of OP_LANES
    lane: str                 # one of LANES
    unit: int | None
    reads: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    bytes: int = 0            # bytes moved (comm: per rank sent+received payload; copy/nvme: bytes)
    flops: float = 0.0        # compute ops
    kernels: int = 0          # compute ops: aten ops the runtime dispatches for it (fixed cost each)
    deps: list[int] = field(default_factory=list)  # op ids, derived from reads/writes
    micro: int = 0            # micro-batch index (gradient accumulation)
    phase: str = ""           # "forward", "backward", "step"
    part: int = 0             # bucket part of a unit's flat buffer (collectives split by bucket size)
    parts: int = 1
    accumulate: bool = False  # reduce_scatter / backward: add into the destination instead of overwrite
    span: tuple[int, int] | None = None  # (line, column) of the .zs statement that emitted it
    group: str = ALL          # collectives: the ranks it runs over (see ``ALL``)

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS


@dataclass
class UnitInfo:
    """What the runtime and planner need to know of one unit."""
    index: int
    name: str                 # "embedding", "block.3", "head"
    numel: int                # parameters owned by this unit
    padded_numel: int         # numel padded so every part splits evenly over ranks
    shard_numel: int          # padded_numel // ranks
    parts: int = 1            # bucket parts (see zdsl.model.layout)
    uses: list[int] = field(default_factory=list)   # other units whose parameters it reads (tied weights)
    recompute: bool = False
    persistent: bool = False  # stays gathered for the whole step (persistence threshold)
    act_bytes: int = 0        # activation bytes saved per micro-batch (without recompute)
    input_bytes: int = 0      # bytes of the unit's input per micro-batch
    fwd_flops: float = 0.0    # per micro-batch
    master: bool = False      # its optimizer state holds an fp32 master copy of its parameters
    # element ranges of its flat parameters that weight decay applies to (zdsl/model/decay.py);
    # None: all of them
    decay: list[tuple[int, int]] | None = None
    # its parameters (indices, registration order) that ``freeze`` keeps frozen: no gradient, no
    # optimizer state, never updated (zdsl/model/freeze.py); None: none
    frozen: list[int] | None = None
    # some parameter of it trains: only then has it gradients, optimizer state, reductions and a step
    trains: bool = True
    # a partly frozen unit's layout (zdsl/model/layout.py): its last ``frozen_parts`` parts of
    # ``frozen_part_numel`` hold the frozen parameters; ``runs`` maps registration order to the buffer
    frozen_parts: int = 0
    frozen_part_numel: int = 0
    runs: list[list[int]] | None = None


@dataclass
class TaskGraph:
    """One optimizer step of a schedule, for one (any) rank."""
    schedule: str
    ranks: int
    stage: int
    precision: str
    accumulate: int
    units: list[UnitInfo]
    buffers: dict[str, Buffer]
    ops: list[Op]
    config: dict = field(default_factory=dict)  # the checked schedule as plain JSON (train, optimizer, offload, ...)
    per_node: int = 0         # ranks per node; 0: one node holds every rank

    # -- serialisation -------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "TaskGraph":
        raw = json.loads(text)
        raw["units"] = [UnitInfo(**u) for u in raw["units"]]
        raw["buffers"] = {k: Buffer(**b) for k, b in raw["buffers"].items()}
        ops = []
        for o in raw["ops"]:
            if o.get("span") is not None:
                o["span"] = tuple(o["span"])
            ops.append(Op(**o))
        raw["ops"] = ops
        return cls(**raw)

    def digest(self) -> str:
        """Hash the ranks exchange before the first step: equal graphs, equal digests."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    # -- queries ---------------------------------------------------------------
    def lane_ops(self, lane: str) -> list[Op]:
        return [op for op in self.ops if op.lane == lane]

    def collectives(self) -> list[Op]:
        return [op for op in self.ops if op.kind in COLLECTIVE_KINDS]

    # -- hierarchical sharding (the schedule's shard_over and secondary, in ``config``) ----------
    def shard_group(self) -> str:
        """The group every sharded state's shards span: "all", or "within:S" for HSDP and MiCS. A
        unit's layout has a shard per rank of it (``UnitInfo.shard_numel``)."""
        over = (self.config.get("shard_over") or {}).get("optimizer") if self.stage else None
        return resolve_over(over, self.ranks, self.per_node)

    def shard_ranks(self) -> int:
        """The ranks of :meth:`shard_group`: how many shards a unit's layout has."""
        return group_size(self.shard_group(), self.ranks)

    def secondary_group(self) -> str | None:
        """hpZ's node, where the backward gathers the parameters from their secondary shard; or None."""
        over = self.config.get("secondary") if self.stage == 3 else None
        return None if over is None else resolve_over(over, self.ranks, self.per_node)
