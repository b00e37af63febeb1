"""Host residency of NVMe state (zdsl/compile/residency.py): Belady's choice under the host budget.

The rule on hand-made gap sequences (where it beats a recency cache), then on compiled graphs:
never worse than LRU on the same sequence, within the budget by the verifier's own check, and no
budget (or no room) gives exactly the graph of today's lowering.
"""
from __future__ import annotations

import random

import pytest

from zdsl.compile import residency
from zdsl.compile.lower import lower_policies
from zdsl.compile.residency import Gap
from zdsl.compile.residency import Room
from zdsl.compile.step_graph import build_step
from zdsl.model.units import gpt_units
from zdsl.compile.verify import verify
from zdsl.driver import compile_schedule
from zdsl.sim.simulate import simulate
from zdsl.schedule import OptimizerSpec
from zdsl.schedule import Placement
from zdsl.schedule import Schedule
from zdsl.schedule import TrainSpec

UNITS = gpt_units(layers=6, width=64, heads=4, vocab=64, context=16)
MiB = 1 << 20


def schedule(budget: int | None = None, clip=None, accumulate: int = 1, optimizer: str = "nvme",
             prefetch: int = 1) -> Schedule:
    nvme = Placement("nvme", paths=("/tmp/zdsl-residency",))
    s = Schedule(name="t", file="t.zs", ranks=1, stage=3, prefetch=prefetch,
                 train=TrainSpec(batch=2, accumulate=accumulate, precision="bf16"),
                 optimizer=OptimizerSpec(clip=clip),
                 placement={"parameters": nvme, "optimizer": Placement(optimizer, paths=nvme.paths)})
    if budget is not None:
        s.memory = {"host": budget}
    return s


def today(s: Schedule):
    """The graph without residency: the builder alone."""
    return build_step(s, UNITS, lower_policies(s, UNITS)).graph


def nvme_bytes(graph, kind: str) -> int:
    return sum(op.bytes for op in graph.ops if op.kind == kind)


def host_peak(s: Schedule) -> int:
    return simulate(today(s), s.machine).memory.peak("host")


def room(free: list[int], gaps: list[Gap]) -> Room:
    """A room of ``free[t]`` bytes over [t, t+1), for t = 0, 1, ..."""
    times = list(range(len(free)))
    return Room(times, [-f for f in free], 0, 0, gaps)


# -- the rule -----------------------------------------------------------------------------------------

def test_belady_evicts_the_copy_used_furthest_ahead():
    # room for one copy: a and b overlap; b is read again first, so b stays and a goes; c follows b
    a, b, c = (Gap("a@host", 0, 10, 0, 6, True), Gap("b@host", 0, 10, 1, 3, True),
               Gap("c@host", 0, 10, 4, 5, True))
    held = residency.belady([a, b, c], room([10] * 8, [a, b, c]))
    assert held == [b, c]


def test_belady_keeps_what_a_recency_cache_loses_to_a_dead_copy():
    # `dead` is freed after `a` and never read back (the step overwrites it): LRU keeps the newer
    # dead copy and evicts `a` before its reread; Belady never holds a copy with no reread
    a, dead = Gap("a@host", 0, 10, 0, 5, True), Gap("d@host", 0, 10, 1, 8, False)
    r = room([10] * 8, [a, dead])
    assert residency.belady([a, dead], r) == [a]
    assert residency.lru([a, dead], r) == []


def test_room_that_varies_over_the_step():
    # the room drops to 5 bytes at t=3: a 10-byte copy spanning it cannot stay, a short one can
    long, short = Gap("l@host", 0, 10, 0, 5, True), Gap("s@host", 0, 10, 0, 2, True)
    assert residency.belady([long, short], room([20, 20, 20, 5, 20, 20], [long, short])) == [short]


def test_a_free_the_builder_did_not_issue_is_never_kept():
    g = Gap("a@host", -1, 10, 0, 5, True)
    assert residency.belady([g], room([100] * 6, [g])) == []


@pytest.mark.parametrize("seed", range(20))
def test_never_worse_than_lru_on_equal_copies_in_a_constant_room(seed):
    # where Belady's rule is optimal (equal sizes, constant room) it is never beaten by LRU
    rng = random.Random(seed)
    gaps = []
    for k in range(30):
        start = rng.randrange(0, 40)
        gaps.append(Gap(f"g{k}@host", 0, 1, start, start + rng.randrange(1, 15), rng.random() < 0.7))
    r = room([rng.randrange(1, 5)] * 60, gaps)
    r.free = [r.free[0]] * len(r.free)
    held = residency.belady(gaps, r)
    assert len(held) >= len(residency.lru(gaps, r))
    for s in range(len(r.points)):          # and within the room everywhere
        assert sum(g.bytes for g in held if s in r.span(g)) <= r.free[s]


# -- compiled graphs ------------------------------------------------------------------------------------

def test_no_budget_is_todays_graph():
    s = schedule()
    assert compile_schedule(s, UNITS).to_json() == today(s).to_json()


def test_no_room_is_todays_ops():
    s = schedule()
    states = simulate(today(s), s.machine).memory.tiers["host"].model_states
    s.memory = {"host": states}       # the host model states alone fill it (the verifier reports that)
    graph, base = compile_schedule(s, UNITS), today(s)
    assert graph.config["residency"]["kept"] == 0
    assert [op.__dict__ for op in graph.ops] == [op.__dict__ for op in base.ops]


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("extra", [0.0, 0.1, 0.25, 0.5, 1.0])
def test_budgeted_graph_fits_and_saves_reads(clip, extra):
    base = schedule(clip=clip)
    params = sum(b.bytes for b in today(base).buffers.values() if b.name.startswith("param_shard") and b.tier == "nvme")
    s = schedule(budget=int(host_peak(base) + extra * params), clip=clip)
    graph = compile_schedule(s, UNITS)
    assert not [d for d in verify(graph, s) if d.severity == "error"]
    assert simulate(graph, s.machine).memory.peak("host") <= s.memory["host"]
    report = graph.config["residency"]
    saved = nvme_bytes(today(base), "nvme.read") - nvme_bytes(graph, "nvme.read")
    assert saved >= report["lru_saved_bytes"]
    assert saved == report["saved_bytes"] + report["held_read_bytes"]
    written = nvme_bytes(today(base), "nvme.write") - nvme_bytes(graph, "nvme.write")
    assert written == report["held_saved_bytes"] - report["held_read_bytes"]   # only what is held is not written
    held = {name.replace("@nvme", "@host") for name in report["held"]}
    assert all(graph.buffers[name].persistent for name in held)
    if extra > 0:           # room at every moment: the state the next step uses first is held
        assert "param_shard[0]@nvme" in report["held"]
    if extra >= 1.0:        # room for every parameter shard: each is held, or read once per step
        param_reads = sum(op.bytes for op in graph.ops if op.kind == "nvme.read" and "param_shard" in op.writes[0])
        held_params = sum(graph.buffers[name].bytes for name in held if name.startswith("param_shard"))
        assert param_reads == params - held_params


def test_belady_beats_lru_where_the_step_frees_optimizer_copies_mid_backward():
    # without clipping each unit steps inside the backward: its optimizer copy, freed there and
    # not read again this step, pushes the turn-around units' parameters out of an LRU cache
    base = schedule()
    params = sum(b.bytes for b in today(base).buffers.values() if b.name.startswith("param_shard") and b.tier == "nvme")
    graph = compile_schedule(schedule(budget=int(host_peak(base) + 0.4 * params)), UNITS)
    saved = nvme_bytes(today(base), "nvme.read") - nvme_bytes(graph, "nvme.read")
    assert saved > graph.config["residency"]["lru_saved_bytes"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_each_kept_copy_drops_one_read_and_one_free(accumulate):
    # a budget of the unbudgeted peak: no room at every moment (nothing held through the step),
    # room between the peaks for some re-reads
    base = schedule(accumulate=accumulate)
    s = schedule(budget=host_peak(base), accumulate=accumulate)
    graph, before = compile_schedule(s, UNITS), today(base)
    assert graph.config["residency"]["held"] == []

    def count(g, kind, name):
        return sum(1 for op in g.ops if op.kind == kind and name in op.writes)

    dropped = 0
    for u in range(len(UNITS)):
        host = f"param_shard[{u}]@host"
        reads = count(before, "nvme.read", host) - count(graph, "nvme.read", host)
        assert reads == count(before, "mem.free", host) - count(graph, "mem.free", host) >= 0
        assert count(graph, "nvme.read", host) >= 1          # read at least once per step: nothing is held
        dropped += reads
    assert dropped == graph.config["residency"]["kept"] > 0
    # nothing held: Belady and the LRU cache share the same room within the step
    assert graph.config["residency"]["saved_bytes"] >= graph.config["residency"]["lru_saved_bytes"]
    assert not [d for d in verify(graph, s) if d.severity == "error"]


def test_optimizer_on_host_keeps_parameters_only():
    s = schedule(budget=host_peak(schedule(optimizer="cpu")), optimizer="cpu")
    report = compile_schedule(s, UNITS).config["residency"]
    assert report["kept"] and all(name.startswith("param_shard") for name in report["buffers"])


def test_deterministic():
    s = schedule(budget=int(host_peak(schedule()) + 2 * MiB))
    assert compile_schedule(s, UNITS).to_json() == compile_schedule(s, UNITS).to_json()


# -- the plan ---------------------------------------------------------------------------------------------

def test_plan_shows_bytes_per_tier_against_the_minimum_and_the_lru_comparison():
    from zdsl.planner.report import build_plan
    from zdsl.planner.report import render_plan

    base = schedule()
    s = schedule(budget=int(host_peak(base) + 2 * MiB))
    graph = compile_schedule(s, UNITS)
    plan = build_plan(graph, s)
    out = plan.to_json()
    moved = out["moved_bytes_per_step"]
    placed = today(base).buffers.values()   # the minimum counts held state where the schedule put it
    params = sum(b.bytes for b in placed if b.kind == "param_shard" and b.tier == "nvme")
    optim = sum(b.bytes for b in placed if b.kind == "optim" and b.tier == "nvme")
    assert moved["nvme -> host"] == {"bytes": nvme_bytes(graph, "nvme.read"), "minimum": 2 * params + optim}
    assert moved["host -> nvme"] == {"bytes": nvme_bytes(graph, "nvme.write"), "minimum": params + optim}
    r = out["residency"]
    assert r["saved_bytes"] + r["held_read_bytes"] == \
        nvme_bytes(today(base), "nvme.read") - moved["nvme -> host"]["bytes"] > 0
    text = render_plan(plan, width=200)
    assert "ZeRO-Infinity minimum" in text and "an LRU cache of the same room" in text
    assert "held on the host through the whole step: parameters of unit" in text


def test_plan_without_nvme_has_no_residency_line():
    from zdsl.planner.report import build_plan
    from zdsl.planner.report import render_plan

    s = schedule(optimizer="cpu")
    s.placement["parameters"] = Placement("cpu")
    s.memory = {"host": 1 << 40}
    plan = build_plan(compile_schedule(s, UNITS), s)
    assert "residency" not in plan.to_json()
    assert "host residency" not in render_plan(plan, width=200)


@pytest.mark.parametrize("prefetch", [2, 3])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_deeper_prefetch_keeps_every_shard_and_verifies(prefetch, clip):
    s = schedule(budget=host_peak(schedule(prefetch=prefetch, clip=clip)), prefetch=prefetch, clip=clip)
    graph = compile_schedule(s, UNITS)
    assert not [d for d in verify(graph, s) if d.severity == "error"]
    report = graph.config["residency"]
    assert report["kept"] > 0 and report["held"] == []
    assert report["saved_bytes"] == nvme_bytes(today(schedule(prefetch=prefetch, clip=clip)), "nvme.read") \
        - nvme_bytes(graph, "nvme.read")


# -- held through the whole step ----------------------------------------------------------------------------

def test_room_for_everything_holds_every_state_and_moves_nothing():
    s = schedule(budget=1 << 40)
    graph = compile_schedule(s, UNITS)
    assert not [d for d in verify(graph, s) if d.severity == "error"]
    assert not [op for op in graph.ops if op.kind.startswith("nvme.")]
    report = graph.config["residency"]
    assert report["held_saved_bytes"] == nvme_bytes(today(schedule()), "nvme.read") + \
        nvme_bytes(today(schedule()), "nvme.write")


def test_held_in_beladys_order_at_the_step_boundary():
    # room at every moment for one and a half block shards: the units the next step reads first
    # (the small embedding, then block 1), no further block; what still fits is the tiny last
    # unit's shard and state, not the blocks' optimizer states, read only at the step
    base = schedule()
    shard = today(base).buffers["param_shard[1]@nvme"].bytes
    graph = compile_schedule(schedule(budget=host_peak(base) + shard + shard // 2), UNITS)
    held = graph.config["residency"]["held"]
    assert held == ["param_shard[0]@nvme", "param_shard[1]@nvme", "param_shard[7]@nvme", "optim[7]@nvme"]
    assert not [op for op in graph.ops if op.kind == "nvme.read" and op.writes == ["param_shard[0]@host"]]
