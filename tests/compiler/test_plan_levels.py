"""The plan per level (issue 57): the bytes each rank sends per step within its node and across
nodes (``comm_bytes_per_step_by_level``), by arithmetic over the units' sizes; what a
hierarchical form holds per rank; and a predicted step that prices what crosses nodes at the
cluster's link. 4 ranks as 2 nodes of 2, fp32, no clipping (a norm's all-reduce would add a few
bytes over every rank to each form alike)."""
from __future__ import annotations

from fractions import Fraction

import pytest

from zdsl.check.checker import check_text
from zdsl.driver import compile_schedule
from zdsl.model.units import gpt_units
from zdsl.planner.report import build_plan, render_plan

SHAPE = dict(layers=2, width=32, heads=4, vocab=64, context=8)
MODEL = "model gpt(layers=2, width=32, heads=4, vocab=64, context=8)\ntrain batch=2, precision=fp32\n"
FP32 = 4
FORMS = {"flat": "zero 3", "hpz": "zero 3\nsecondary parameters over node",
         "hsdp": "shard optimizer, gradients, parameters over node"}


def plan(form: str, ranks: str = "4 on cpu, 2 per node", machine: str = ""):
    schedule, _ = check_text(f"{MODEL}ranks {ranks}\n{FORMS[form]}\n{machine}", f"{form}.zs")
    graph = compile_schedule(schedule, gpt_units(**SHAPE))
    return build_plan(graph, schedule)


def full_bytes(p) -> int:
    """Bytes of every unit's (padded) parameters: an all-gather's or reduce-scatter's payload, summed."""
    return sum(u.padded_numel for u in p.graph.units) * FP32


def test_flat_zero3_sends_everything_across_nodes_three_times_the_parameters():
    """Each unit is gathered for its forward and again for its backward (the tied embedding's
    second gather is the head's), and its gradient reduce-scattered: 3 rings over all 4 ranks."""
    p = plan("flat")
    assert p.to_json()["comm_bytes_per_step_by_level"] == {
        "within_node": 0, "across_nodes": round(3 * Fraction(full_bytes(p) * 3, 4))}


def test_hpz_sends_two_thirds_of_flat_zero3_across_nodes():
    """The secondary shard keeps the backward's gathers within the node: across nodes remain the
    forward's gather and the reduce-scatter, exactly 2/3 of flat ZeRO-3's."""
    flat, hpz = plan("flat").to_json(), plan("hpz")
    levels = hpz.to_json()["comm_bytes_per_step_by_level"]
    assert Fraction(levels["across_nodes"], flat["comm_bytes_per_step_by_level"]["across_nodes"]) == Fraction(2, 3)
    assert levels["within_node"] == round(Fraction(full_bytes(hpz), 2))      # one gather, rings of 2


def test_hsdp_sends_one_all_reduce_of_the_node_shard_across_nodes():
    """Gathers and reduce-scatters within the node; across, each unit's gradient shard (half the
    unit: 2 per node) all-reduced over its 2 replicas, a ring's 2 x (2-1)/2 of it."""
    p = plan("hsdp")
    node_shard = sum(u.shard_numel for u in p.graph.units) * FP32
    assert node_shard * 2 == full_bytes(p)
    assert p.to_json()["comm_bytes_per_step_by_level"] == {
        "within_node": round(3 * Fraction(full_bytes(p), 2)), "across_nodes": node_shard}


def test_on_one_node_every_byte_is_within_it():
    p = plan("flat", ranks="4 on cpu")
    assert p.to_json()["comm_bytes_per_step_by_level"] == {"within_node": round(3 * Fraction(full_bytes(p) * 3, 4)),
                                                          "across_nodes": 0}
    assert "hierarchy" not in p.to_json() and "across nodes" not in render_plan(p)


def test_a_replicated_shard_is_larger_and_the_plan_says_so():
    flat, hsdp = plan("flat"), plan("hsdp")
    states = lambda p: sum(p.to_json()["memory"]["device"]["model_states"].values())   # noqa: E731
    assert states(hsdp) == 2 * states(flat)                       # half of each state, not a quarter
    assert hsdp.zero_formula() == {k: 2 * v for k, v in flat.zero_formula().items()}
    assert hsdp.to_json()["hierarchy"] == {"nodes": 2, "per_node": 2, "shard_group": "within:2", "shard_ranks": 2,
                                           "replicas": 2}
    assert "replicated 2x" in render_plan(hsdp)


def test_hpz_keeps_a_secondary_shard_and_the_plan_counts_it():
    p = plan("hpz")
    shape = p.to_json()["hierarchy"]
    assert shape["secondary_group"] == "within:2" and shape["secondary_bytes"] == full_bytes(p) // 2
    assert "secondary parameters within the node" in render_plan(p)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_slower_cluster_link_slows_only_what_crosses_nodes(form):
    """The same link within and across nodes, then a cluster link 100x slower: the step grows by
    at least the across-node bytes at the slower rate over the comm lane's 2 slots, and a form
    that sends less across grows less."""
    same = plan(form, machine="machine cpu(link=1e9, latency=1e-5)").sim.step_s
    slow = plan(form, machine="machine cpu(link=1e9, latency=1e-5, cluster_link=1e7, cluster_latency=1e-5)")
    across = slow.to_json()["comm_bytes_per_step_by_level"]["across_nodes"]
    assert slow.sim.step_s - same >= across * (1 / 1e7 - 1 / 1e9) / 2
    text = render_plan(slow)
    assert "across nodes" in text and "cluster=(1e+07 B/s, 1e-05 s)" in text
    assert "no rate across nodes" in render_plan(plan(form, machine="machine cpu(link=1e9)"))
