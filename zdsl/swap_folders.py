"""What a swap folder named in ``nvme("FOLDER", ...)`` is on this machine, before and while it is used.

A folder that does not exist yet is created by the swapper (with any missing parents), so what
matters is its nearest existing ancestor: the filesystem the swap files will land on (its
``st_dev``: folders on one device share its free space and its rate) and whether a folder can be
made there. Torch-free: the pre-flight (``zdsl.planner.machine_fit``), the planner's disk rates
(``zdsl.sim.rates``) and the runtime's swapper all ask here.
"""
from __future__ import annotations

import os
from pathlib import Path

from zdsl.schedule import DIRECT_IO_ALIGN


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


def stripe_bytes(nbytes: int, block_bytes: int, stripes: int) -> list[int]:
    """Bytes each of ``stripes`` files needs (whole 4 KiB blocks) to hold a buffer of ``nbytes`` whose
    block ``i`` is in file ``i mod stripes`` (runtime/offload/stripes.py's layout)."""
    blocks = -(-nbytes // block_bytes)
    sizes = []
    for k in range(stripes):
        held = len(range(k, blocks, stripes))
        if not held:
            sizes.append(0)
            continue
        last = k + (held - 1) * stripes
        tail = min(block_bytes, nbytes - last * block_bytes)
        sizes.append((held - 1) * block_bytes + -(-tail // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN)
    return sizes
