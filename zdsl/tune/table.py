"""``zdsl tune``'s table: every candidate, predicted beside measured (median and spread), and its verdict;
and the same as JSON (``--json``) for scripts."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from zdsl.ir import TIERS
from zdsl.lang.sizes import human_bytes
from zdsl.tune import noise
from zdsl.tune.search import Candidate, ranked


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f} ms"


def _bytes(n: int | None) -> str:
    return human_bytes(n) if n else "-"


def _spread(cand: Candidate) -> str:
    if not cand.rounds:
        return "-"
    lo, hi = noise.spread(list(cand.rounds.values()))
    return f"{lo * 1e3:.2f}..{hi * 1e3:.2f}"


def verdict(cand: Candidate, winner: Candidate | None, why: str, rank: int | None,
            cands: list[Candidate], measure_k: int) -> str:
    if cand.rejected:
        return f"rejected: {cand.rejected}"
    if cand.pruned:
        return f"pruned: {cand.pruned}"
    if cand.failed:
        return f"run failed: {cand.failed}"
    if cand is winner:
        return f"best (measured): {why}" if cand.rounds else "best (predicted; not measured)"
    if cand.same_run:
        keep = next(c for c in cands if c.label == cand.same_run)
        keys = [k for k, v in cand.combo.items() if keep.combo.get(k) != v]
        return (f"the same task graph as {cand.same_run} ({', '.join(keys)} change{'s' if len(keys) == 1 else ''} "
                "nothing here): run once, as it")
    if cand.rounds and winner is not None and winner.rounds:
        text = noise.verdict(cand, winner, cands)
        return text + (f"; not run after round {cand.dropped}" if cand.dropped else "")
    return (f"not measured (predicted #{rank}; --measure {measure_k} runs the {measure_k} best predicted, "
            "one per task graph)")


def print_table(cands: list[Candidate], winner: Candidate | None, why: str, args, title: str) -> None:
    console = Console(width=None if sys.stdout.isatty() else 240, highlight=False)
    order = {id(c): i for i, c in enumerate(ranked(cands), 1)}
    tiers = [t for t in TIERS if any(c.predicted_peak.get(t) or c.measured_peak.get(t) for c in cands)] \
        or ["device"]
    table = Table(title=title, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("combination")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("spread ms", justify="right")
    table.add_column("rounds", justify="right")
    table.add_column("step/pred", justify="right")
    for t in tiers:
        table.add_column(f"peak {t}", justify="right")
    table.add_column("verdict", overflow="fold")
    for cand in sorted(cands, key=lambda c: (order.get(id(c), 10 ** 9), cands.index(c))):
        rank = order.get(id(cand))
        ratio = f"{cand.typical_s / cand.predicted_s:.2f}" \
            if cand.typical_s is not None and cand.predicted_s else "-"
        peaks = []
        for t in tiers:
            if cand.measured_peak.get(t):
                peaks.append(_bytes(cand.measured_peak[t]))
            elif cand.predicted_peak.get(t):
                peaks.append(_bytes(cand.predicted_peak[t]) + " (plan)")
            else:
                peaks.append("-")
        style = "bold green" if cand is winner else ("dim" if cand.rejected or cand.pruned else None)
        table.add_row(str(rank) if rank else "-", cand.label, _ms(cand.predicted_s), _ms(cand.measured_s),
                      _spread(cand), str(len(cand.rounds)) if cand.rounds else "-", ratio, *peaks,
                      verdict(cand, winner, why, rank, cands, args.measure), style=style)
    console.print(table)


def as_json(cands: list[Candidate], winner: Candidate | None, why: str, args, race) -> dict:
    """Every candidate's figures and verdict; ``slower_than`` is the claim its verdict makes, if any."""
    order = {id(c): i for i, c in enumerate(ranked(cands), 1)}
    rows = []
    for cand in cands:
        rank = order.get(id(cand))
        other = noise.slower_than(cand, winner, cands) if cand.rounds and winner is not None \
            and winner.rounds and cand is not winner else None
        rows.append({
            "combination": cand.combo, "label": cand.label, "predicted_rank": rank,
            "predicted_s": cand.predicted_s, "predicted_peak": cand.predicted_peak,
            "rounds": {str(r): v for r, v in sorted(cand.rounds.items())}, "measured_s": cand.measured_s,
            "typical_s": cand.typical_s,
            "spread_s": list(noise.spread(list(cand.rounds.values()))) if cand.rounds else None,
            "measured_peak": cand.measured_peak, "rejected": cand.rejected, "pruned": cand.pruned,
            "failed": cand.failed, "dropped_after_round": cand.dropped, "same_run": cand.same_run,
            "slower_than": other.label if other is not None else None,
            "verdict": verdict(cand, winner, why, rank, cands, args.measure)})
    return {"file": args.file, "winner": winner.label if winner else None, "why": why,
            "rounds": race.rounds if race else 0, "seconds": race.seconds if race else 0.0,
            "stopped": race.stopped if race else "planner only", "steps": args.steps, "warmup": args.warmup,
            "candidates": rows}
