"""Parameter-name globs, as ``no_decay=("*.glob")`` and ``freeze PATTERN`` write them.

The compiler sees each unit's parameter names (:class:`~zdsl.compile.units.UnitSpec`).
A glob (``fnmatch``, case-sensitive) matches a parameter if it matches its name
within the unit (``ln_1.weight``) or its name with the unit's in front
(``block.0.ln_1.weight``).
"""
from __future__ import annotations

import difflib
from fnmatch import fnmatchcase

from zdsl.compile.units import UnitSpec


def glob_matches(glob: str, spec: UnitSpec, name: str) -> bool:
    """Whether ``glob`` names parameter ``name`` of unit ``spec``."""
    return fnmatchcase(name, glob) or fnmatchcase(f"{spec.name}.{name}", glob)


def closest_names(units: list[UnitSpec], glob: str) -> str:
    """A hint for a glob that matched nothing: the closest parameter names, or what names look like."""
    names = [f"{spec.name}.{name}" for spec in units for name, _ in spec.params]
    close = difflib.get_close_matches(glob, names, n=3, cutoff=0.3)
    return f"closest names: {', '.join(close)}" if close else f"parameter names look like {', '.join(names[:3])}"
