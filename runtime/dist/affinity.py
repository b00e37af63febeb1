"""Each rank of a CPU run on its own share of the host's cores, with torch's threads sized to it.

Ranks left to float over every core of a host trade places all the time: one
rank's compute thread lands on the core where the other rank's collective
thread was about to run, and each migration costs caches and a wake-up;
bound ranks step faster with the same bits (``benchmarks/vs_peers.py`` runs
every peer both ways). It is what DeepSpeed's ``--bind_cores_to_rank`` does, and it
makes the cost model's ``cores`` per rank what the rank really has.

With more ranks than cores the ranks stay unbound: two ranks pinned to one
core cannot borrow another that a waiting pair leaves idle (4 ranks on 2
cores ran twice as slow bound). ``ZDSL_BIND_CORES=0`` leaves them unbound.
"""
from __future__ import annotations

import os
import time

from zdsl import env


def rank_cores(local_rank: int, local_world: int, available: list[int]) -> list[int]:
    """The cores of ``available`` that ``local_rank`` of ``local_world`` ranks gets: an even,
    contiguous share; all of them when there are fewer cores than ranks (no binding)."""
    n = len(available)
    if n < local_world or local_world <= 0:
        return list(available)
    lo, hi = local_rank * n // local_world, (local_rank + 1) * n // local_world
    return available[lo:hi]


def binding_wanted() -> bool:
    return env.flag("ZDSL_BIND_CORES")


def bind_rank(local_rank: int, local_world: int) -> list[int] | None:
    """Restrict this process (every thread it has now, and those it starts later) to its share
    of the cores it may use; returns the cores, or None where binding is off or unsupported."""
    if not binding_wanted() or not hasattr(os, "sched_setaffinity"):
        return None
    available = sorted(os.sched_getaffinity(0))
    mine = rank_cores(local_rank, local_world, available)
    if not mine or mine == available:
        return None
    for tid in _thread_ids():    # threads started before this (torch's, gloo's) keep their own mask
        try:
            os.sched_setaffinity(tid, mine)
        except OSError:
            pass                 # a thread that has just ended
    return mine


def local_rank_and_world(rank: int, world: int) -> tuple[int, int]:
    """This host's rank and rank count (torchrun and ``zdsl run`` set LOCAL_*; else the global ones)."""
    local_rank, local_world = env.raw("LOCAL_RANK"), env.raw("LOCAL_WORLD_SIZE")
    if local_rank is None or local_world is None:
        return rank, world
    try:
        return int(local_rank), int(local_world)
    except ValueError:                            # not a number
        return rank, world


def set_cpu_threads(rank: int, world: int) -> int:
    """Bind this rank to its share of the host's cores and give torch as many threads as that
    share; an explicit OMP_NUM_THREADS wins for the thread count (the peers benchmark).
    Returns torch's thread count."""
    import torch
    local_rank, local_world = local_rank_and_world(rank, world)
    cores = bind_rank(local_rank, local_world)
    if env.raw("OMP_NUM_THREADS") is None:
        share = len(cores) if cores else (os.cpu_count() or 1) // max(1, local_world)
        torch.set_num_threads(max(1, share))
    return torch.get_num_threads()


# gloo's TCP transport runs one event-loop thread per device ("gloo_tcp_loop").
GLOO_LOOP_THREAD = "gloo_tcp_loop"
LOOP_POLICIES = {"batch": getattr(os, "SCHED_BATCH", None), "idle": getattr(os, "SCHED_IDLE", None),
                 "normal": getattr(os, "SCHED_OTHER", None)}


def loop_policy_wanted() -> str:
    policy = env.get("ZDSL_GLOO_LOOP_POLICY")
    assert policy is not None, "registered with a default, so never None"
    return policy


def loop_policy_error() -> str | None:
    """What is wrong with ZDSL_GLOO_LOOP_POLICY, or None (checked before a run or a calibration
    joins its group: ``collectives.check_settings``)."""
    if loop_policy_wanted() not in LOOP_POLICIES:
        return f"ZDSL_GLOO_LOOP_POLICY={loop_policy_wanted()!r}: use one of {', '.join(LOOP_POLICIES)}"
    return None


def _thread_ids() -> list[int]:
    """This process's threads (just the caller's where /proc is not there)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def calm_gloo_loops(wait_s: float = 1.0, policy: str | None = None) -> int:
    """Stop gloo's event-loop threads from preempting the threads they wake; returns how many moved.

    gloo's loop thread, woken by a socket, handles a pair's events only if it can take the pair's
    lock (try-lock) and otherwise goes straight back to ``epoll_wait``, which returns at once
    (level-triggered). When the lock holder shares the loop's core, waking the loop preempts the
    holder and the loop then spins on the lock it cannot get until the next timer tick (4 ms at
    HZ=250) lets the holder run, so a short collective can take a whole tick. As SCHED_BATCH the
    loop thread keeps its full share of the core but never preempts on waking, so the holder
    finishes first.

    The loop thread names itself once it runs, which can be after ``init_process_group`` returns
    (on a loaded host a test found none so named): so this waits up to ``wait_s`` for one.
    ``policy`` is one of :data:`LOOP_POLICIES`' names, ZDSL_GLOO_LOOP_POLICY's when not given.
    Every loop thread of the process moves, so a call after more groups exist moves theirs too.
    """
    policy = LOOP_POLICIES.get(policy or loop_policy_wanted())
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return 0
    deadline = time.monotonic() + wait_s
    while True:
        loops = [tid for tid in _thread_ids() if _thread_name(tid) == GLOO_LOOP_THREAD]
        if loops or time.monotonic() >= deadline:
            break
        time.sleep(0.001)
    moved = 0
    for tid in loops:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            moved += 1
        except OSError:
            pass                 # a thread that has just ended, or a policy not allowed here
    return moved


def _thread_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def loop_policies() -> dict[str, int]:
    """How many of this process's gloo event-loop threads run under each policy, by its
    :data:`LOOP_POLICIES` name (``"other:N"`` for one not there): what a run really had."""
    names = {number: name for name, number in LOOP_POLICIES.items() if number is not None}
    found: dict[str, int] = {}
    for tid in _thread_ids():
        if _thread_name(tid) != GLOO_LOOP_THREAD:
            continue
        try:
            number = os.sched_getscheduler(tid)
        except (OSError, AttributeError):
            continue             # a thread that has just ended, or no scheduling policies here
        name = names.get(number, f"other:{number}")
        found[name] = found.get(name, 0) + 1
    return found
