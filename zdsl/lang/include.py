"""``include "machine.zs"``: splice another file's statements in place.

The path is relative to the including file (so a schedule and the machine
profile next to it work from any folder). Included statements keep their
own file in their spans, so an error inside an included file points into
that file. Cycles and runaway depth are errors at the include statement.
"""
from __future__ import annotations

import os
from pathlib import Path

from zdsl.lang import ast
from zdsl.lang.errors import ZsError, error
from zdsl.lang.parse import parse_text, read_source

MAX_DEPTH = 16


def expand_includes(program: ast.Program, sources: dict[str, str]) -> list[ast.Stmt]:
    """The program's statements with every include replaced by the included ones.

    ``sources`` receives the text of every file read (for rendering errors).
    """
    sources.setdefault(program.file, program.source)
    return _expand(program, sources, [_identity(program.file)])


def _identity(file: str) -> str:
    try:
        return os.path.realpath(file)
    except (OSError, ValueError):
        return file


def path_exists(path, kind: str = "any") -> bool:
    """Whether ``path`` exists (``kind`` "file" for a regular file); odd paths are False, never raise."""
    try:
        p = Path(path)
        return p.is_file() if kind == "file" else p.exists()
    except (OSError, ValueError):
        return False


def resolve_relative(path: str, including_file: str) -> str:
    """``path`` as seen from the folder of ``including_file`` (absolute paths unchanged)."""
    p = Path(path)
    if p.is_absolute() or including_file.startswith("<") or including_file == "--set":
        return str(p)
    return str(Path(including_file).parent / p)


def _expand(program: ast.Program, sources: dict[str, str], chain: list[str]) -> list[ast.Stmt]:
    out: list[ast.Stmt] = []
    for stmt in program.statements:
        if not isinstance(stmt, ast.IncludeStmt):
            out.append(stmt)
            continue
        path = resolve_relative(stmt.path.value, program.file)
        ident = _identity(path)
        if ident in chain:
            cycle = " -> ".join(Path(c).name for c in chain[chain.index(ident):] + [ident])
            raise ZsError([error(stmt.path.span, f"include cycle: {cycle}",
                                 hint="remove one of the includes")])
        if len(chain) >= MAX_DEPTH:
            raise ZsError([error(stmt.path.span, f"includes nested deeper than {MAX_DEPTH}")])
        if not path_exists(path, "file"):
            raise ZsError([error(stmt.path.span, f"included file not found: {path}",
                                 hint="include paths are relative to the including file")])
        text = read_source(path, at=stmt.path.span)
        sources[path] = text
        included = parse_text(text, path)
        out.extend(_expand(included, sources, chain + [ident]))
    return out
