"""The checked schedule: typed, defaults filled, names resolved.

The checker (``zdsl.check.checker``) builds a :class:`Schedule` from the AST; the
lowering (``zdsl.compile.lower``) turns it into pipelines and a task graph; the
runtime reads ``TaskGraph.config`` (``Schedule.to_config()``) for the
training settings. Every field that came from the source keeps the
:class:`Span` of its statement so later stages can point at it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from zdsl.ir import resolve_over

# The machine profile has its own module; these names are kept here for the schedule's readers.
from zdsl.machine_profile import (
    MACHINE_MAY_BE_ZERO,  # noqa: F401
    MACHINE_OPTIONS,  # noqa: F401
    MACHINE_SHAPE_FIELDS,  # noqa: F401
    MACHINE_TUPLES,  # noqa: F401
    MachineProfile,
)

STATES = ("optimizer", "gradients", "parameters")   # ZeRO's order
OVERLAP_VERBS = ("gather", "scatter", "reduce", "read", "write", "copy")
PHASES = ("forward", "backward", "step")
ALL_OVERLAPS = frozenset(f"{v}/{p}" for v in OVERLAP_VERBS for p in PHASES)
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class Span:
    """Where a statement or token is in a .zs file (1-based line and column)."""
    file: str
    line: int
    column: int
    end_column: int | None = None


# ``gpt(...)``'s sizes where a schedule leaves them out: the language's defaults, read by the
# checker, the overrides, the sizing and the cost model alike.
GPT_DEFAULTS = dict(layers=4, width=128, heads=4, vocab=256, context=64)


@dataclass
class ModelSpec:
    kind: str                              # "gpt", "user", "hf", or "loop" (no statement: initialize's model=)
    args: dict = field(default_factory=dict)   # gpt: sizes; user: the factory's kwargs; hf: config overrides
    factory: str | None = None             # "path/to/file.py:build" or "pkg.module:build" for kind "user"
    path: str | None = None                # kind "hf": the model folder (absolute)


@dataclass
class DataSpec:
    kind: str                              # a source's kind, registered in zdsl/sources/__init__.py
    # its first argument, checked: "stdlib", a file or folder (absolute), a function
    source: str | None = None
    args: dict = field(default_factory=dict)   # context=..., vocab=..., and the kind's own settings
    dtype: str | None = None               # tokens: the file's integer type (zdsl/sources/tokens.py)
    tokenizer: str | None = None           # text, jsonl: tokenizer.json or the folder holding it (absolute)

    def to_config(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TrainSpec:
    steps: int = 10
    batch: int = 8                         # sequences per rank per micro-batch
    accumulate: int = 1                    # micro-batches per optimizer step
    precision: str = "fp32"
    seed: int = 0


@dataclass
class OptimizerSpec:
    kind: str = "adamw"                    # "adamw", "adam", "sgd"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0                  # sgd
    clip: float | None = None              # max global gradient norm
    # the rate per step (zdsl/lr.py has the formula): warmup steps, then decay to min_lr
    warmup: int = 0
    decay: str = "constant"                # "constant", "linear", "cosine"
    min_lr: float = 0.0
    decay_steps: int | None = None         # None: every step after warmup
    # parameters exempt from weight_decay (zdsl/model/decay.py): classes and name globs
    no_decay: tuple[str, ...] = ()         # "biases", "norms", "embeddings"
    no_decay_names: tuple[str, ...] = ()   # fnmatch globs over "unit.param" names

    def to_config(self) -> dict:
        """Plain JSON (tuples as lists)."""
        return {key: list(value) if isinstance(value, tuple) else value
                for key, value in dataclasses.asdict(self).items()}




# O_DIRECT moves whole 4 KiB blocks: an nvme block size, a swap file's size, a checkpoint's offsets.
DIRECT_IO_ALIGN = 4096

# Every CPU collective of 2 ranks of one host goes through shared memory (runtime/dist/shm.py)
# instead of gloo's TCP, at any size. SHARED_MEMORY_OUTBOX: the bytes each such rank writes its
# collectives' pieces into (its outbox), mapped by both ranks from the first collective through it
# on: part of a rank's host memory.
SHARED_MEMORY_OUTBOX = 8 << 20


# NVMe swap settings where ``nvme(...)`` leaves them out: DeepSpeed aio's defaults (block_size 1 MiB,
# queue_depth 8). The checker, the runtime's swapper and calibrate's disk test all read them here.
NVME_BLOCK = 1 << 20
NVME_DEPTH = 8


@dataclass
class Placement:
    """Where one kind of state lives (``offload STATE -> TIER``)."""
    tier: str = "device"                   # "device", "cpu" (host memory) or "nvme"
    paths: tuple[str, ...] = ()            # nvme folders; several: each swap file's blocks striped over them
    pinned: bool = True                    # host buffers pinned where CUDA is present
    ratio: float = 1.0                     # share of units offloaded (partial offload), from the last unit back
    block_bytes: int = NVME_BLOCK          # nvme I/O block size
    queue_depth: int = NVME_DEPTH          # nvme concurrent requests

    def __post_init__(self) -> None:
        # Placement("nvme", "/scratch"): one folder
        self.paths = (self.paths,) if isinstance(self.paths, str) else tuple(self.paths)

    def to_config(self) -> dict:
        """Plain JSON (the folders as a list)."""
        return {**dataclasses.asdict(self), "paths": list(self.paths)}

    @classmethod
    def of_config(cls, raw: dict) -> "Placement":
        """The inverse of :meth:`to_config` (what the runtime and the planner read a graph's config with)."""
        fields = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__ and k != "paths"}
        return cls(**fields, paths=tuple(raw.get("paths", ())))

    @property
    def swap_key(self) -> tuple:
        """What one NVMe swapper is opened with: states whose placements share it share a swapper."""
        return self.paths, self.block_bytes, self.queue_depth, self.pinned


def nvme_placements(config: dict | None) -> dict[str, Placement]:
    """State -> its NVMe placement, from a compiled graph's config (``TaskGraph.config``); the one
    reader of the config's placements for the runtime, the planner and the benchmarks."""
    places = ((config or {}).get("placement") or {}).items()
    return {state: Placement.of_config(raw) for state, raw in places if raw.get("tier") == "nvme"}


@dataclass
class CheckpointSpec:
    every: int
    dir: str
    keep: int = 0                          # 0 keeps all


@dataclass
class EvalSpec:
    """``eval every N steps on SOURCE batches=K``: the mean loss over the same K batches of
    SOURCE (per rank, sharded as training batches are), forward only, every N steps."""
    every: int
    data: DataSpec
    batches: int = 1

    def to_config(self) -> dict:
        return {"every": self.every, "batches": self.batches, "data": self.data.to_config()}


# -- pipelines level -----------------------------------------------------------

@dataclass
class Ref:
    """``parameters[u+2]``: a state and an offset from the template's unit."""
    state: str                             # "parameters", "gradients", "optimizer", "activations"
    offset: int = 0
    absolute: int | None = None            # ``parameters[0]``: a fixed unit


@dataclass
class PipeStmt:
    """One statement of a pipeline template.

    verb: gather | scatter | reduce | read | write | copy | compute |
          recompute | free | step
    ref:  the buffer the verb acts on (compute/recompute/step: offset of the unit)
    tier: ``read X from nvme`` -> "nvme"; ``copy X to host`` -> "host";
          ``step u on cpu`` -> "cpu"
    """
    verb: str
    ref: Ref
    tier: str | None = None
    span: Span | None = None


@dataclass
class Pipeline:
    phase: str                             # "forward", "backward", "step"
    var: str                               # the unit variable, e.g. "u"
    body: list[PipeStmt] = field(default_factory=list)
    span: Span | None = None


@dataclass
class Schedule:
    name: str
    description: str = ""
    file: str = "<string>"
    model: ModelSpec = field(default_factory=lambda: ModelSpec("gpt"))
    data: DataSpec = field(default_factory=lambda: DataSpec("synthetic"))
    train: TrainSpec = field(default_factory=TrainSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    ranks: int = 1
    device: str = "auto"
    per_node: int | None = None            # ranks on each node (``ranks 16, 8 per node``); None: one node
    stage: int = 0                         # 0..3: how many of STATES are sharded
    # state -> the group its shards span: "all", "node" (within each node, replicated across nodes:
    # HSDP) or "group(K)" (K consecutive ranks: MiCS); one group for every sharded state (the checker)
    shard_over: dict[str, str] = field(default_factory=lambda: dict.fromkeys(STATES, "all"))
    secondary: str | None = None           # "node": a node-local second shard of the parameters (ZeRO++'s hpZ)
    placement: dict[str, Placement] = field(default_factory=dict)   # state -> where; missing = device
    prefetch: int = 1                      # units ahead for parameter gathers (and nvme reads)
    bucket_bytes: int = 0                  # max bytes per collective; 0 = one per unit
    overlap: set[str] = field(default_factory=lambda: set(ALL_OVERLAPS))  # "verb/phase" pairs that may overlap compute
    recompute: set[int] = field(default_factory=set)   # unit indices; resolved by the checker
    persist_below: int = 0                 # units with fewer parameters stay gathered (stage 3)
    memory: dict[str, int] = field(default_factory=dict)  # tier -> budget bytes
    machine: MachineProfile = field(default_factory=MachineProfile)
    checkpoint: CheckpointSpec | None = None
    freeze: tuple[str, ...] = ()           # parameter-name globs kept frozen (fine-tuning)
    eval: EvalSpec | None = None
    pipelines: dict[str, Pipeline] = field(default_factory=dict)    # written by hand, else lowered
    spans: dict[str, Span] = field(default_factory=dict)   # statement keyword -> where it was set

    def placed(self, state: str) -> Placement:
        return self.placement.get(state, Placement())

    def shard_group(self) -> str:
        """The group the sharded states' shards span, as an op's group (``zdsl.ir``: "all" or
        "within:S"); one group for every sharded state."""
        return resolve_over(self.shard_over[STATES[0]] if self.stage else None, self.ranks, self.per_node)

    def secondary_group(self) -> str | None:
        """The group the backward gathers parameters within (hpZ's node), or None."""
        return None if self.secondary is None else resolve_over(self.secondary, self.ranks, self.per_node)

    def to_config(self) -> dict:
        """Plain-JSON view for TaskGraph.config (what the runtime reads)."""
        raw = dataclasses.asdict(self)
        raw.pop("spans")
        raw.pop("pipelines")
        raw["overlap"] = sorted(self.overlap)
        raw["recompute"] = sorted(self.recompute)
        raw["optimizer"] = self.optimizer.to_config()
        raw["data"] = self.data.to_config()
        raw["machine"] = self.machine.to_config()
        raw["placement"] = {state: p.to_config() for state, p in self.placement.items()}
        raw["eval"] = self.eval.to_config() if self.eval is not None else None
        raw["freeze"] = list(self.freeze)
        return raw

