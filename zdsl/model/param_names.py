"""Parameter-name globs, as ``no_decay=("*.glob")`` and ``freeze PATTERN`` write them.

The compiler sees each unit's parameter names (:class:`~zdsl.model.units.UnitSpec`).
A glob (``fnmatch``, case-sensitive) matches a parameter if it matches its name
within the unit (``ln_1.weight``), its name with the unit's in front
(``block.0.ln_1.weight``), or one of its other names (``UnitSpec.aliases``): the
model's own state-dict name (``blocks.0.ln_1.weight``) and, for a Hugging Face
model, its checkpoint name (``model.layers.0.input_layernorm.weight``).
"""
from __future__ import annotations

import difflib
from fnmatch import fnmatchcase

from zdsl.model.units import UnitSpec


def glob_matches(glob: str, spec: UnitSpec, name: str) -> bool:
    """Whether ``glob`` names parameter ``name`` of unit ``spec``."""
    return fnmatchcase(name, glob) or fnmatchcase(f"{spec.name}.{name}", glob) \
        or any(fnmatchcase(alias, glob) for alias in spec.aliases.get(name, ()))


def closest_names(units: list[UnitSpec], glob: str) -> str:
    """A hint for a glob that matched nothing: the closest parameter names, or what names look like."""
    names = [n for spec in units for name, _ in spec.params
             for n in (f"{spec.name}.{name}", *spec.aliases.get(name, ()))]
    close = difflib.get_close_matches(glob, names, n=3, cutoff=0.3)
    return f"closest names: {', '.join(close)}" if close else f"parameter names look like {', '.join(names[:3])}"
