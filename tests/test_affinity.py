import json
import os
import subprocess
import sys

import pytest

from zdsl.runtime.affinity import rank_cores


@pytest.mark.parametrize("rank, world, available, want", [
    (0, 2, [0, 1], [0]),
    (1, 2, [0, 1], [1]),
    (1, 2, [0, 1, 2, 3], [2, 3]),
    (0, 3, [0, 1, 2, 3], [0]),
    (2, 3, [0, 1, 2, 3], [2, 3]),          # uneven: every core used, shares differ by at most one
    (2, 3, [4, 6], [4, 6]),                # fewer cores than ranks: left unbound
    (0, 1, [0, 1], [0, 1]),
])
def test_each_rank_gets_an_even_contiguous_share(rank, world, available, want):
    assert rank_cores(rank, world, available) == want


def test_shares_cover_every_core_once_when_there_are_enough():
    cores = list(range(7))
    shares = [rank_cores(r, 3, cores) for r in range(3)]
    assert sorted(c for s in shares for c in s) == cores


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to bind to")
@pytest.mark.parametrize("setting, bound", [("1", True), ("0", False)])
def test_a_rank_binds_its_threads_unless_told_not_to(setting, bound):
    code = """
import json, os, threading
from zdsl.runtime.affinity import bind_rank
started = threading.Event(); stop = threading.Event()
def spin():
    started.set(); stop.wait()
t = threading.Thread(target=spin); t.start(); started.wait()     # a thread that exists before binding
allowed = sorted(os.sched_getaffinity(0))
cores = bind_rank(1, 2)
tids = [int(x) for x in os.listdir('/proc/self/task')]
masks = {tid: sorted(os.sched_getaffinity(tid)) for tid in tids}
stop.set(); t.join()
print(json.dumps([allowed, cores, sorted(set(map(tuple, masks.values())))]))
"""
    env = dict(os.environ, ZDSL_BIND_CORES=setting)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    allowed, cores, masks = json.loads(out)
    if bound:
        n = len(allowed)
        assert cores == allowed[n // 2:] and masks == [cores]   # every thread, the older one too
    else:
        assert cores is None and masks == [allowed]
