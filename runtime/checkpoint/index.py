"""The checkpoint index: what a checkpoint holds, and the names of its files.

A checkpoint is a folder ``ROOT/step-000123/`` holding one safetensors file
per rank (``rank-00000-of-00002.safetensors``), one done marker per rank
(``rank-00000-of-00002.done``, JSON: the file's size and checksums) and,
written last by rank 0, ``index.json``. The index says everything needed to
use the shards without the ranks that wrote them: per unit its name, the
module prefix of its parameters in the model's state dict, the parameters'
names, shapes and dtype, the flat layout (numel, padding, parts, rank
count; a partly frozen unit's frozen parts and the runs that place its
parameters, see zdsl/model/layout.py); the step, the schedule's hash, the data position, the loss scaler;
and per file its size and a CRC-32 per tensor. The index carries a SHA-256
digest of its own content, so an edited index is refused too.

A unit's layout may have fewer shards than the checkpoint has ranks (a shard group: HSDP's
node, MiCS's group): the first replica of each shard, ranks 0..S-1, write the shards, the other
ranks only their per-rank state, so the files read as a flat run of S ranks would have written them.

Shard keys inside a rank file: ``u{i}.{kind}`` for flat shards of unit i
(kind: ``param``, ``exp_avg``, ``exp_avg_sq``, ``momentum``, ``grad_accum``,
...; re-cut on load for another layout), anything else (``rng.cpu``,
``rng.cuda``, ...) is per-rank state handed back as saved.

JSON only; nothing here is ever unpickled.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from zdsl.model.layout import FlatLayout
from zdsl.runtime.checkpoint.errors import CheckpointError

FORMAT = "zdsl-checkpoint"
VERSION = 1
INDEX_NAME = "index.json"
STEP_RE = re.compile(r"^step-(\d+)$")
SHARD_KEY_RE = re.compile(r"^u(\d+)\.([A-Za-z_][A-Za-z0-9_]*)$")
PAD_PREFIX = "__pad."        # zero tensors that page-align the next one in a rank file (not state)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_path(root, step: int) -> Path:
    return Path(root) / step_dir_name(step)


def rank_file_name(rank: int, ranks: int) -> str:
    return f"rank-{rank:05d}-of-{ranks:05d}.safetensors"


def done_name(rank: int, ranks: int) -> str:
    return f"rank-{rank:05d}-of-{ranks:05d}.done"


def shard_key(unit: int, kind: str) -> str:
    return f"u{unit}.{kind}"


def is_padding(key: str) -> bool:
    return key.startswith(PAD_PREFIX)


def parse_shard_key(key: str) -> tuple[int, str] | None:
    """(unit, kind) of a flat shard key ``u3.exp_avg``; None for per-rank state."""
    m = SHARD_KEY_RE.match(key)
    return (int(m.group(1)), m.group(2)) if m else None


def default_prefix(unit_name: str) -> str:
    """Module prefix of a built-in GPT unit in the model's state dict: ``block.3`` -> ``blocks.3``."""
    if unit_name.startswith("block."):
        return "blocks." + unit_name.split(".", 1)[1]
    return unit_name


@dataclass
class UnitMeta:
    """One unit as the checkpoint records it."""
    name: str                                   # as in zdsl.model.units (``embedding``, ``block.0``, ``head``)
    prefix: str                                 # module prefix in the state dict (``blocks.0``)
    params: list[tuple[str, tuple[int, ...]]]   # registration order = order in the flat buffer
    numel: int
    parts: int
    part_numel: int
    ranks: int
    dtype: str = "float32"                      # dtype of the model's parameters (the export default)
    # a partly frozen unit's layout (zdsl/model/layout.py): frozen parts last, ``runs`` from
    # registration order to the flat buffer; absent for the plain order
    frozen_parts: int = 0
    frozen_part_numel: int = 0
    runs: tuple[tuple[int, int, int], ...] = ()

    @property
    def layout(self) -> FlatLayout:
        return FlatLayout(self.numel, self.ranks, self.parts, self.part_numel, self.frozen_parts,
                          self.frozen_part_numel, self.runs)

    @staticmethod
    def from_spec(spec, layout: FlatLayout, prefix: str | None = None, dtype: str = "float32") -> "UnitMeta":
        """From a zdsl.model.units.UnitSpec (or anything with ``name`` and ``params``) and its layout."""
        params = [(n, tuple(int(s) for s in shape)) for n, shape in spec.params]
        numel = sum(math.prod(s) for _, s in params)
        if numel != layout.numel:
            raise CheckpointError(f"unit {spec.name}: parameters hold {numel} elements, layout says {layout.numel}")
        return UnitMeta(spec.name, default_prefix(spec.name) if prefix is None else prefix, params,
                        layout.numel, layout.parts, layout.part_numel, layout.ranks, dtype,
                        layout.frozen_parts, layout.frozen_part_numel, layout.runs)

    def to_json(self) -> dict:
        return {"name": self.name, "prefix": self.prefix, "dtype": self.dtype,
                "params": [[n, list(s)] for n, s in self.params],
                "numel": self.numel, "padded_numel": self.layout.padded_numel,
                "parts": self.parts, "part_numel": self.part_numel, "ranks": self.ranks,
                **({"frozen_parts": self.frozen_parts, "frozen_part_numel": self.frozen_part_numel,
                    "runs": [list(r) for r in self.runs]} if self.runs else {})}

    @staticmethod
    def from_json(d: dict) -> "UnitMeta":
        return UnitMeta(d["name"], d["prefix"], [(n, tuple(int(x) for x in s)) for n, s in d["params"]],
                        int(d["numel"]), int(d["parts"]), int(d["part_numel"]), int(d["ranks"]),
                        d.get("dtype", "float32"), int(d.get("frozen_parts", 0)), int(d.get("frozen_part_numel", 0)),
                        tuple((int(a), int(b), int(c)) for a, b, c in d.get("runs", ())))

    def state_dict_keys(self) -> list[str]:
        return [f"{self.prefix}.{n}" if self.prefix else n for n, _ in self.params]


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a file, and the CRC-32 of each of its ``block``-byte blocks."""
    dtype: str                 # safetensors code, e.g. "F32"
    shape: tuple[int, ...]
    begin: int                 # byte offsets inside the data section
    end: int
    crc32: tuple[int, ...]     # one checksum per block (of algorithm ``algo``)
    block: int                 # bytes per checksum block (the writer's stformat.CRC_BLOCK)
    algo: str = "crc32"

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "offsets": [self.begin, self.end],
                "block": self.block, "algo": self.algo, "crc32": list(self.crc32)}

    @staticmethod
    def from_json(d: dict) -> "TensorEntry":
        return TensorEntry(d["dtype"], tuple(int(x) for x in d["shape"]), int(d["offsets"][0]),
                           int(d["offsets"][1]), tuple(int(c) for c in d["crc32"]), int(d["block"]),
                           d.get("algo", "crc32"))


@dataclass
class FileRecord:
    """One rank's file as written: size and checksums (the content of its done marker)."""
    name: str
    rank: int
    ranks: int
    bytes: int
    header_crc32: int
    tensors: dict          # name -> TensorEntry
    tag: str = ""          # the save's identity, equal on all ranks (guards against stale markers)

    def to_json(self) -> dict:
        return {"name": self.name, "rank": self.rank, "ranks": self.ranks, "bytes": self.bytes,
                "header_crc32": self.header_crc32, "tag": self.tag,
                "tensors": {k: v.to_json() for k, v in self.tensors.items()}}

    @staticmethod
    def from_json(d: dict) -> "FileRecord":
        return FileRecord(d["name"], int(d["rank"]), int(d["ranks"]), int(d["bytes"]),
                          int(d["header_crc32"]), {k: TensorEntry.from_json(v) for k, v in d["tensors"].items()},
                          d.get("tag", ""))


@dataclass
class Index:
    """The content of ``index.json``."""
    step: int
    ranks: int
    units: list[UnitMeta]
    files: list[FileRecord]
    schedule_hash: str = ""
    data_position: dict = field(default_factory=dict)
    loss_scaler: dict | None = None
    aliases: dict = field(default_factory=dict)   # state-dict key -> key it duplicates (tied weights)
    extra: dict = field(default_factory=dict)     # anything JSON the runtime wants back on resume

    def body(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "step": self.step, "ranks": self.ranks,
                "schedule_hash": self.schedule_hash, "data_position": self.data_position,
                "loss_scaler": self.loss_scaler, "aliases": self.aliases, "extra": self.extra,
                "units": [u.to_json() for u in self.units], "files": [f.to_json() for f in self.files]}

    def to_json_bytes(self) -> bytes:
        body = self.body()
        body["digest"] = body_digest(body)
        return json.dumps(body, indent=1).encode()

    @staticmethod
    def from_json_bytes(raw: bytes, where: str) -> "Index":
        try:
            body = json.loads(raw)
        except ValueError:
            raise CheckpointError(f"{where}: not valid JSON (truncated or damaged)") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a zdsl checkpoint index")
        if body.get("version") != VERSION:
            raise CheckpointError(f"{where}: index version {body.get('version')}, this zdsl reads {VERSION}")
        digest = body.pop("digest", None)
        if digest != body_digest(body):
            raise CheckpointError(f"{where}: digest mismatch (index altered)")
        try:
            index = Index(int(body["step"]), int(body["ranks"]), [UnitMeta.from_json(u) for u in body["units"]],
                          [FileRecord.from_json(f) for f in body["files"]], body.get("schedule_hash", ""),
                          body.get("data_position") or {}, body.get("loss_scaler"), body.get("aliases") or {},
                          body.get("extra") or {})
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{where}: malformed index ({type(e).__name__}: {e})") from None
        for f in index.files:      # file names come from the index: never let one point elsewhere
            if f.name != rank_file_name(f.rank, index.ranks):
                raise CheckpointError(f"{where}: file {f.name!r} is not rank {f.rank}'s file name")
        return index

    def file_for_rank(self, rank: int) -> FileRecord:
        for f in self.files:
            if f.rank == rank:
                return f
        raise CheckpointError(f"index lists no file for rank {rank} of {self.ranks}")


def body_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def unit_prefixes(model) -> list[str]:
    """Each unit's qualified module name in ``model`` (a module following the unit protocol).

    These prefixes make the exported keys the model's own ``state_dict`` keys.
    """
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, unit in enumerate(model.units()):
        if id(unit) not in names:
            raise CheckpointError(f"unit {i} ({type(unit).__name__}) is not a submodule of the model")
        out.append(names[id(unit)])
    return out


def state_dict_aliases(model, units: list[UnitMeta]) -> dict[str, str]:
    """{key: key it duplicates} for parameters the model's state dict lists under a second name (tied).

    The units register every parameter once; a model that also registers a
    tied parameter elsewhere (``lm_head.weight is wte.weight``) lists it
    twice in ``state_dict``, and export must write both keys for a strict load.
    """
    owned = {key for u in units for key in u.state_dict_keys()}
    by_id: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in owned:
            by_id.setdefault(id(p), name)
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in owned:
            if id(p) not in by_id:
                raise CheckpointError(f"parameter {name} is in no unit; the checkpoint could not restore it")
            aliases[name] = by_id[id(p)]
    return aliases
