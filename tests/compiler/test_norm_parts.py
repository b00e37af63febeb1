"""With sharded gradients each unit's squared gradient norm is its own op, waiting only for that
unit's gradient, so the parts run during the backward; the global norm sums them in unit order."""
from __future__ import annotations

from pathlib import Path

import pytest

from zdsl.driver import compile_file
from zdsl.ir import parse_buffer_name

ROOT = Path(__file__).parents[2]


def graph(program: str, **sets):
    c = compile_file(str(ROOT / "programs" / program), {k.replace("_", "."): v for k, v in sets.items()},
                     simulate=False)
    assert c.ok, [d.message for d in c.diagnostics]
    return c.graph


def producers(g, op):
    """The kinds and units of every op ``op`` waits for, transitively."""
    seen, todo = set(), list(op.deps)
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo += g.ops[d].deps
    return {(g.ops[d].kind, g.ops[d].unit) for d in seen}


@pytest.mark.parametrize("program, sets", [
    ("zero3.zs", {"optimizer_clip": "1.0"}),
    ("zero1.zs", {"optimizer_clip": "1.0"}),
    ("capacity.zs", {"model_layers": "3"}),                 # optimizer on NVMe: the parts on the host lane
])
def test_each_part_waits_only_for_its_own_units_backward(program, sets):
    g = graph(program, **sets)
    norms = [op for op in g.ops if op.kind == "compute.norm"]
    parts = [op for op in norms if op.unit is not None]
    total = [op for op in norms if op.unit is None]
    trained = sorted({op.unit for op in g.ops if op.kind == "compute.backward"})
    assert sorted(op.unit for op in parts) == trained and len(total) == 1
    for op in parts:
        waited = {u for kind, u in producers(g, op) if kind == "compute.backward"}
        assert op.unit in waited and min(waited) == op.unit      # not the units whose backward comes later
        assert [parse_buffer_name(n)[1] for n in op.reads] == [op.unit]
    # summed in unit order: the same float additions as one op over every gradient
    assert [parse_buffer_name(n)[1] for n in total[0].reads] == trained


def test_unsharded_gradients_keep_one_norm_op():
    g = graph("quickstart.zs", zero="0", optimizer_clip="1.0")
    assert [op.unit for op in g.ops if op.kind == "compute.norm"] == [None]
