"""``zdsl tune``'s measurement: a candidate run for real, its step times read back.

Each run is ``zdsl run FILE --set ...`` in a subprocess (the candidate's
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

from zdsl.env import child_environment
from zdsl.tune.search import Candidate


def measure(path: str, cand: Candidate, steps: int, timeout_s: float) -> None:
    """One short real run: median step time (first step excluded) and peak bytes per tier."""
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
            cand.failed = f"run took longer than {timeout_s:.0f} s"
            return
        rows = read_metrics(metrics)
        if proc.returncode != 0 or not rows:
            lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
            cand.failed = (lines[-1] if lines else f"exit status {proc.returncode}")[:200]
            return
    apply_metrics(cand, rows)


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


def apply_metrics(cand: Candidate, rows: list[dict]) -> None:
    """Fill ``cand``'s measured fields: every step time, their median without the first, peak bytes per tier."""
    times = [float(r["step_s"]) for r in rows]
    cand.measured_steps = times
    timed = times[1:] if len(times) > 1 else times
    cand.measured_s = statistics.median(timed)
    peak: dict[str, int] = {}
    for r in rows:
        for per_tier in (r.get("peak_bytes") or {}).values():
            for tier, b in (per_tier or {}).items():
                peak[tier] = max(peak.get(tier, 0), int(b))
    cand.measured_peak = {t: b for t, b in peak.items() if b}
