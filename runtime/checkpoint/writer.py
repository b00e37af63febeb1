"""Writing a checkpoint: each rank its file, then rank 0 the index.

Why this order and these steps: a rank writes its shards to a temporary
name, fsyncs, renames (atomic on POSIX) and fsyncs the folder, then writes a
done marker with the file's size and checksums the same way. Rank 0 writes
``index.json`` only once every rank's marker is there, so a checkpoint with
an index is complete by construction, and a rank killed at any instant
leaves at worst a folder without an index, which discovery skips. Done
markers carry a ``tag`` equal on all ranks of one save, so a marker left by
an earlier, killed attempt at the same step is never mistaken for this one.

Nothing here talks to torch.distributed: the runtime copies shards to host,
calls :func:`write_rank_shards` from an I/O worker thread on every rank, and
:func:`write_index` on rank 0 (polling the markers over the shared
filesystem, bounded by ``timeout_s``; a barrier in the caller works too).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from zdsl.model.layout import FlatLayout
from zdsl.runtime.checkpoint.errors import CheckpointError
from zdsl.runtime.checkpoint.index import (
    INDEX_NAME,
    FileRecord,
    Index,
    UnitMeta,
    checkpoint_path,
    done_name,
    parse_shard_key,
    rank_file_name,
)
from zdsl.runtime.checkpoint.stformat import write_file
from zdsl.runtime.io.atomic import renamed_into_place


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary name, fsync and rename."""
    with renamed_into_place(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(path.parent)


def owned_shard(full: torch.Tensor, layout: FlatLayout, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of a unit's flat buffer ``full`` (``numel`` or ``padded_numel`` long).

    For state that every rank holds whole (stage 0 parameters and moments):
    each rank saves only the part it owns, so the save is spread over ranks.
    """
    flat = full.reshape(-1)
    if flat.numel() not in (layout.numel, layout.padded_numel):
        raise CheckpointError(f"flat buffer of {flat.numel()} elements does not match a unit of "
                              f"{layout.numel} ({layout.padded_numel} padded)")
    out = torch.zeros(layout.shard_numel, dtype=flat.dtype)
    for p, (b, e) in enumerate(layout.owned_full_ranges(rank)):
        sb = layout.shard_range(p)[0]
        hi = min(e, flat.numel())
        if hi > b:
            out[sb:sb + hi - b].copy_(flat[b:hi])
    return out


def unit_metas(specs, layouts: list[FlatLayout], prefixes: list[str] | None = None,
               dtype: str = "float32") -> list[UnitMeta]:
    """Index entries for units (zdsl.model.units.UnitSpec list) with their layouts and state-dict prefixes."""
    if len(specs) != len(layouts):
        raise CheckpointError(f"{len(specs)} units but {len(layouts)} layouts")
    return [UnitMeta.from_spec(spec, layout, None if prefixes is None else prefixes[i], dtype)
            for i, (spec, layout) in enumerate(zip(specs, layouts))]


def write_rank_shards(root, step: int, rank: int, ranks: int, shards: dict,
                      *, tag: str = "") -> FileRecord:
    """Write one rank's host tensors as ``ROOT/step-N/rank-R-of-W.safetensors`` and its done marker.

    ``shards``: ``u{i}.{kind}`` flat shards (this rank's owned slices, see
    zdsl.model.layout.FlatLayout.owned_full_ranges) and per-rank state such as
    ``rng.cpu`` (uint8). A value may be a :class:`LazyShard` (shape, dtype,
    fetch) for state that lives on NVMe or the device: it is fetched right
    before it is written, so host memory holds one at a time. Synchronous;
    run it in an I/O thread. Raises
    CheckpointError when the step already has a complete checkpoint.
    """
    if not 0 <= rank < ranks:
        raise CheckpointError(f"rank {rank} out of range for {ranks} ranks")
    step_dir = checkpoint_path(root, step)
    step_dir.mkdir(parents=True, exist_ok=True)
    if (step_dir / INDEX_NAME).exists():
        raise CheckpointError(f"{step_dir}: already a complete checkpoint; refusing to overwrite it")
    for key, t in shards.items():
        if parse_shard_key(key) is not None and len(t.shape) != 1:
            raise CheckpointError(f"rank {rank}: shard {key} must be a flat 1-D tensor, got shape {tuple(t.shape)}")
    name = rank_file_name(rank, ranks)
    done = step_dir / done_name(rank, ranks)
    if done.exists():
        done.unlink()                     # a stale marker from a killed attempt at this step
    for stale in step_dir.glob(f".{name}.tmp-*"):
        stale.unlink(missing_ok=True)     # a partial file from a killed attempt (only this rank writes it)
    final = step_dir / name
    meta = {"format": "pt", "zdsl_step": str(step), "zdsl_rank": str(rank), "zdsl_ranks": str(ranks)}
    try:
        with renamed_into_place(final) as tmp:
            size, header_crc, entries = write_file(str(tmp), shards, meta)
        fsync_dir(step_dir)
    except OSError as e:
        raise CheckpointError(f"rank {rank}: writing {final} failed: {e.strerror or e}") from None
    record = FileRecord(name, rank, ranks, size, header_crc, entries, tag)
    write_atomic(done, json.dumps(record.to_json()).encode())
    return record


def _read_done(path: Path, tag: str) -> FileRecord | None:
    try:
        rec = FileRecord.from_json(json.loads(path.read_bytes()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return None                       # a marker is written atomically; unreadable means foreign
    return rec if rec.tag == tag else None


def collect_records(step_dir: Path, ranks: int, known: list[FileRecord], tag: str,
                    timeout_s: float, poll_s: float) -> list[FileRecord]:
    """Every rank's record: ``known`` ones, the rest from done markers as they appear."""
    found = {r.rank: r for r in known}
    deadline = time.monotonic() + timeout_s
    while True:
        for r in range(ranks):
            if r not in found:
                rec = _read_done(step_dir / done_name(r, ranks), tag)
                if rec is not None:
                    found[r] = rec
        if len(found) == ranks:
            return [found[r] for r in range(ranks)]
        if time.monotonic() >= deadline:
            missing = [done_name(r, ranks) for r in range(ranks) if r not in found]
            raise CheckpointError(f"{step_dir}: ranks did not finish writing within {timeout_s:g} s "
                                  f"(missing {', '.join(missing)}); checkpoint left incomplete")
        time.sleep(poll_s)


def write_index(root, step: int, meta: dict, records: list[FileRecord] | None = None, *,
                tag: str = "", timeout_s: float = 600.0, poll_s: float = 0.05) -> Path:
    """Write ``ROOT/step-N/index.json`` once every rank's file is done; returns the checkpoint folder.

    ``meta``: ``units`` (list of UnitMeta or their JSON), ``ranks`` (default:
    the units' rank count), ``schedule_hash``, ``data_position`` (dict),
    ``loss_scaler`` (dict or None), ``aliases`` ({state-dict key: key it
    duplicates}, for tied weights listed twice by the model), ``extra``.
    ``records``: the FileRecords this process already has (others are read
    from the done markers, waiting up to ``timeout_s``).
    """
    step_dir = checkpoint_path(root, step)
    try:
        units = [u if isinstance(u, UnitMeta) else UnitMeta.from_json(u) for u in meta["units"]]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint meta: bad or missing units ({e})") from None
    ranks = int(meta.get("ranks") or (units[0].ranks if units else len(records or [])))
    for u in units:      # a shard group smaller than the ranks: its first replica's files hold the shards
        if ranks % u.ranks:
            raise CheckpointError(f"unit {u.name}: layout for {u.ranks} ranks in a checkpoint of {ranks}")
    recs = collect_records(step_dir, ranks, list(records or []), tag, timeout_s, poll_s)
    for rec in recs:
        path = step_dir / rec.name
        if not path.exists() or path.stat().st_size != rec.bytes:
            raise CheckpointError(f"{path}: missing or not the size its done marker records")
        for key, entry in rec.tensors.items():
            parsed = parse_shard_key(key)
            if parsed is None:
                continue
            unit, kind = parsed
            if unit >= len(units):
                raise CheckpointError(f"{path}: shard {key} for unit {unit}, the model has {len(units)} units")
            want = units[unit].layout.shard_numel
            if entry.shape != (want,):
                raise CheckpointError(f"{path}: shard {key} has shape {entry.shape}, layout says ({want},)")
    index = Index(step, ranks, units, recs, str(meta.get("schedule_hash", "")),
                  dict(meta.get("data_position") or {}), meta.get("loss_scaler"),
                  dict(meta.get("aliases") or {}), dict(meta.get("extra") or {}))
    try:
        fsync_dir(step_dir.parent)        # the step folder's own entry is durable before the index says "complete"
        write_atomic(step_dir / INDEX_NAME, index.to_json_bytes())
    except OSError as e:
        raise CheckpointError(f"{step_dir / INDEX_NAME}: write failed: {e.strerror or e}") from None
    return step_dir
