"""``zdsl tune``'s search: the candidates ``--vary`` names, ranked by the planner.

Tuning is a search over a few policy values (``prefetch``, ``bucket``,
``overlap``, ...). Every combination is compiled exactly as ``zdsl plan FILE
--set k=v ...`` would compile it, so the verifier judges it first: a
combination over a memory budget (or otherwise invalid) is *rejected with
the verifier's reason* and never run. The rest are ranked by predicted step
time; ``zdsl.tune.measure`` then runs the best few and ``zdsl.tune.write``
writes the winner.

No torch is imported by this module (the front end's rule).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

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
    from zdsl.lang.overrides import statement_text
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
            statement_text(key, values[0])          # unknown keys fail here, with the nearest valid key
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
