import json
import os
import subprocess
import sys

import pytest

from zdsl.runtime.dist.affinity import rank_cores


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
from zdsl.runtime.dist.affinity import bind_rank
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


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs Linux scheduling policies")
@pytest.mark.parametrize("setting, policy", [(None, "SCHED_BATCH"), ("normal", "SCHED_OTHER")])
def test_gloo_loop_threads_stop_preempting_unless_told_not_to(setting, policy):
    code = """
import json, os, socket, time
import torch, torch.distributed as dist
from zdsl.runtime.dist.group import init_group
free = socket.socket(); free.bind(('127.0.0.1', 0)); port = free.getsockname()[1]; free.close()
os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
init_group(0, 1, torch.device('cpu'), 30)
def names_now():
    names = {}
    for tid in os.listdir('/proc/self/task'):
        try:
            name = open(f'/proc/self/task/{tid}/comm').read().strip()
            names.setdefault(name, set()).add(os.sched_getscheduler(int(tid)))
        except OSError:
            pass                      # a thread that ended meanwhile
    return names
# gloo's loop thread names itself once it runs, which on a loaded host can be after init returns
# (ZDSL_GLOO_LOOP_POLICY=normal waits for nothing): look once it has, not before
deadline = time.monotonic() + 60
while 'gloo_tcp_loop' not in (names := names_now()) and time.monotonic() < deadline:
    time.sleep(0.01)
dist.destroy_process_group()
print(json.dumps({k: sorted(v) for k, v in names.items()}))
"""
    env = dict(os.environ)
    env.pop("ZDSL_GLOO_LOOP_POLICY", None)
    if setting:
        env["ZDSL_GLOO_LOOP_POLICY"] = setting
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    policies = json.loads(out.strip().splitlines()[-1])
    assert policies["gloo_tcp_loop"] == [getattr(os, policy)]
    others = {p for name, ps in policies.items() if name != "gloo_tcp_loop" for p in ps}
    assert others == {os.SCHED_OTHER}                  # only the loop threads move


def test_a_bad_loop_policy_is_named():
    from zdsl.runtime.dist.collectives import check_settings
    os.environ["ZDSL_GLOO_LOOP_POLICY"] = "fast"
    try:
        with pytest.raises(ValueError, match="ZDSL_GLOO_LOOP_POLICY='fast'.*batch, idle, normal"):
            check_settings()
    finally:
        del os.environ["ZDSL_GLOO_LOOP_POLICY"]
    check_settings()
