"""Finding, checking and loading checkpoints, re-cut for any rank count or layout.

A checkpoint is complete iff its ``index.json`` parses, its digest holds,
and every file it lists has the recorded size, header and per-tensor
CRC-32. Discovery scans ``ROOT/step-*`` folders (no ``latest`` link to go
stale) from the newest down and refuses a damaged one by naming the file.

Loading streams unit by unit: for each unit and state kind, the new rank's
shard is assembled from the slices of the old ranks' shards it overlaps
(old padding dropped by ``numel``, new padding zero), so host memory stays
at the output plus one old shard of one unit. Every tensor read is checked
against its CRC as it is read.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from zdsl.model.layout import FlatLayout
from zdsl.runtime.checkpoint.errors import CheckpointError
from zdsl.runtime.checkpoint.index import INDEX_NAME, STEP_RE, Index, is_padding, parse_shard_key, shard_key
from zdsl.runtime.checkpoint.stformat import ShardFile, byte_view, torch_dtype

log = logging.getLogger("zdsl.checkpoint")


def read_index(ckpt_path) -> Index:
    """The index of checkpoint folder ``ckpt_path``; CheckpointError naming the file if absent or damaged."""
    path = Path(ckpt_path) / INDEX_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (checkpoint incomplete: a rank did not finish, "
                              f"or the save was interrupted)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    return Index.from_json_bytes(raw, str(path))


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-*`` folder under ``root``, oldest first, complete or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


class RankFiles:
    """The rank files of a checkpoint, each opened (size and header checked) on first use.

    Lazy so that a rank resuming at the same rank count opens only its own
    file, not all N of them (N ranks times N files on a shared filesystem).
    """

    def __init__(self, ckpt_path, index: Index):
        self.dir = Path(ckpt_path)
        self.recs = {r.rank: r for r in index.files}
        self.opened: dict[int, ShardFile] = {}

    def __getitem__(self, rank: int) -> ShardFile:
        if rank not in self.opened:
            rec = self.recs.get(rank)
            if rec is None:
                raise CheckpointError(f"{self.dir / INDEX_NAME}: lists no file for rank {rank}")
            self.opened[rank] = ShardFile(str(self.dir / rec.name), rec.bytes, rec.header_crc32)
        return self.opened[rank]

    def __contains__(self, rank: int) -> bool:
        return rank in self.recs

    def close(self) -> None:
        for f in self.opened.values():
            f.close()
        self.opened.clear()

    def __enter__(self) -> "RankFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_files(ckpt_path, index: Index) -> RankFiles:
    return RankFiles(ckpt_path, index)


def check_checkpoint(ckpt_path, *, full: bool = True) -> Index:
    """The index if the checkpoint is complete, else CheckpointError naming the damaged file.

    ``full`` reads every tensor and checks its CRC; without it only the
    index, the file sizes and the headers are checked (cheap).
    """
    index = read_index(ckpt_path)
    m = STEP_RE.match(Path(ckpt_path).name)
    if m and int(m.group(1)) != index.step:
        raise CheckpointError(f"{Path(ckpt_path) / INDEX_NAME}: records step {index.step}, folder says otherwise")
    if sorted(f.rank for f in index.files) != list(range(index.ranks)):
        raise CheckpointError(f"{Path(ckpt_path) / INDEX_NAME}: does not list one file per rank of {index.ranks}")
    files = open_files(ckpt_path, index)
    try:
        for rec in index.files:
            f = files[rec.rank]                           # opening checks size and header
            if full:
                if set(f.entries) != set(rec.tensors):
                    raise CheckpointError(f"{f.path}: holds other tensors than the index records (file altered)")
                for name, entry in rec.tensors.items():
                    f.verify(name, entry)
    finally:
        files.close()
    return index


def latest_complete(root, *, verify: bool = True, before: int | None = None,
                    report: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete checkpoint under ``root`` (below step ``before`` if given), or None.

    Newer folders that are incomplete or damaged are skipped; each skip is
    reported (``report``, default a logging warning) naming the file at
    fault, and so is the fallback to an older checkpoint.
    """
    say = report or log.warning
    skipped = []
    for step, path in reversed(list_checkpoints(root)):
        if before is not None and step >= before:
            continue
        try:
            check_checkpoint(path, full=verify)
        except CheckpointError as e:
            say(f"checkpoint {path.name} refused: {e}")
            skipped.append(path.name)
            continue
        if skipped:
            say(f"falling back to checkpoint {path.name} (newer {', '.join(skipped)} not usable)")
        return path
    if skipped:
        say(f"no complete checkpoint under {root} ({', '.join(skipped)} not usable)")
    return None


def _overlaps(old: FlatLayout, old_rank: int, new: FlatLayout, new_rank: int, numel: int):
    """(old shard offset, new shard offset, length) of every overlap of the two ranks' owned elements."""
    if old.runs or new.runs:        # a partly frozen unit's order: match elements by their logical place
        mine = new.logical_pieces(new_rank)
        for lo0, s0, n0 in old.logical_pieces(old_rank):
            for lo1, s1, n1 in mine:
                lo, hi = max(lo0, lo1), min(lo0 + n0, lo1 + n1)
                if lo < hi:
                    yield s0 + lo - lo0, s1 + lo - lo1, hi - lo
        return
    for p0, (b0, e0) in enumerate(old.owned_full_ranges(old_rank)):
        e0 = min(e0, numel)
        if b0 >= e0:
            continue
        s0 = old.shard_range(p0)[0]
        for p1, (b1, e1) in enumerate(new.owned_full_ranges(new_rank)):
            lo, hi = max(b0, b1), min(e0, e1)
            if lo < hi:
                yield s0 + lo - b0, new.shard_range(p1)[0] + lo - b1, hi - lo


def recut(files: RankFiles, index: Index, unit: int, kind: str, new: FlatLayout,
          new_rank: int, verify: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """New rank ``new_rank``'s shard of ``u{unit}.{kind}`` under layout ``new``, from the saved shards.

    ``out``: a preallocated destination (the runtime's own shard buffer),
    filled in place; without it a new tensor is returned.
    """
    meta = index.units[unit]
    old = meta.layout
    key = shard_key(unit, kind)
    recs = {r.rank: r for r in index.files}
    if key not in recs[0].tensors:
        raise CheckpointError(f"{files[0].path}: tensor {key!r} missing")
    entry0 = recs[0].tensors[key]
    dtype = torch_dtype(entry0.dtype, key)
    if out is not None and (out.device.type != "cpu" or not out.is_contiguous() or out.dtype != dtype
                            or out.numel() != new.shard_numel):
        raise CheckpointError(f"{key}: destination must be a contiguous CPU {dtype} tensor of "
                              f"{new.shard_numel} elements, got {out.dtype}{list(out.shape)} on {out.device}")
    same = old == new and new_rank in files
    if same and out is None:
        return files[new_rank].read(key, recs[new_rank].tensors.get(key) if verify else None)
    if out is None:
        out = torch.empty(new.shard_numel, dtype=dtype)   # every element is written below, once
    item = out.element_size()
    dest = byte_view(out)
    if same:
        entry = recs[new_rank].tensors.get(key)
        files[new_rank].read_range(key, entry if verify else None, 0, len(dest), dest)
        return out
    if new.runs:                                          # padding between the regions too
        out.zero_()
    for p, (b, e) in enumerate(new.owned_full_ranges(new_rank)):
        if e > meta.numel and not new.runs:               # new padding
            sb = new.shard_range(p)[0]
            out[sb + max(0, meta.numel - b):sb + e - b].zero_()
    for r0 in range(old.ranks):
        pieces = list(_overlaps(old, r0, new, new_rank, meta.numel))
        if not pieces:
            continue
        entry = recs[r0].tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{files[r0].path}: tensor {key!r} missing")
        if entry.dtype != entry0.dtype:
            raise CheckpointError(f"{files[r0].path}: tensor {key!r} is {entry.dtype}, rank 0 saved {entry0.dtype}")
        # Only the bytes the new shard needs are read (and the checksum blocks around them).
        for s0, s1, n in pieces:
            files[r0].read_range(key, entry if verify else None, s0 * item, (s0 + n) * item,
                                 dest[s1 * item:(s1 + n) * item])
    return out


def iter_rank_shards(ckpt_path, rank: int, ranks: int, layouts: list[FlatLayout], *,
                     index: Index | None = None, verify: bool = True,
                     kinds: list[str] | None = None,
                     into: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (key, tensor) of rank ``rank`` of ``ranks``, unit by unit, re-cut to ``layouts``.

    Flat shards ``u{i}.{kind}`` come re-cut (any saved rank count, parts
    or padding); a layout of fewer shards than ranks (a shard group: HSDP's
    node, MiCS's group) gives ``rank`` the shard of its index in its group; per-rank state (``rng.*``) comes as
    saved by the same rank,
    and is absent when that rank did not exist in the saved run.
    ``kinds`` restricts which state kinds are loaded (default all).
    ``into`` maps keys to preallocated flat CPU tensors (e.g. the runtime's
    shard buffers, pinned) that are filled in place and yielded; loading
    into memory already touched avoids the page faults of fresh tensors,
    which on a busy host cost more than the disk.
    """
    index = index or read_index(ckpt_path)
    if len(layouts) != len(index.units):
        raise CheckpointError(f"{ckpt_path}: checkpoint holds {len(index.units)} units, the model has {len(layouts)}")
    for i, (meta, new) in enumerate(zip(index.units, layouts)):
        if new.numel != meta.numel:
            raise CheckpointError(f"{ckpt_path}: unit {i} ({meta.name}) holds {meta.numel} parameters "
                                  f"in the checkpoint, {new.numel} in the model")
        if ranks % new.ranks:
            raise CheckpointError(f"unit {i}: layout for {new.ranks} ranks given to a load for {ranks}")
    files = open_files(ckpt_path, index)
    try:
        saved_kinds: dict[int, list[str]] = {}
        for key in index.file_for_rank(0).tensors:
            parsed = parse_shard_key(key)
            if parsed:
                saved_kinds.setdefault(parsed[0], []).append(parsed[1])
        for i, new in enumerate(layouts):
            for kind in saved_kinds.get(i, []):
                if kinds is None or kind in kinds:
                    key = shard_key(i, kind)
                    yield key, recut(files, index, i, kind, new, rank % new.ranks, verify, (into or {}).get(key))
        if rank < index.ranks:
            rec = index.file_for_rank(rank)
            for key, entry in rec.tensors.items():
                if parse_shard_key(key) is None and not is_padding(key):
                    yield key, files[rank].read(key, entry if verify else None)
    finally:
        files.close()


def load_for_rank(ckpt_path, rank: int, ranks: int, layouts: list[FlatLayout], *,
                  verify: bool = True, kinds: list[str] | None = None,
                  into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """All of rank ``rank``'s state from checkpoint ``ckpt_path``, re-cut to ``layouts``; see iter_rank_shards."""
    return dict(iter_rank_shards(ckpt_path, rank, ranks, layouts, verify=verify, kinds=kinds, into=into))


def full_unit(files: RankFiles, index: Index, unit: int, kind: str = "param",
              verify: bool = True) -> torch.Tensor:
    """Unit ``unit``'s whole flat ``kind`` buffer (``numel`` elements, no padding)."""
    n = index.units[unit].numel
    return recut(files, index, unit, kind, FlatLayout(n, 1, 1, n), 0, verify)
