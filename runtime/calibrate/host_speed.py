"""The host's compute speed over a calibration, and the compute rates taken at it.

A CPU's compute table (``measure.measure_compute_table``) is measured in a fraction of a second
per entry: a snapshot of a host whose speed moves from one second to the next (its fp32 width-512
rate was 6.4e10 and 9.7e10 flop/s in two quick calibrations minutes apart, while the programs
planned with them ran within 8% of each other: benchmarks/README, stop 45). So the table's
width-:data:`PROBE_WIDTH` block, the probe, runs again at points spread over the calibration (after
each reference block, the variants and the wide step's every step); their median is the host's
*level*, and each rank's rates are scaled from the table's moment to it:

- the compute rates (``compute``'s and ``compute_table``'s, shared by all ranks at once) divided
  by the host's speed when the table was measured;
- the wide reference step's units' CPU time (``runtime_wide``, for ``compute_excess``) multiplied
  by the host's speed beside those steps, so that a spell between the two is not an excess.

A speed is relative to the level: the level's time over the probe's time at that moment.

The one-rank table (``compute_alone``, every core) is its own snapshot under other conditions and
is left as measured. Where a rank has no probe times (a GPU; an older record), nothing changes.
"""
from __future__ import annotations

import statistics

from zdsl.runtime.calibrate.measure import TABLE_WIDTHS

# The table's width above the wide step's (``reference.WIDE_WIDTH``, 256): its compute outweighs
# its kernels' fixed costs, as the wide units' does.
PROBE_WIDTH = 512
assert PROBE_WIDTH in TABLE_WIDTHS["cpu"]


def level(rank_raw: dict) -> float | None:
    """The probe's median seconds over the calibration (``probe_s`` and the wide step's), or None."""
    times = [*rank_raw.get("probe_s", ()), *rank_raw.get("runtime_wide", {}).get("probe_s", ())]
    return statistics.median(times) if times else None


def table_seconds(rank_raw: dict) -> float | None:
    """The probe's time when the compute table was measured (its fp32 entry at :data:`PROBE_WIDTH`)."""
    table = rank_raw.get("compute_table", {})
    seconds = table.get("seconds", {}).get("fp32")
    return seconds[table["widths"].index(PROBE_WIDTH)] if seconds and PROBE_WIDTH in table["widths"] else None


def table_speed(rank_raw: dict) -> float:
    """The host's speed while the compute table was measured, relative to its level (the level's
    time over the probe's in the table; 1 where either is missing): 1.2 is 20% faster."""
    then, usual = table_seconds(rank_raw), level(rank_raw)
    return usual / then if then and usual else 1.0


def wide_speed(rank_raw: dict) -> float:
    """The host's speed beside the wide step's steps, relative to its level: the level's time over
    the probe's median there (1 where not measured)."""
    beside = rank_raw.get("runtime_wide", {}).get("probe_s")
    return level(rank_raw) / statistics.median(beside) if beside else 1.0


def at_level(rank_raw: dict) -> dict:
    """A copy of one rank's record with its shared compute rates and its wide units' CPU time
    taken at the host's level (see the module's docstring); ``host_speed``: the speeds they were
    measured at (:func:`table_speed`, :func:`wide_speed`)."""
    speed = {"table": table_speed(rank_raw), "wide": wide_speed(rank_raw)}
    table_f, wide_f = 1 / speed["table"], speed["wide"]
    out = dict(rank_raw, host_speed=speed)
    compute = rank_raw["compute"]
    out["compute"] = dict(compute, **{key: compute[key] * table_f for key in ("mm_flops", "block_flops")
                                      if compute.get(key)})
    table = rank_raw["compute_table"]
    out["compute_table"] = dict(table, **{p: [r * table_f for r in table[p]]
                                          for p in ("fp32", "bf16", "fp16") if p in table})
    if "runtime_wide" in rank_raw:
        wide = rank_raw["runtime_wide"]
        out["runtime_wide"] = dict(wide, compute_cpu_s={i: t * wide_f for i, t in wide["compute_cpu_s"].items()})
    return out
