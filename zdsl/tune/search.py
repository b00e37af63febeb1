"""``zdsl tune``, the planner's half: parse ``--vary``, rank every combination by prediction.

Tuning is a search over a few policy values (``prefetch``, ``bucket``,
``overlap``, ...). Every combination is compiled exactly as ``zdsl plan FILE
--set k=v ...`` would compile it, so the verifier judges it first: a
combination over a memory budget (or otherwise invalid) is *rejected with
the verifier's reason* and never run. The rest are ranked by predicted step
time; the runtime's half (``zdsl.tune.cli``) measures the best few with
short real runs and writes the winner.

Also here, because it needs no torch: turning the winning overrides into a
new .zs file that re-checks to the same task graph (:func:`write_schedule_text`).

No torch is imported by this module (the front end's rule).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from zdsl.lang.errors import UsageError
from zdsl.ir import TIERS



class TuneUsageError(ValueError):
    """A bad ``--vary`` (unknown key, empty or invalid value): exit status 2."""


# -- --vary ------------------------------------------------------------------------

def split_values(text: str) -> list[str]:
    """``1,2,4`` -> ['1', '2', '4'].

    Commas inside parentheses or quotes do not split (``betas=(0.9,0.95),(0.9,0.999)``).
    When a value itself needs top-level commas (``overlap=gather/forward, scatter/backward``),
    separate the alternatives with ``|`` instead: ``overlap=all|gather/forward,scatter/backward``.
    """
    sep = "|" if _top_level(text, "|") else ","
    out, depth, quote, cur = [], 0, False, []
    escaped = False
    for ch in text:
        if quote:
            cur.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quote = False
            continue
        if ch == '"':
            quote = True
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth = max(0, depth - 1)
        elif ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return out


def _top_level(text: str, sep: str) -> bool:
    depth, quote = 0, False
    for ch in text:
        if ch == '"':
            quote = not quote
        elif not quote and ch in "([":
            depth += 1
        elif not quote and ch in ")]":
            depth -= 1
        elif not quote and depth == 0 and ch == sep:
            return True
    return False


def parse_vary(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["prefetch=1,2,4", "bucket=16MiB,64MiB"]`` -> [(key, values)], keys checked against ``--set``'s."""
    from zdsl.lang.overrides import _statement_text
    out: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for item in items:
        key, eq, rest = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise TuneUsageError(f"--vary expects key=v1,v2,..., got {item!r}")
        if key in seen:
            raise TuneUsageError(f"--vary {key} is given twice; list all its values once: {key}=v1,v2")
        values = split_values(rest)
        if not rest.strip() or any(not v for v in values):
            raise TuneUsageError(f"--vary {key}: empty value in {rest!r}; give values as {key}=v1,v2")
        if len(set(values)) != len(values):
            raise TuneUsageError(f"--vary {key}: a value is listed twice in {rest!r}")
        try:
            _statement_text(key, values[0])          # unknown keys fail here, with the nearest valid key
        except UsageError as exc:
            d = exc.diagnostics[0]
            raise TuneUsageError(d.message.replace("--set", "--vary") +
                                 (f" ({d.hint})" if d.hint else "")) from None
        seen.add(key)
        out.append((key, values))
    if not out:
        raise TuneUsageError("--vary needs at least one key=v1,v2,... (e.g. --vary prefetch=1,2,4)")
    return out


def combinations(vary: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    keys = [k for k, _ in vary]
    return [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in vary))]


def label(combo: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in combo.items())


# -- predicting ------------------------------------------------------------------------

@dataclass
class Candidate:
    """One combination of varied values and what the planner (then the runtime) made of it."""
    combo: dict[str, str]
    overrides: dict[str, str]                     # base --set plus the combination
    predicted_s: float | None = None
    predicted_peak: dict[str, int] = field(default_factory=dict)   # tier -> bytes per rank
    rejected: str | None = None                   # the verifier's (or checker's) reason
    warnings: list[str] = field(default_factory=list)
    measured_s: float | None = None               # median step time, first step excluded
    measured_steps: list[float] = field(default_factory=list)
    measured_peak: dict[str, int] = field(default_factory=dict)   # tier -> max over ranks and steps
    failed: str | None = None                     # a measured run that did not finish
    digest: str | None = None

    @property
    def label(self) -> str:
        return label(self.combo)


def validate_values(path: str, base: dict[str, str], vary: list[tuple[str, list[str]]], units_for) -> None:
    """Every value must at least parse and check on its own; else a usage error naming it.

    (A value valid alone but invalid with others, or over a budget, is a rejection, not
    a usage error.)
    """
    from zdsl.driver import compile_file
    for key, values in vary:
        for value in values:
            compiled = compile_file(path, {**base, key: value}, units_for, simulate=False)
            if compiled.schedule is not None:
                continue
            at_override = [d for d in compiled.diagnostics if d.is_error and
                           (d.span is None or d.span.file == "--set")]
            if compiled.usage_error or at_override:
                d = (at_override or compiled.diagnostics)[0]
                raise TuneUsageError(f"--vary {key}={value}: {d.message}" + (f" ({d.hint})" if d.hint else ""))


def predict(path: str, base: dict[str, str], combos: list[dict[str, str]], units_for=None) -> list[Candidate]:
    """Compile and simulate every combination (no torch); rejected ones carry the reason."""
    from zdsl.driver import compile_file
    from zdsl.driver import memo_units_for
    units_for = units_for or memo_units_for()
    out = []
    for combo in combos:
        cand = Candidate(combo, {**base, **combo})
        compiled = compile_file(path, cand.overrides, units_for, simulate=True)
        errors = [d for d in compiled.diagnostics if d.is_error]
        cand.warnings = [d.message for d in compiled.diagnostics if d.severity == "warning"]
        if errors or compiled.sim is None:
            d = errors[0] if errors else None
            cand.rejected = short(d.message) if d else "the planner could not simulate it"
        else:
            cand.predicted_s = compiled.sim.step_s
            cand.predicted_peak = {t: compiled.sim.memory.peak(t) for t in TIERS
                                   if compiled.sim.memory.peak(t)}
            cand.digest = compiled.graph.digest()
        out.append(cand)
    return out


def short(text: str, limit: int = 160) -> str:
    """The first sentence-ish of a diagnostic, for a table cell."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def ranked(cands: list[Candidate]) -> list[Candidate]:
    """Accepted candidates, fastest predicted first (ties: less peak memory, then the order given)."""
    ok = [c for c in cands if c.rejected is None]
    return sorted(ok, key=lambda c: (round(c.predicted_s, 9), sum(c.predicted_peak.values())))


# -- writing the winner -----------------------------------------------------------

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
    2. **print the checked schedule** (``zdsl.lang.printer``): always valid, loses comments.

    Paths relative to the schedule (includes) are rewritten for ``out_path``'s folder.
    Returns (text, how); raises ValueError when neither way reproduces the graph.
    """
    from zdsl.driver import compile_file
    from zdsl.driver import memo_units_for
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


def graph_key(graph) -> str:
    """The graph's digest without source positions (the schedule's file name in the config,
    each op's span): the same schedule written elsewhere compiles to the same key."""
    import hashlib
    import json
    raw = json.loads(graph.to_json())
    (raw.get("config") or {}).pop("file", None)
    for op in raw.get("ops", []):
        op.pop("span", None)
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def _first_error(compiled) -> str:
    d = next((d for d in compiled.diagnostics if d.is_error), None)
    return d.message if d else "unknown problem"


def _compile_text(text: str, out_path: str, units_for):
    """Compile text as if it were the file at out_path (written to a temp file beside it)."""
    import os
    import tempfile
    from zdsl.driver import compile_file
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
    import os
    p = Path(rel)
    if p.is_absolute():
        return rel
    absolute = (Path(src).resolve().parent / p).resolve()
    return os.path.relpath(absolute, Path(out_path).resolve().parent)


def _edited_text(path: str, overrides: dict[str, str], out_path: str) -> str | None:
    from zdsl.lang import ast
    from zdsl.lang.errors import ZsError
    from zdsl.lang.overrides import _statement_text
    from zdsl.lang.parse import parse_file
    from zdsl.lang.printer import string_text
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
            text = _statement_text(key, value)
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
        i = hits[0].span.line - 1
        old = lines[i].split(" #", 1)[0].strip()
        lines[i] = f"{text}    # tuned by zdsl tune; was: {old}"
    for stmt in program.statements:           # includes relative to the new folder
        if isinstance(stmt, ast.IncludeStmt):
            i = stmt.span.line - 1
            new = _relocated(stmt.path.value, path, out_path)
            if new != stmt.path.value:
                lines[i] = f"include {string_text(new)}"
    if appended:
        lines += ["", "# set by zdsl tune"] + appended
    return "\n".join(lines) + "\n"


def _printed_text(compiled, out_path: str) -> str:
    import copy
    from zdsl.lang.printer import print_schedule
    schedule = copy.deepcopy(compiled.schedule)
    factory = schedule.model.factory
    if factory and ".py:" in factory:       # "my_model.py:build" is relative to the schedule
        file, _, fn = factory.rpartition(":")
        schedule.model.factory = f"{_relocated(file, compiled.path, out_path)}:{fn}"
    return print_schedule(schedule)
