"""What a checkpoint holds, as a table (``zdsl inspect DIR``).

Given a root, lists every ``step-*`` folder with its status (complete,
incomplete, or damaged and why) and details the newest complete one; given
a checkpoint folder, details it: step, rank count, schedule hash, data
position, loss scaler, files, and per unit its parameters, layout and the
state kinds saved.

"complete" means every tensor was read and its checksum matched, as a resume
checks: a flipped byte inside a shard leaves its size and header intact, so
a listing that only looked at those would call a checkpoint complete that
``--resume`` then refuses. ``--quick`` skips the checksums and says so
("complete (not verified)").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zdsl.lang.sizes import human_bytes
from zdsl.runtime.checkpoint.errors import CheckpointError
from zdsl.runtime.checkpoint.index import INDEX_NAME, STEP_RE, Index, is_padding, parse_shard_key
from zdsl.runtime.checkpoint.reader import check_checkpoint, list_checkpoints


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def describe(path: Path, index: Index, verified: bool = True) -> str:
    lines = [f"checkpoint {path}" + ("" if verified else " (not verified: checksums not read)"),
             f"  step {index.step}, {index.ranks} rank(s), schedule hash {index.schedule_hash or '-'}",
             f"  data position {index.data_position or '-'}, loss scaler {index.loss_scaler or '-'}"]
    kinds: dict[int, list[str]] = {}
    per_rank = []
    for key, entry in index.file_for_rank(0).tensors.items():
        parsed = parse_shard_key(key)
        if is_padding(key):
            continue
        if parsed:
            kinds.setdefault(parsed[0], []).append(f"{parsed[1]}:{entry.dtype}")
        else:
            per_rank.append(f"{key} {entry.dtype}{list(entry.shape)}")
    rows = [["unit", "name", "prefix", "tensors", "numel", "padded", "parts", "shard/rank", "saved"]]
    for i, u in enumerate(index.units):
        rows.append([str(i), u.name, u.prefix, str(len(u.params)), str(u.numel), str(u.layout.padded_numel),
                     str(u.parts), str(u.layout.shard_numel), " ".join(kinds.get(i, [])) or "-"])
    lines += ["  " + r for r in _table(rows)]
    shards = index.units[0].ranks if index.units else index.ranks
    if shards < index.ranks:
        writers = "rank 0" if shards == 1 else f"ranks 0-{shards - 1}"
        lines.append(f"  shards written by {writers}; the other ranks held replicas of them")
    total = sum(f.bytes for f in index.files)
    lines.append(f"  parameters {sum(u.numel for u in index.units)}, files {len(index.files)} "
                 f"({human_bytes(total)}): " + ", ".join(f"{f.name} {human_bytes(f.bytes)}" for f in index.files))
    if per_rank:
        lines.append("  per-rank state: " + ", ".join(per_rank))
    if index.aliases:
        lines.append("  tied: " + ", ".join(f"{a} = {s}" for a, s in index.aliases.items()))
    return "\n".join(lines)


def inspect(path, *, verify: bool = True) -> str:
    """A table of what checkpoint ``path`` (a step folder or a root) holds; ``verify`` (the
    default) checks every CRC, without it the listing says "not verified"."""
    path = Path(path)
    if (path / INDEX_NAME).exists() or STEP_RE.match(path.name):
        return describe(path, check_checkpoint(path, full=verify), verify)
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: no checkpoints (no step-* folders)")
    rows = [["step", "folder", "status"]]
    newest = None
    for step, p in found:
        try:
            index = check_checkpoint(p, full=verify)
            status, newest = "complete" if verify else "complete (not verified)", (p, index)
        except CheckpointError as e:
            status = f"unusable: {e}"
        rows.append([str(step), p.name, status])
    text = "\n".join(_table(rows))
    if newest:
        text += "\n\n" + describe(*newest, verify)
    return text


def main(argv=None) -> int:
    """``python -m zdsl.runtime.checkpoint.inspect DIR [--quick]``."""
    ap = argparse.ArgumentParser(prog="zdsl inspect", description="list what a checkpoint holds")
    ap.add_argument("checkpoint", help="a checkpoint root or one step-* folder")
    check = ap.add_mutually_exclusive_group()
    check.add_argument("--quick", "--no-verify", dest="verify", action="store_false",
                       help="skip reading the tensors: sizes and headers only, listed as 'not verified'")
    check.add_argument("--verify", dest="verify", action="store_true",
                       help="read every tensor and check its checksum (the default)")
    ap.set_defaults(verify=True)
    args = ap.parse_args(argv)
    try:
        print(inspect(args.checkpoint, verify=args.verify))
    except CheckpointError as e:
        print(f"zdsl inspect: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
