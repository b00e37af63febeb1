"""Which parameters weight decay applies to, decided once from names and shapes.

``optimizer adamw(weight_decay=0.1, no_decay=(biases, norms, embeddings, "*.glob"))``
exempts parameters by class or by name. The compiler sees only each unit's
parameter names and shapes (:class:`~zdsl.model.units.UnitSpec`), so the
classes are rules over those, the same for the built-in GPT, Hugging Face
models and a user's model:

- ``biases``: a parameter named ``bias`` (its name ends in ``.bias``);
- ``norms``: every other parameter with fewer than two dimensions. In the
  models zdsl builds these are the norms' scales; a user's 1-D parameter of
  another kind falls here too (nanoGPT's rule is the same: decay only >=2-D);
- ``embeddings``: a 2-D parameter whose module's name contains ``embed``
  or is ``wte`` / ``wpe`` (GPT-2's names), e.g. ``wte.weight``,
  ``embed_tokens.weight``. A head tied to it is the same parameter.

A glob matches parameter names as :mod:`zdsl.model.param_names` says; a
glob that matches nothing is an error. The result
travels in the task graph: per unit, the element ranges of its flat
parameters (registration order) that decay; the runtime applies decay on
those ranges of each rank's shard and none elsewhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zdsl.model.param_names import closest_names, glob_matches
from zdsl.model.units import UnitSpec

NO_DECAY_CLASSES = ("biases", "norms", "embeddings")


def param_class(name: str, shape: tuple[int, ...]) -> str | None:
    """The no_decay class of one parameter, or None (an ordinary weight)."""
    module, _, last = name.rpartition(".")
    if last == "bias":
        return "biases"
    if len(shape) < 2:
        return "norms"
    owner = module.rpartition(".")[2]
    if len(shape) == 2 and ("embed" in owner.lower() or owner in ("wte", "wpe")):
        return "embeddings"
    return None


class NoDecayError(ValueError):
    """A ``no_decay`` glob that matches no parameter; ``hint`` names the closest."""

    def __init__(self, message: str, hint: str | None):
        super().__init__(message)
        self.hint = hint


@dataclass
class DecayGroups:
    ranges: list[list[tuple[int, int]]]   # per unit: flat element ranges that decay
    decay: int                            # parameters that decay
    exempt: dict[str, int]                # parameters exempt, by class or "names" (globs)


def decay_groups(units: list[UnitSpec], classes: tuple[str, ...], globs: tuple[str, ...]) -> DecayGroups:
    """Split every unit's parameters into decaying and exempt ones (classes first, then globs)."""
    matched = dict.fromkeys(globs, False)
    exempt = {c: 0 for c in (*classes, *(("names",) if globs else ()))}
    ranges: list[list[tuple[int, int]]] = []
    decay = 0
    for spec in units:
        unit_ranges: list[tuple[int, int]] = []
        offset = 0
        for name, shape in spec.params:
            n = math.prod(shape)
            why = param_class(name, shape)
            why = why if why in classes else None
            for g in globs:
                if glob_matches(g, spec, name):
                    matched[g] = True
                    why = why or "names"
            if why is None:
                decay += n
                if unit_ranges and unit_ranges[-1][1] == offset:
                    unit_ranges[-1] = (unit_ranges[-1][0], offset + n)
                else:
                    unit_ranges.append((offset, offset + n))
            else:
                exempt[why] += n
            offset += n
        ranges.append(unit_ranges)
    unmatched = [g for g, hit in matched.items() if not hit]
    if unmatched:
        raise NoDecayError(f"no_decay glob {unmatched[0]!r} matches no parameter",
                           hint=closest_names(units, unmatched[0]))
    return DecayGroups(ranges, decay, exempt)
