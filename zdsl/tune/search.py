"""``zdsl tune``'s search: the candidates ``--vary`` names, ranked by the planner.

Tuning is a search over a few policy values (``prefetch``, ``bucket``,
``overlap``, ...). Every combination is compiled exactly as ``zdsl plan FILE
--set k=v ...`` would compile it, so the verifier judges it first: a
combination over a memory budget (or otherwise invalid) is *rejected with
the verifier's reason* and never run. The rest are ranked by predicted step
time and those that cannot win are pruned (:func:`prune`); those that compile
to the same ops are one run (:func:`same_runs`); ``zdsl.tune.rounds`` then
measures the best few against each other and ``zdsl.tune.write`` writes the
winner.

No torch is imported by this module (the front end's rule).
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

from zdsl.driver import compile_file, memo_units_for
from zdsl.ir import TIERS
from zdsl.lang.errors import UsageError
from zdsl.lang.overrides import statement_text
from zdsl.lang.sizes import SizeError, parse_size
from zdsl.tune import ranges
from zdsl.tune.write import LOWERED_CONFIG, graph_key


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
    """``["prefetch=0..4", "bucket=16MiB,64MiB"]`` -> [(key, values)], ranges expanded
    (``zdsl.tune.ranges``), keys checked against ``--set``'s."""
    out: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for item in items:
        key, eq, rest = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise TuneUsageError(f"--vary expects key=v1,v2,..., got {item!r}")
        if key in seen:
            raise TuneUsageError(f"--vary {key} is given twice; list all its values once: {key}=v1,v2")
        items = split_values(rest)
        if not rest.strip() or any(not v for v in items):
            raise TuneUsageError(f"--vary {key}: empty value in {rest!r}; give values as {key}=v1,v2")
        values = []
        for v in items:
            try:
                values += ranges.expand(key, v) if ranges.is_range(v) else [v]
            except ranges.RangeError as exc:
                raise TuneUsageError(str(exc)) from None
        if len(set(values)) != len(values):
            raise TuneUsageError(f"--vary {key}: a value is listed twice in {rest!r}"
                                 + (" (after expanding its ranges)" if len(values) != len(items) else ""))
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
    pruned: str | None = None                     # why the planner ruled it out before any run
    rounds: dict[int, float] = field(default_factory=dict)   # round -> its run's figure (zdsl.tune.measure.run_of)
    typical: dict[int, float] = field(default_factory=dict)  # round -> its run's median step
    dropped: int | None = None                    # the round after which it was clearly slower and not run again
    measured_peak: dict[str, int] = field(default_factory=dict)   # tier -> max over ranks, steps and rounds
    failed: str | None = None                     # a measured run that did not finish
    changes: int | None = None                    # varied values that differ from the file's own
    run_key: str | None = None                    # the same for candidates whose task graphs run alike
    lowered: tuple = ()                           # its values of the config entries the ops carry (LOWERED_CONFIG)
    same_run: str | None = None                   # the label of the candidate measured for it (same_runs)

    @property
    def label(self) -> str:
        return label(self.combo)

    @property
    def measured_s(self) -> float | None:
        """The median of the round figures; None before any round."""
        return self.median if self.rounds else None

    @property
    def predicted(self) -> float:
        """``predicted_s`` of an accepted candidate (:func:`predict` gives each one it accepts)."""
        if self.predicted_s is None:
            raise ValueError(f"{self.label} has no prediction: {self.rejected or 'not predicted'}")
        return self.predicted_s

    @property
    def median(self) -> float:
        """``measured_s`` of a candidate with rounds."""
        if not self.rounds:
            raise ValueError(f"{self.label} has no measured rounds")
        return statistics.median(self.rounds.values())

    @property
    def typical_s(self) -> float | None:
        """The median of the runs' median steps: the step the planner's prediction is of."""
        return statistics.median(self.typical.values()) if self.typical else None


def validate_values(path: str, base: dict[str, str], vary: list[tuple[str, list[str]]], units_for) -> None:
    """Every value must at least parse and check on its own; else a usage error naming it.

    (A value valid alone but invalid with others, or over a budget, is a rejection, not
    a usage error.)
    """
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
            cand.run_key, cand.lowered = run_identity(compiled.graph)
        out.append(cand)
    return out


def short(text: str, limit: int = 160) -> str:
    """The first sentence-ish of a diagnostic, for a table cell."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def ranked(cands: list[Candidate]) -> list[Candidate]:
    """Accepted candidates, fastest predicted first (ties: less peak memory, then the order given)."""
    ok = [c for c in cands if c.rejected is None]
    return sorted(ok, key=lambda c: (round(c.predicted, 9), sum(c.predicted_peak.values())))


def run_identity(graph) -> tuple[str, tuple]:
    """(the key graphs that run alike share, the graph's values of the config entries its ops carry)."""
    return graph_key(graph, runs_alike=True), tuple(repr(graph.config.get(k)) for k in LOWERED_CONFIG)


def same_runs(survivors: list[Candidate], own: tuple, order: dict[str, list[str]]) -> list[Candidate]:
    """``survivors`` with one candidate per task graph that runs alike, in their order: measuring
    copies of one run would only rank its noise (7 buckets over a model whose gradients fit the
    smallest). The one kept has the fewest of those values changed from the file's own (``own``:
    the file's :func:`run_identity` values), then the smaller values in ``--vary`` order; the
    others are marked with its label (``same_run``)."""
    groups: dict[str | int, list[Candidate]] = {}   # a candidate with no run key is alone
    for cand in survivors:
        groups.setdefault(cand.run_key or id(cand), []).append(cand)
    kept = []
    for group in groups.values():
        keep = min(group, key=lambda c: (sum(a != b for a, b in zip(c.lowered, own)), value_ranks(c, order)))
        for cand in group:
            if cand is not keep:
                cand.same_run = keep.label
        kept.append(keep)
    return sorted(kept, key=survivors.index)


def value_ranks(cand: Candidate, order: dict[str, list[str]]) -> tuple:
    """:func:`value_rank` of each of ``cand``'s varied values (``order``: each key's values in ``--vary`` order)."""
    return tuple(value_rank(order.get(k, []), v) for k, v in cand.combo.items())


def value_rank(values: list[str], value: str) -> float:
    """A value's size among its key's values: its number where it is a number or a size, else its position."""
    try:
        return float(parse_size(value))
    except SizeError:
        return float(values.index(value)) if value in values else float("inf")


# Why 1.5: within one calibration the programs' errors stay within a factor 1.4 between the most
# over- and the most under-predicted (benchmarks/prediction_error.py); a candidate predicted 1.5x
# the best would need errors wider than that in opposite directions to win. Candidates of one
# program share most of their error.
PRUNE_FACTOR = 1.5


def prune(cands: list[Candidate], factor: float = PRUNE_FACTOR) -> list[Candidate]:
    """Mark accepted candidates predicted slower than ``factor`` x the best predicted as pruned.

    Returns the survivors, fastest predicted first. (Over-budget ones are already
    rejected by the verifier.)
    """
    ok = ranked(cands)
    if not ok:
        return []
    best = ok[0].predicted
    for c in ok:
        if c.predicted > factor * best:
            c.pruned = (f"predicted {c.predicted / best:.2f}x the best predicted "
                        f"({c.predicted * 1e3:.2f} vs {best * 1e3:.2f} ms; pruned above {factor:g}x)")
    return [c for c in ok if c.pruned is None]


def count_changes(path: str, cand: Candidate, units_for) -> int:
    """How many of ``cand``'s varied values change the task graph from what the file (with --set) gives."""
    mine = compile_file(path, cand.overrides, units_for, simulate=False)
    if mine.graph is None:
        return len(cand.combo)
    want, n = graph_key(mine.graph), 0
    for key in cand.combo:
        rest = {k: v for k, v in cand.overrides.items() if k != key}
        other = compile_file(path, rest, units_for, simulate=False)
        n += not (other.graph is not None and graph_key(other.graph) == want)
    return n
