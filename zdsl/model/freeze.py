"""Which parameters ``freeze PATTERN, ...`` keeps frozen, decided once from names.

Globs match as :mod:`zdsl.model.param_names` says. A frozen parameter has no
gradient, no optimizer state and no gradient traffic; it is still gathered
for forward and backward (later units' gradients flow through it).
"""
from __future__ import annotations

from zdsl.model.param_names import closest_names, glob_matches
from zdsl.model.units import UnitSpec


class FreezeError(ValueError):
    """A ``freeze`` glob that matches no parameter, or one that freezes everything."""

    def __init__(self, message: str, hint: str | None, glob: str | None = None):
        super().__init__(message)
        self.hint, self.glob = hint, glob


def frozen_params(units: list[UnitSpec], globs: tuple[str, ...]) -> list[list[bool]]:
    """Per unit, per parameter (registration order): whether a glob freezes it."""
    matched = dict.fromkeys(globs, False)
    out: list[list[bool]] = []
    for spec in units:
        row = []
        for name, _ in spec.params:
            hits = [g for g in globs if glob_matches(g, spec, name)]
            for g in hits:
                matched[g] = True
            row.append(bool(hits))
        out.append(row)
    for g, hit in matched.items():
        if not hit:
            raise FreezeError(f"freeze pattern {g!r} matches no parameter", hint=closest_names(units, g), glob=g)
    if globs and all(all(row) for row in out):
        raise FreezeError("freeze leaves no parameter to train", hint="freeze fewer parameters", glob=globs[-1])
    return out
