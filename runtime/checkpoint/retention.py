"""Keeping the last N checkpoints.

Older checkpoints are deleted only once a newer one is complete, so a save
that dies half-way never costs the checkpoint a resume would fall back to.
Incomplete folders older than the newest complete checkpoint (left by a
killed save) are deleted too; newer incomplete ones may still be being
written and are left alone. A folder is first renamed out of the
``step-*`` namespace, then removed, so a deletion interrupted half-way
never looks like a checkpoint.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from zdsl.runtime.checkpoint.errors import CheckpointError
from zdsl.runtime.checkpoint.reader import check_checkpoint, list_checkpoints


def apply_retention(root, keep: int, *, verify: bool = False) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``; returns what was deleted.

    Completeness is checked cheaply (index, sizes, headers) unless ``verify``.
    """
    if keep < 1:
        raise CheckpointError(f"keep {keep}: at least one checkpoint must be kept")
    found = list_checkpoints(root)
    complete = []
    for step, path in found:
        try:
            check_checkpoint(path, full=verify)
            complete.append(step)
        except CheckpointError:
            pass
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = complete[-1]
    doomed = [p for step, p in found if step not in kept and step < newest]
    return [p for p in doomed if _delete(p)]


def _delete(p: Path) -> bool:
    """Rename ``p`` out of the ``step-*`` namespace, then remove it; False if it is already gone."""
    trash = p.with_name(f".deleting-{p.name}-{os.getpid()}")
    try:
        os.replace(p, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def remove_incomplete(root) -> list[Path]:
    """Delete every incomplete ``step-*`` folder (call on one rank at start, before any save)."""
    deleted = []
    for _, p in list_checkpoints(root):
        try:
            check_checkpoint(p, full=False)
        except CheckpointError:
            if _delete(p):
                deleted.append(p)
    return deleted
