"""A reference step measured slow: measured again, in fresh ranks.

The fixed costs a profile holds (``overhead``, ``wake``, ``loop``, ``comm_overhead``: what small
models' steps are made of) are fitted to the reference step calibrate measures. Now and then a
pair of rank processes runs it 15-30% slower for its whole life, while new processes a few seconds
later run it at the usual speed (benchmarks/README, stop 42); a profile fitted to such a pair
plans every step of every program that much slow until the next calibration.

So where the reference step is slower than this machine's usual one (the median of its latest
cached calibrations, ``zdsl.planner.profile_cache.usual_reference``) by more than
``reference.SLOW_SPELL``, :func:`remeasure` measures the reference set again in new rank
processes after a pause (in case the host itself is slow for a while), up to
``reference.REMEASURES`` times, and keeps the fastest set (still slow, calibrate warns and keeps
the cached profile: ``cli.cache_profile``). A machine that has become slower for good costs a few
seconds per calibration until its history moves. A machine with no cached
calibration (the first one, which ``zdsl plan`` then caches) has nothing to compare with: its set
is measured once more in new ranks, without a pause, and the faster kept, so that only two slow
pairs in a row give it a slow profile.
"""
from __future__ import annotations

import time

from zdsl.runtime.calibrate.measure import CalibrationError, Settings
from zdsl.runtime.calibrate.ranks import joined
from zdsl.runtime.calibrate.reference import REMEASURE_PAUSE_S, REMEASURES, is_slow_spell, measure_set, set_step
from zdsl.runtime.dist.spawn import LocalRanks, RankFailed, free_port


def remeasure(raw: list[dict], s: Settings, backend: str, report=lambda: None) -> list[float]:
    """Measure the ranks' reference set (``raw[rank]["runtime"]`` and ``["runtime_variants"]``)
    again while it is a slow spell (once, with no usual step to compare with), replacing it by a
    faster set; returns each set's step, the first measured first. ``report`` is called before
    each new set."""
    tries = [set_step(raw)]
    unknown = s.usual_reference_s is None
    while len(tries) <= REMEASURES and (is_slow_spell(min(tries), s.usual_reference_s) or unknown and len(tries) < 2):
        report()
        if not unknown:
            time.sleep(REMEASURE_PAUSE_S)
        again = _in_fresh_ranks(s, backend)
        tries.append(set_step(again))
        if tries[-1] < min(tries[:-1]):
            for mine, new in zip(raw, again):
                mine["runtime"], mine["runtime_variants"] = new["runtime"], new["runtime_variants"]
    return tries


def _in_fresh_ranks(s: Settings, backend: str) -> list[dict]:
    """Each rank's reference set, measured by ``s.ranks`` processes started for it (rank 0 this one)."""
    port = free_port()
    children = LocalRanks(_child, s.ranks, (port, s, backend), first=1, port=port)
    with children:
        try:
            every = _measure(0, s.ranks, port, s, backend)
            children.join(timeout_s=s.timeout_s)
        except RankFailed as failed:
            raise CalibrationError(f"measuring the reference step again: {failed}") from None
        except Exception as e:
            causes = "; ".join(str(f) for f in children.failures())
            raise CalibrationError(f"measuring the reference step again: rank 0: {type(e).__name__}: {e}"
                                   + (f"; {causes}" if causes else "")) from None
    return every


def _measure(rank: int, world: int, port: int, s: Settings, backend: str) -> list[dict]:
    import torch.distributed as dist
    with joined(rank, world, port, s, backend) as me:
        blocks, variants = measure_set(me.device, s, rank, world, me.slots)
        mine = {"runtime": blocks, "runtime_variants": variants}
        if world == 1:
            return [mine]
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        return every


def _child(rank: int, world: int, port: int, s: Settings, backend: str) -> None:
    from zdsl.runtime.run.cli import configure_rank_logging
    configure_rank_logging(rank)
    _measure(rank, world, port, s, backend)
