"""``zdsl tune``'s last step: the winning overrides written back as a .zs file.

:func:`write_schedule_text` returns text that re-checks to the same task graph
as ``zdsl plan FILE --set ...`` with the winner's overrides: the file's own
lines edited where each override is a whole statement (comments kept), else
the checked schedule printed (``zdsl.check.printer``). Imports no torch.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from pathlib import Path

from zdsl.check.printer import print_schedule, string_text
from zdsl.driver import compile_file, memo_units_for
from zdsl.lang import ast
from zdsl.lang.continuation import statement_end
from zdsl.lang.errors import UsageError, ZsError
from zdsl.lang.overrides import statement_text
from zdsl.lang.parse import parse_file

WHOLE_STATEMENT_KEYS = ("ranks", "zero", "shard", "prefetch", "bucket", "overlap", "recompute",
                        "persist", "model", "data", "optimizer", "machine", "checkpoint")


def write_schedule_text(path: str, overrides: dict[str, str], out_path: str, note: str = "",
                        units_for=None) -> tuple[str, str]:
    """.zs text for ``path`` with ``overrides`` applied, to be written at ``out_path``.

    Two ways, the first whose output re-checks to the same task graph as
    ``zdsl plan path --set ...`` wins:

    1. **edit the text**: each overridden statement's line is replaced (comments and
       layout elsewhere kept; the old line stays as a comment); keys that are not a
       whole statement, or statements that live in an included file, skip to 2.
    2. **print the checked schedule** (``zdsl.check.printer``): always valid, loses comments.

    Paths relative to the schedule (includes) are rewritten for ``out_path``'s folder.
    Returns (text, how); raises ValueError when neither way reproduces the graph.
    """
    units_for = units_for or memo_units_for()
    target = compile_file(path, overrides, units_for, simulate=False)
    if not target.ok or target.graph is None:
        raise ValueError(f"the combination does not compile: {_first_error(target)}")
    want = graph_key(target.graph)
    needed = dict(overrides)
    for key in list(needed):                 # a value the file already has changes nothing: leave its line
        rest = {k: v for k, v in needed.items() if k != key}
        same = compile_file(path, rest, units_for, simulate=False)
        if same.ok and same.graph is not None and graph_key(same.graph) == want:
            needed = rest
    overrides = needed
    header = f"# written by `zdsl tune` from {path}{': ' + note if note else ''}\n"
    tries = []
    edited = _edited_text(path, overrides, out_path)
    if edited is not None:
        tries.append(("edited", header + edited))
    tries.append(("printed", header + _printed_text(target, out_path)))
    problems = []
    for how, text in tries:
        got = _compile_text(text, out_path, units_for)
        if got is not None and got.ok and got.graph is not None and graph_key(got.graph) == want:
            return text, how
        problems.append(f"{how}: " + (_first_error(got) if got is not None and not got.ok
                                      else "compiles to a different task graph"))
    raise ValueError("cannot write a schedule that reproduces the winner (" + "; ".join(problems) + ")")


# Config entries the compiler has lowered into the ops and buffers, which the runtime never
# reads: two graphs that differ only there run alike (a bucket larger than every unit's gradients).
LOWERED_CONFIG = ("bucket_bytes", "prefetch", "overlap")


def graph_key(graph, runs_alike: bool = False) -> str:
    """The graph's digest without source positions (the schedule's file name in the config,
    each op's span): the same schedule written elsewhere compiles to the same key. With
    ``runs_alike``, also without :data:`LOWERED_CONFIG`: graphs that run the same ops share it."""
    raw = json.loads(graph.to_json())
    config = raw.get("config") or {}
    config.pop("file", None)
    if runs_alike:
        for key in LOWERED_CONFIG:
            config.pop(key, None)
    for op in raw.get("ops", []):
        op.pop("span", None)
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def _first_error(compiled) -> str:
    d = next((d for d in compiled.diagnostics if d.is_error), None)
    return d.message if d else "unknown problem"


def _compile_text(text: str, out_path: str, units_for):
    """Compile text as if it were the file at out_path (written to a temp file beside it)."""
    folder = Path(out_path).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".zs", prefix=".tune-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return compile_file(tmp, {}, units_for, simulate=False)
    finally:
        os.unlink(tmp)


def _relocated(rel: str, src: str, out_path: str) -> str:
    """A path written relative to ``src``'s folder, as seen from ``out_path``'s folder."""
    p = Path(rel)
    if p.is_absolute():
        return rel
    absolute = (Path(src).resolve().parent / p).resolve()
    return os.path.relpath(absolute, Path(out_path).resolve().parent)


def _edited_text(path: str, overrides: dict[str, str], out_path: str) -> str | None:
    try:
        program = parse_file(path)
        source = Path(path).read_text(encoding="utf-8-sig")
    except (ZsError, OSError, UnicodeDecodeError):
        return None
    lines = source.splitlines()
    appended: list[str] = []
    for key, value in overrides.items():
        if key not in WHOLE_STATEMENT_KEYS and not (key.startswith("offload.") and key.count(".") == 1):
            return None
        try:
            text = statement_text(key, value)
        except UsageError:
            return None
        if key == "ranks" and " on " not in value:
            return None                     # keeps the file's device: let the printer say it
        keywords = {"zero", "shard"} if key in ("zero", "shard") else {key.split(".")[0]}
        hits = [s for s in program.statements if s.keyword in keywords and s.span.file == program.file]
        if key.startswith("offload."):
            state = key.split(".")[1]
            hits = [s for s in hits if isinstance(s, ast.OffloadStmt) and s.state.value == state]
        if len(hits) > 1:
            return None
        if not hits:
            appended.append(text)
            continue
        i, last = _statement_lines(program, hits[0], lines)
        old = " ".join(code for code in (_code(line) for line in lines[i:last + 1]) if code)
        lines[i] = f"{text}    # tuned by zdsl tune; was: {old}"
        for j in range(i + 1, last + 1):    # the rest of a statement wrapped over several lines
            lines[j] = "#" + lines[j] if lines[j].strip() else lines[j]
    for stmt in program.statements:           # includes relative to the new folder
        if isinstance(stmt, ast.IncludeStmt):
            i = stmt.span.line - 1
            new = _relocated(stmt.path.value, path, out_path)
            if new != stmt.path.value:
                lines[i] = f"include {string_text(new)}"
    if appended:
        lines += ["", "# set by zdsl tune"] + appended
    return "\n".join(lines) + "\n"


def _code(line: str) -> str:
    """A line without its comment ('#' at the start, or after a space: not inside a name)."""
    line = line.strip()
    return "" if line.startswith("#") else line.split(" #", 1)[0].strip()


def _statement_lines(program, stmt, lines: list[str]) -> tuple[int, int]:
    """The first and last line (0-based) of ``stmt``, which may go on over several lines inside
    '(' or after a trailing ','. Between two statements there are only blank and comment lines, so
    it ends at the last code line before the next statement of its file (or the end of the file)."""
    first = stmt.span.line - 1
    later = [s.span.line - 1 for s in program.statements if s.span.file == stmt.span.file and s.span.line - 1 > first]
    return first, statement_end(lines, first, min(later, default=len(lines)))


def _printed_text(compiled, out_path: str) -> str:
    schedule = copy.deepcopy(compiled.schedule)
    factory = schedule.model.factory
    if factory and ".py:" in factory:       # "my_model.py:build" is relative to the schedule
        file, _, fn = factory.rpartition(":")
        schedule.model.factory = f"{_relocated(file, compiled.path, out_path)}:{fn}"
    return print_schedule(schedule)
