"""With the step after the whole backward (clip) and optimizer state on NVMe, the step's optimizer
reads are woven into the backward as far as the host budget holds them until their steps."""
from __future__ import annotations

from pathlib import Path

from zdsl.driver import compile_file
from zdsl.sim.simulate import simulate

ROOT = Path(__file__).parents[2]
GIB = 1 << 30


def compiled(**sets):
    c = compile_file(str(ROOT / "programs" / "capacity.zs"), {"model.layers": "6", **sets}, simulate=False)
    assert c.ok, [d.message for d in c.diagnostics]
    return c.graph


def optimizer_reads_before_the_norm(g) -> int:
    total = next(op.id for op in g.ops if op.kind == "compute.norm" and op.unit is None)
    return sum(1 for op in g.ops[:total] if op.kind == "nvme.read" and any(r.startswith("optim[") for r in op.reads))


def test_a_roomy_budget_reads_every_units_optimizer_state_during_the_backward():
    g = compiled()                                   # memory host 20GiB: all of it fits
    units = sum(1 for b in g.buffers.values() if b.kind == "optim" and b.tier == "nvme")
    assert g.config["read_ahead"] == units == optimizer_reads_before_the_norm(g)
    # each early read waits for no step: only the backward before it on the lane
    steps = {op.id for op in g.ops if op.kind == "compute.step"}
    for op in g.ops:
        if op.kind == "nvme.read" and any(r.startswith("optim[") for r in op.reads):
            assert not steps & set(op.deps)


def test_a_tight_budget_reads_fewer_ahead_and_stays_within_it():
    roomy = compiled()
    g = compiled(memory="host 4GiB")              # the step's peak without reading ahead: 2.4 GiB
    ahead = g.config.get("read_ahead", 0)
    assert 0 < ahead < roomy.config["read_ahead"]
    assert optimizer_reads_before_the_norm(g) == ahead
    assert simulate(g, None).memory.peak("host") <= 4 * GIB
    assert "read_ahead" not in compiled(memory="host 3GiB").config       # no room for one unit


def test_no_budget_no_clip_or_no_nvme_keeps_the_graph():
    for sets in ({"memory": "host 20GiB", "optimizer.clip": "none"}, ):
        assert "read_ahead" not in compiled(**sets).config
