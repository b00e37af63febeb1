"""``zdsl tune``'s measurement: candidates run for real, their step times read back.

:func:`measure_round` runs one round (``zdsl.tune.rounds``): every candidate
given, in the order given, as a variant of one launch (``zdsl run FILE
--variants V.json``, ``runtime/run/variants.py``): each a complete short run
with its own compiled graph, fresh model and state, and metrics file, while
the launcher and the ranks' start-up are paid once and the candidates share
the processes' conditions. When that launch fails or overruns, the round's
candidates are run again one by one, so a failure is named for the candidate
that has it and the others still get their figures.

:func:`measure` is one candidate alone: ``zdsl run FILE --set ...`` exactly as a
user would run it. Both run outside any launcher's rank variables (steps set
by ``steps``, ``--metrics`` into a temporary folder); the tuner itself never
imports torch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from zdsl.env import child_environment
from zdsl.tune.search import Candidate


class RunFailed(Exception):
    """A measured run that did not finish; the message is the reason for the table."""


# A run's figure is a low quantile of its timed steps, not their median. A shared host has spells
# of a second or so in which every step is much slower; a run of 50 timed steps outlasts one, and
# its fast tenth are the steps no spell fell on. Spells slow steps, never speed them, so this figure
# leaves them out and the round ratios' spread is far narrower by it than by the median.
RUN_QUANTILE = 0.10


@dataclass
class Run:
    """What one measured run gave: its figure (:func:`run_of`), peak bytes per tier, and its median
    timed step (what the planner predicts: a typical step, not a fast one)."""
    step_s: float
    peak: dict[str, int]
    typical_s: float | None = None


def measure_round(path: str, cands: list[Candidate], steps: int, warmup: int,
                  timeout_s: float) -> dict[str, Run | RunFailed]:
    """Each of ``cands`` run once, back to back in one launch, ``steps`` steps of which the first
    ``warmup`` are not timed; by label, its Run or why it failed. ``timeout_s`` is per candidate."""
    if len(cands) > 1:
        with tempfile.TemporaryDirectory(prefix="zdsl-tune-") as tmp:
            variants, files = write_variants(tmp, cands)
            try:
                run_zdsl(path, ["--set", f"steps={steps}", "--variants", variants], timeout_s * len(cands))
                every = [read_metrics(m) for m in files]
                if all(every):
                    return {c.label: run_of(rows, warmup) for c, rows in zip(cands, every)}
            except RunFailed:
                pass                               # named per candidate below
    return measure_each(path, cands, steps, warmup, timeout_s)


def write_variants(folder: str, cands: list[Candidate]) -> tuple[str, list[str]]:
    """``cands`` as a ``--variants`` file in ``folder``, in the order given: its path, and each one's
    metrics file beside it."""
    files = [os.path.join(folder, f"metrics{i}.jsonl") for i in range(len(cands))]
    variants = os.path.join(folder, "variants.json")
    with open(variants, "w", encoding="utf-8") as f:
        json.dump([{"overrides": [f"{k}={v}" for k, v in c.overrides.items()], "metrics": m}
                   for c, m in zip(cands, files)], f)
    return variants, files


def measure_each(path: str, cands: list[Candidate], steps: int, warmup: int,
                 timeout_s: float) -> dict[str, Run | RunFailed]:
    """Each of ``cands`` in its own ``zdsl run`` (:func:`measure`), in the order given; by label, its
    Run or why it failed."""
    out: dict[str, Run | RunFailed] = {}
    for cand in cands:
        try:
            out[cand.label] = measure(path, cand, steps, warmup, timeout_s)
        except RunFailed as exc:
            out[cand.label] = exc
    return out


def measure(path: str, cand: Candidate, steps: int, warmup: int, timeout_s: float) -> Run:
    """One short real run of ``steps`` steps; the first ``warmup`` are not timed. Raises RunFailed."""
    with tempfile.TemporaryDirectory(prefix="zdsl-tune-") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        run_zdsl(path, set_options(cand) + ["--set", f"steps={steps}", "--metrics", metrics], timeout_s)
        rows = read_metrics(metrics)
        if not rows:
            raise RunFailed("the run wrote no step")
    return run_of(rows, warmup)


def set_options(cand: Candidate) -> list[str]:
    """``cand``'s overrides as ``zdsl run`` options: ``--set key=value`` each."""
    return [x for k, v in cand.overrides.items() for x in ("--set", f"{k}={v}")]


def run_zdsl(path: str, options: list[str], timeout_s: float) -> None:
    """``zdsl run path options --quiet`` as a user would start it; RunFailed (its last error line, else
    its last line) unless it exits with status 0 within ``timeout_s``."""
    cmd = [sys.executable, "-m", "zdsl.cli", "run", path, *options, "--quiet"]
    # zdsl run is the launcher here: an outer launcher's rank variables would make it a rank
    env = child_environment(drop=("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"run took longer than {timeout_s:.0f} s") from None
    if proc.returncode != 0:                       # the error, not the hint or source line after it
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error:" in ln]
        raise RunFailed((errors or lines or [f"exit status {proc.returncode}"])[-1][:200])


def read_metrics(path: str) -> list[dict]:
    """The step rows of a ``--metrics`` file; lines that are not a step's JSON are skipped, [] if unreadable."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(row, dict) and "step_s" in row:
                        rows.append(row)
    except OSError:
        return []
    return rows


def run_of(rows: list[dict], warmup: int) -> Run:
    """The :data:`RUN_QUANTILE` quantile of the step times without the first ``warmup`` steps (all, if
    that leaves none), peak bytes per tier, and the median of those step times."""
    times = [float(r["step_s"]) for r in rows]
    timed = sorted(times[warmup:] or times)
    peak: dict[str, int] = {}
    for r in rows:
        for per_tier in (r.get("peak_bytes") or {}).values():
            for tier, b in (per_tier or {}).items():
                peak[tier] = max(peak.get(tier, 0), int(b))
    return Run(quantile(timed, RUN_QUANTILE), {t: b for t, b in peak.items() if b}, quantile(timed, 0.5))


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``xs``, interpolated between neighbours (the smallest at 0, the largest at 1)."""
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
