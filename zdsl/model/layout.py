"""How a unit's flat parameter buffer is padded, split into bucket parts and sharded.

A unit's parameters are flattened into one buffer of ``padded_numel`` elements,
cut into ``parts`` parts (one collective each); every part splits evenly over
the ranks. Rank r's shard is the concatenation of its slice of every part, so
one part's all-gather or reduce-scatter touches one contiguous slice of the
shard.

Without frozen parameters the order is registration order and the parts are
equal. A unit with some parameters frozen (``freeze``) lays its trainable
parameters first, in registration order, in ``trainable_parts`` parts of
``part_numel``, then its frozen ones in ``frozen_parts`` parts of
``frozen_part_numel``: gradients, their reductions and optimizer state cover
the trainable parts only, and since parts come in order, they are a prefix of
the full buffer and of every shard. ``runs`` maps the unit's logical elements
(registration order, unpadded, as checkpoints and exports see them) to the
flat buffer: (logical start, flat start, length), empty for the plain order.
A unit whose parameters are all frozen keeps the plain layout.
"""
from __future__ import annotations

from dataclasses import dataclass


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FlatLayout:
    numel: int
    ranks: int
    parts: int               # all parts
    part_numel: int          # elements in one trainable part (every part without frozen ones; multiple of ranks)
    frozen_parts: int = 0    # the last parts, holding frozen parameters only
    frozen_part_numel: int = 0
    runs: tuple[tuple[int, int, int], ...] = ()   # (logical start, flat start, length); () = plain order

    @property
    def trainable_parts(self) -> int:
        return self.parts - self.frozen_parts

    @property
    def trainable_numel(self) -> int:
        """Elements of the trainable region (padded): the size of gradients and optimizer state."""
        return self.trainable_parts * self.part_numel

    @property
    def trainable_shard_numel(self) -> int:
        return self.trainable_numel // self.ranks

    @property
    def padded_numel(self) -> int:
        return self.trainable_numel + self.frozen_parts * self.frozen_part_numel

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.ranks

    @property
    def part_shard_numel(self) -> int:
        return self.part_numel // self.ranks

    def part_size(self, part: int) -> int:
        return self.part_numel if part < self.trainable_parts else self.frozen_part_numel

    def full_range(self, part: int) -> tuple[int, int]:
        """Elements of the full buffer covered by ``part``."""
        t = self.trainable_parts
        start = part * self.part_numel if part < t else t * self.part_numel + (part - t) * self.frozen_part_numel
        return start, start + self.part_size(part)

    def shard_range(self, part: int) -> tuple[int, int]:
        """Elements of a rank's shard that hold its slice of ``part``."""
        a, b = self.full_range(part)
        return a // self.ranks, b // self.ranks

    def owned_full_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Elements of the full buffer whose master copy lives on ``rank``."""
        out = []
        for p in range(self.parts):
            a, _ = self.full_range(p)
            s = self.part_size(p) // self.ranks
            out.append((a + rank * s, a + (rank + 1) * s))
        return out

    def logical_runs(self) -> tuple[tuple[int, int, int], ...]:
        """``runs``, or the one run of the plain order."""
        return self.runs or ((0, 0, self.numel),)

    def logical_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(logical start, shard offset, length) of every element ``rank`` owns that holds a parameter."""
        out = []
        for p, (a, b) in enumerate(self.owned_full_ranges(rank)):
            base = self.shard_range(p)[0]
            for lo, flat, n in self.logical_runs():
                x, y = max(a, flat), min(b, flat + n)
                if x < y:
                    out.append((lo + x - flat, base + x - a, y - x))
        return out


def _parts(numel: int, ranks: int, bucket_elems: int) -> tuple[int, int]:
    parts = max(1, ceil_div(numel, bucket_elems)) if bucket_elems > 0 else 1
    return parts, ceil_div(ceil_div(max(numel, 1), parts), ranks) * ranks


def flat_layout(numel: int, ranks: int, bucket_elems: int = 0, sizes: list[int] | None = None,
                frozen: list[bool] | None = None) -> FlatLayout:
    """Layout of a unit of ``numel`` parameters; ``bucket_elems`` 0 means one part per region.
    ``sizes`` (elements per parameter, registration order) and ``frozen`` (per parameter):
    trainable parameters first, then frozen ones, when some but not all are frozen."""
    if not frozen or all(frozen) or not any(frozen):
        return FlatLayout(numel, ranks, *_parts(numel, ranks, bucket_elems))
    if sizes is None:
        raise ValueError("flat_layout: a partly frozen unit needs its parameters' sizes")
    trainable = sum(n for n, f in zip(sizes, frozen) if not f)
    t_parts, t_numel = _parts(trainable, ranks, bucket_elems)
    f_parts, f_numel = _parts(numel - trainable, ranks, bucket_elems)
    runs: list[tuple[int, int, int]] = []
    flat = {False: 0, True: t_parts * t_numel}     # next free element of each region
    logical = 0
    for n, f in zip(sizes, frozen):
        if runs and runs[-1][0] + runs[-1][2] == logical and runs[-1][1] + runs[-1][2] == flat[f]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        elif n:
            runs.append((logical, flat[f], n))
        flat[f] += n
        logical += n
    return FlatLayout(numel, ranks, t_parts + f_parts, t_numel, f_parts, f_numel, tuple(runs))


def to_flat(layout: FlatLayout, start: int, n: int) -> int:
    """Where logical elements [start, start + n) (one parameter: never split by a run) begin in the flat buffer."""
    for lo, flat, length in layout.logical_runs():
        if lo <= start and start + n <= lo + length:
            return flat + start - lo
    raise ValueError(f"elements {start}..{start + n} are not one run of the layout")


def flat_ranges(layout: FlatLayout, logical: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Logical element ranges (unions of whole runs' pieces) as sorted, merged flat ranges."""
    out: list[tuple[int, int]] = []
    for a, b in logical:
        for lo, flat, n in layout.logical_runs():
            x, y = max(a, lo), min(b, lo + n)
            if x < y:
                out.append((flat + x - lo, flat + y - lo))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(out):
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def unit_layout(unit, ranks: int) -> FlatLayout:
    """The flat layout of a graph's unit (``zdsl.ir.UnitInfo``) over ``ranks`` shards."""
    trainable = unit.parts - unit.frozen_parts
    part_numel = (unit.padded_numel - unit.frozen_parts * unit.frozen_part_numel) // trainable
    return FlatLayout(unit.numel, ranks, unit.parts, part_numel, unit.frozen_parts, unit.frozen_part_numel,
                      tuple(tuple(r) for r in unit.runs or ()))
