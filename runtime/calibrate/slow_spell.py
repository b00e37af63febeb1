"""A reference step measured slow (or fast) against the machine's usual one: measured again, in
fresh ranks.

The fixed costs a profile holds (``overhead``, ``wake``, ``loop``, ``comm_overhead``: what small
models' steps are made of) are fitted to the reference step calibrate measures. Now and then a
pair of rank processes runs it markedly slower for its whole life, while new processes a few
seconds later run it at the usual speed; a profile fitted to such a pair plans every step of every
program that much slow until the next calibration.

So where the reference step is slower than this machine's usual one (the median of its latest
cached calibrations, ``zdsl.sim.profile_cache.usual_reference``) by more than
``reference.SLOW_SPELL``, or as far faster (``reference.is_off_usual``: the host's fast moments,
which a profile fitted to would plan every program as short), :func:`remeasure` measures the
reference set ``reference.REMEASURES`` more times in new rank processes, each after a pause (in
case the host itself is slow for a while), and keeps the set of the median try (still off the
usual, slower or faster, calibrate warns and keeps the cached profile: ``cli.cache_profile``; a
fast moment passes in seconds, as a slow spell does, and a plan outlives both). The median, not the
fastest: the host also has fast moments, and a profile fitted to the fastest try plans programs
short of their runs. One slow pair among three is outvoted either way. A machine that has become
slower or faster for good costs a few seconds per calibration until its history moves. A machine
with no cached calibration (the first one, which ``zdsl plan`` then caches) has nothing to compare
with: its set is measured the same, without the pauses, so that only two slow pairs of three give
it a slow profile. What an off set costs a plan shows in benchmarks/prediction_error.py (each
program's error against its run, and the reference's drift beside it).
"""
from __future__ import annotations

import time

from zdsl.runtime.calibrate.measure import CalibrationError, Settings
from zdsl.runtime.calibrate.ranks import joined
from zdsl.runtime.calibrate.reference import REMEASURE_PAUSE_S, REMEASURES, is_off_usual, measure_set, set_step
from zdsl.runtime.dist.spawn import LocalRanks, RankFailed, free_port
from zdsl.runtime.run.cli import configure_rank_logging

KEPT = ("runtime", "runtime_variants")      # a rank's reference set: what a new set replaces


def remeasure(raw: list[dict], s: Settings, backend: str, report=lambda: None) -> list[float]:
    """Measure the ranks' reference set (``raw[rank]["runtime"]`` and ``["runtime_variants"]``)
    :data:`REMEASURES` times more, in fresh ranks, where it is off the machine's usual step, slow or
    fast (or there is no usual step to compare with), and put the set of the median try in its
    place (:func:`kept_try`); returns each set's step, the first measured first. ``report`` is
    called before each new set."""
    tries, sets = [set_step(raw)], [raw]
    unknown = s.usual_reference_s is None
    if not (unknown or is_off_usual(tries[0], s.usual_reference_s)):
        return tries
    while len(tries) <= REMEASURES:
        report()
        if not unknown:
            time.sleep(REMEASURE_PAUSE_S)
        again = _in_fresh_ranks(s, backend)
        tries.append(set_step(again))
        sets.append(again)
    for mine, new in zip(raw, sets[kept_try(tries)]):
        mine.update({k: new[k] for k in KEPT})
    return tries


def kept_try(tries: list[float]) -> int:
    """Which of the sets measured (their steps ``tries``, first measured first) the profile is
    fitted to: the median's (of an even number, the faster middle one)."""
    return sorted(range(len(tries)), key=tries.__getitem__)[(len(tries) - 1) // 2]


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
    configure_rank_logging(rank)
    _measure(rank, world, port, s, backend)
