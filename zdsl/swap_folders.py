"""What a swap folder named in ``nvme("FOLDER", ...)`` is on this machine, before and while it is used.

A folder that does not exist yet is created by the swapper (with any missing parents), so what
matters is its nearest existing ancestor: the filesystem the swap files will land on (its
``st_dev``: folders on one device share its free space and its rate) and whether a folder can be
made there. Torch-free: the pre-flight (``zdsl.planner.machine_fit``), the planner's disk rates
(``zdsl.planner.rates``) and the runtime's swapper all ask here.
"""
from __future__ import annotations

import os
from pathlib import Path


def nearest_existing(folder: str | os.PathLike) -> Path:
    """``folder`` itself if it exists, else its closest ancestor that does (``/`` at worst)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def device_of(folder: str | os.PathLike) -> int | None:
    """The device (``st_dev``) the folder's swap files land on; None where it cannot be told."""
    try:
        return os.stat(nearest_existing(folder)).st_dev
    except OSError:
        return None


def folder_problem(folder: str | os.PathLike) -> str | None:
    """Why swap files cannot be put in ``folder``, or None where they can (it is a writable folder,
    or one that can be created). The words name the path in the way."""
    path = Path(folder).absolute()
    walk = path
    while not walk.exists():
        if walk.is_symlink():           # a link whose target is gone: a drive unmounted, a folder removed
            return f"{walk} is a link to {os.readlink(walk)}, which does not exist"
        if walk == walk.parent:
            break
        walk = walk.parent
    if not walk.is_dir():
        return f"{walk} is {'a file' if walk.is_file() else 'not a folder'}, so the swap folder " \
               f"{path} cannot be {'made there' if walk != path else 'used'}"
    if not os.access(walk, os.W_OK | os.X_OK):
        return f"{walk} is not writable by this user, so the swap folder {path} " \
               f"cannot {'be made there' if walk != path else 'hold swap files'}"
    return None
