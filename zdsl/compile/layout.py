"""How a unit's flat parameter buffer is padded, split into bucket parts and sharded.

A unit's parameters are flattened in registration order into one buffer of
``padded_numel`` elements, cut into ``parts`` equal parts (one collective
each); every part splits evenly over the ranks. Rank r's shard is the
concatenation of its slice of every part, so one part's all-gather or
reduce-scatter touches one contiguous slice of the shard.
"""
from __future__ import annotations

from dataclasses import dataclass


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FlatLayout:
    numel: int
    ranks: int
    parts: int
    part_numel: int          # elements in one part of the full buffer (multiple of ranks)

    @property
    def padded_numel(self) -> int:
        return self.part_numel * self.parts

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.ranks

    @property
    def part_shard_numel(self) -> int:
        return self.part_numel // self.ranks

    def full_range(self, part: int) -> tuple[int, int]:
        """Elements of the full buffer covered by ``part``."""
        return part * self.part_numel, (part + 1) * self.part_numel

    def shard_range(self, part: int) -> tuple[int, int]:
        """Elements of a rank's shard that hold its slice of ``part``."""
        return part * self.part_shard_numel, (part + 1) * self.part_shard_numel

    def owned_full_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Elements of the full buffer whose master copy lives on ``rank``."""
        s = self.part_shard_numel
        return [(p * self.part_numel + rank * s, p * self.part_numel + (rank + 1) * s)
                for p in range(self.parts)]


def flat_layout(numel: int, ranks: int, bucket_elems: int = 0) -> FlatLayout:
    """Layout of a unit of ``numel`` parameters; ``bucket_elems`` 0 means one part."""
    parts = max(1, ceil_div(numel, bucket_elems)) if bucket_elems > 0 else 1
    part_numel = ceil_div(ceil_div(max(numel, 1), parts), ranks) * ranks
    return FlatLayout(numel, ranks, parts, part_numel)
