"""Where a swapped buffer's bytes are: one file per swap folder, its blocks striped over them.

A swapper over ``n`` folders (``nvme("A", "B", ...)``: one per drive) keeps each buffer as ``n``
files, one in each folder's run folder, and puts block ``i`` of the buffer in file ``i mod n`` at
offset ``(i div n) * block``: RAID-0 over the folders, so consecutive blocks, which the workers
take in order, go to different drives at once. With one folder this is one file holding block
``i`` at ``i * block``, byte for byte the layout before several folders were allowed. The files'
sizes are ``zdsl.swap_folders.stripe_bytes`` (torch-free: the pre-flight sizes them too).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stripe:
    """One folder's file of a buffer."""

    path: Path
    fd: int
    direct: bool
    file_bytes: int = 0  # size reserved on disk (whole 4 KiB blocks)


@dataclass
class SwapFile:
    """One buffer's files (one stripe per folder, in the folders' order), its size and block checksums."""

    stripes: list[Stripe]
    nbytes: int = 0  # logical size of the tensor last written
    crcs: list[int | None] = field(default_factory=list)
    complete: bool = False  # False from the start of a write until all its blocks are on disk

    @property
    def direct(self) -> bool:
        return all(s.direct for s in self.stripes)

    def locate(self, index: int, block_bytes: int) -> tuple[Stripe, int]:
        """The file holding block ``index`` and the block's offset in it."""
        n = len(self.stripes)
        return self.stripes[index % n], (index // n) * block_bytes
