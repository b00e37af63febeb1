"""``zdsl tune``'s measurement: a candidate run for real, its step times read back.

One call is one candidate's turn in a round (``zdsl.tune.rounds``). Each
run is ``zdsl run FILE --set ...`` in a subprocess (the candidate's
overrides, ``steps``, ``--metrics`` into a temporary folder), exactly as a
user would run it and outside any launcher's rank variables; the tuner
itself never imports torch.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from zdsl.env import child_environment
from zdsl.tune.search import Candidate


class RunFailed(Exception):
    """A measured run that did not finish; the message is the reason for the table."""


@dataclass
class Run:
    """What one measured run gave: its median step time after warm-up, and peak bytes per tier."""
    median_s: float
    peak: dict[str, int]


def measure(path: str, cand: Candidate, steps: int, warmup: int, timeout_s: float) -> Run:
    """One short real run of ``steps`` steps; the first ``warmup`` are not timed. Raises RunFailed."""
    with tempfile.TemporaryDirectory(prefix="zdsl-tune-") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = [sys.executable, "-m", "zdsl.cli", "run", path]
        for k, v in cand.overrides.items():
            cmd += ["--set", f"{k}={v}"]
        cmd += ["--set", f"steps={steps}", "--metrics", metrics, "--quiet"]
        # zdsl run is the launcher here: an outer launcher's rank variables would make it a rank
        env = child_environment(drop=("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"run took longer than {timeout_s:.0f} s") from None
        rows = read_metrics(metrics)
        if proc.returncode != 0 or not rows:
            lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
            raise RunFailed((lines[-1] if lines else f"exit status {proc.returncode}")[:200])
    return run_of(rows, warmup)


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
    """The median step time without the first ``warmup`` steps (all, if that leaves none), peak bytes per tier."""
    times = [float(r["step_s"]) for r in rows]
    timed = times[warmup:] or times
    peak: dict[str, int] = {}
    for r in rows:
        for per_tier in (r.get("peak_bytes") or {}).values():
            for tier, b in (per_tier or {}).items():
                peak[tier] = max(peak.get(tier, 0), int(b))
    return Run(statistics.median(timed), {t: b for t, b in peak.items() if b})
