"""The gloo collectives may consume a reduce-scatter's input: no graph reads it again.

``runtime/collectives.reduce_scatter`` reduces the whole gradient in place on
gloo (an all-reduce, or one reduce per owner) and keeps this rank's slice, so
the full gradient part it was given is clobbered. That is only correct if no
op of the graph reads that part again before a later op rewrites it (the next
micro-batch's backward). Checked here on every program, stage, accumulation
and clipping the runtime runs.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from zdsl.driver import compile_file
from zdsl.driver import memo_units_for

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted(p for p in (ROOT / "programs").glob("*.zs") if p.stem != "capacity")


def _ancestors(ops, i: int) -> set[int]:
    seen: set[int] = set()
    stack = list(ops[i].deps)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(ops[x].deps)
    return seen


def readers_after_reduce_scatter(graph) -> list[tuple[int, int]]:
    """(reduce-scatter, op) pairs where op may read the reduce-scatter's input after it."""
    ops = graph.ops
    found = []
    for o in ops:
        if o.kind != "comm.reduce_scatter":
            continue
        src = next(n for n in o.reads if n != "token")
        before = _ancestors(ops, o.id)
        for p in ops:
            if p.id == o.id or p.id in before or p.kind == "mem.free" or src not in p.reads:
                continue
            if p.kind == o.kind and p.part != o.part:
                continue                   # another part of the same buffer: untouched by o
            rewritten = any(w not in before and w != o.id and src in ops[w].writes for w in _ancestors(ops, p.id))
            if not rewritten:
                found.append((o.id, p.id))
    return found


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.stem)
def test_no_op_reads_a_gradient_after_it_was_reduce_scattered(program):
    compiled = 0
    units_for = memo_units_for()     # the model is sized once: none of the settings varied changes it
    for zero, accumulate, clip in itertools.product((1, 2, 3), (1, 2), (None, "1.0")):
        sets = {"zero": str(zero), "accumulate": str(accumulate)}
        if clip:
            sets["clip"] = clip
        c = compile_file(str(program), sets, units_for, simulate=False)
        if not c.ok:
            continue
        compiled += 1
        assert readers_after_reduce_scatter(c.graph) == [], (program.stem, sets)
    assert compiled, f"{program.stem}: no variant compiled"


def test_the_check_finds_a_reader_after_the_reduce_scatter():
    c = compile_file(str(ROOT / "programs" / "zero2.zs"), {}, simulate=False)
    graph = c.graph
    rs = next(o for o in graph.ops if o.kind == "comm.reduce_scatter")
    later = next(o for o in graph.ops if o.kind == "compute.step" and rs.id in _ancestors(graph.ops, o.id))
    later.reads = [*later.reads, next(n for n in rs.reads if n != "token")]
    assert readers_after_reduce_scatter(graph) != []
