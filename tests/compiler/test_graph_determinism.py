"""Every rank compiles the schedule itself, so the graph must not depend on anything but the schedule.

Python randomises string hashing per process: a set iterated during lowering
would give ranks different graphs (the runtime's graph-hash agreement then
stops the run). Compile every program under different hash seeds and compare.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # three processes compiling every program at once

PROGRAMS = sorted(p for p in (Path(__file__).parents[2] / "programs").glob("*.zs") if p.stem != "user_model")

SCRIPT = """
import sys
from zdsl.driver import compile_file
for path in sys.argv[1:]:
    c = compile_file(path, {"steps": "3", "accumulate": "2"}, simulate=False)
    print(path, c.graph.digest() if c.graph is not None else c.diagnostics)
"""


def digests(seeds: list[int]) -> list[str]:
    """Every program's digest, compiled in one process per hash seed (the processes at once)."""
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, *map(str, PROGRAMS)],
                              env=dict(os.environ, PYTHONHASHSEED=str(seed)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in seeds]
    outs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err
    return [out for out, _ in outs]


def test_graph_is_the_same_under_any_hash_seed():
    assert PROGRAMS
    first, *others = digests([1, 2, 3])
    assert "[" not in first, first        # every program compiled
    assert others == [first, first]
