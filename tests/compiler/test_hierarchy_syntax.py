"""Hierarchical sharding in the language (issue 57): ``ranks N, P per node``, ``shard STATES over
all|node|group(K)``, ``secondary parameters over node``: what each form checks to, what is refused
(positioned, with a fix), ``--set per_node``, and the printer's round trip."""
from __future__ import annotations

import pytest

from zdsl.check.checker import check_text
from zdsl.check.printer import print_schedule
from zdsl.check.printer import without_spans
from zdsl.lang.errors import UsageError
from zdsl.lang.errors import ZsError

MODEL = "model gpt(layers=2, width=32, heads=4, vocab=64, context=8)\n"
STATES3 = "optimizer, gradients, parameters"


def check(text: str, overrides=None):
    schedule, warnings = check_text(MODEL + text, "h.zs", overrides)
    return schedule, [w.message for w in warnings]


def refused(text: str, overrides=None):
    with pytest.raises(ZsError) as info:
        check_text(MODEL + text, "h.zs", overrides)
    return [d for d in info.value.diagnostics if d.is_error]


@pytest.mark.parametrize("text, per_node, stage, over, secondary, shard_group, secondary_group", [
    ("ranks 4 on cpu, 2 per node\nshard optimizer, gradients, parameters over node", 2, 3, "node", None,
     "within:2", None),
    ("ranks 4, 2 per node\nzero 3\nsecondary parameters over node", 2, 3, "all", "node", "all", "within:2"),
    (f"ranks 8, 4 per node\nshard {STATES3} over group(2)", 4, 3, "group(2)", None, "within:2", None),
    (f"ranks 8, 2 per node\nshard {STATES3} over group(4)\nsecondary parameters over node", 2, 3, "group(4)",
     "node", "within:4", "within:2"),
    ("ranks 8, 4 per node\nshard optimizer over node", 4, 1, "node", None, "within:4", None),
    (f"ranks 8, 4 per node\nshard {STATES3} over all", 4, 3, "all", None, "all", None),
    # several statements, each over the one group, are one sharding
    ("ranks 4, 2 per node\nshard parameters over node\nshard optimizer, gradients over node", 2, 3, "node", None,
     "within:2", None),
    # a node of every rank is every rank: the flat group
    ("ranks 4, 4 per node\nshard optimizer over node", 4, 1, "node", None, "all", None),
])
def test_forms(text, per_node, stage, over, secondary, shard_group, secondary_group):
    s, warnings = check(text)
    assert (s.per_node, s.stage, s.secondary) == (per_node, stage, secondary)
    assert all(s.shard_over[state] == over for state in ("optimizer", "gradients", "parameters")[:stage])
    assert (s.shard_group(), s.secondary_group()) == (shard_group, secondary_group)
    assert warnings == []


# text, line:column of the error, what its message says, what its hint says
REFUSALS = [
    ("ranks 6, 4 per node", "2:10", "4 ranks per node do not divide the 6 ranks", "ranks 6, 2 or 3 per node"),
    ("ranks 4, 2 per cpu", "2:16", "per node, not per cpu", "ranks 4, 2 per node"),
    ("ranks 4, 0 per node", "2:10", "ranks per node", None),
    ("ranks 8, 4 per node\nshard optimizer over group(3)", "3:22", "group(3) does not divide the 8 ranks",
     "group(2 or 4)"),
    ("ranks 12, 4 per node\nshard optimizer over group(6)", "3:22", "would straddle nodes of 4 ranks",
     "1, 2, 4, 12"),
    ("ranks 8, 4 per node\nshard optimizer over nodes", "3:22", "unknown shard group 'nodes'", "'node'"),
    ("ranks 8, 4 per node\nshard optimizer over group", "3:22", "group needs its size", "group(8)"),
    ("ranks 8, 4 per node\nshard optimizer over node(2)", "3:22", "node takes no size", "group(2)"),
    ("shard none over node", "2:17", "nothing is sharded", "over node"),
    # parameters over a bigger group than gradients: their shard covers elements never reduced here
    ("ranks 8, 4 per node\nshard optimizer, gradients over node\nshard parameters over all", "4:23",
     "every sharded state must be sharded over one group",
     "over node"),
    ("ranks 8, 4 per node\nshard optimizer over node\nshard gradients, parameters over all", "4:34",
     "covers elements whose gradients it does not hold", "over node"),
    # parameters over a smaller group than the optimizer: an all-gather across replicas after each step
    ("ranks 8, 4 per node\nshard optimizer, gradients over all\nshard parameters over node", "4:23",
     "all-gather after every step, which the compiler does not build", "secondary parameters over node"),
    ("ranks 4, 2 per node\nshard gradients over node\nshard parameters over node", "4:7",
     "ZeRO's order", "zero 3"),
    ("ranks 4, 2 per node\nzero 2\nsecondary parameters over node", "4:1", "needs sharded parameters", "zero 3"),
    ("ranks 8\nzero 3\nsecondary parameters over node", "4:1", "already node-local", "ranks 8, P per node"),
    (f"ranks 8, 4 per node\nshard {STATES3} over node\nsecondary parameters over node", "4:1",
     "within a node of 4 already", "remove `secondary`"),
    (f"ranks 8, 4 per node\nshard {STATES3} over group(2)\nsecondary parameters over node", "4:1",
     "within a node of 4 already", "remove `secondary`"),
    ("ranks 4, 2 per node\nzero 3\nsecondary gradients over node", "4:11", "only parameters have a secondary",
     "secondary parameters over node"),
    ("ranks 4, 2 per node\nzero 3\nsecondary parameters over group(2)", "4:27", "kept within a node",
     "secondary parameters over node"),
    ("ranks 4, 2 per node\nzero 3\nshard optimizer over node", "4:1", "sharding is set twice", "keep one"),
]


@pytest.mark.parametrize("text, at, message, hint", REFUSALS)
def test_refused_forms_are_positioned_with_a_fix(text, at, message, hint):
    errors = refused(text)
    first = errors[0]
    assert f"{first.span.line}:{first.span.column}" == at, (first.message, first.span)
    assert message in first.message
    if hint is not None:
        assert hint in (first.hint or ""), first.hint


def test_warnings_for_forms_that_shard_less_than_written():
    _, warnings = check("ranks 4\nshard optimizer over node")
    assert any("all on one node" in w for w in warnings)
    _, warnings = check("ranks 4, 1 per node\nshard optimizer over node")
    assert any("nothing is sharded" in w for w in warnings)


def test_set_per_node_and_ranks_keep_each_other():
    s, _ = check("ranks 4 on cpu, 2 per node\nzero 3\nsecondary parameters over node",
                 {"ranks": "1024", "per_node": "8"})
    assert (s.ranks, s.per_node, s.device, s.secondary_group()) == (1024, 8, "cpu", "within:8")
    s, _ = check("ranks 4 on cpu\nzero 3\nsecondary parameters over node", {"per_node": "2"})
    assert (s.ranks, s.per_node, s.secondary_group()) == (4, 2, "within:2")
    s, _ = check("zero 3", {"ranks": "64", "per_node": "8", "shard": f"{STATES3} over node"})
    assert (s.shard_group(), s.stage) == ("within:8", 3)
    s, _ = check("ranks 16, 8 per node\nzero 3", {"secondary": "parameters over node"})
    assert s.secondary == "node"
    errors = refused("ranks 6\nzero 1", {"per_node": "4"})
    assert errors[0].span.file == "--set"
    with pytest.raises(UsageError):
        check("zero 1", {"per_node": "x"})


@pytest.mark.parametrize("text", [
    "ranks 4 on cpu, 2 per node\nzero 3\nsecondary parameters over node",
    f"ranks 8 on cpu, 4 per node\nshard {STATES3} over group(2)",
    "ranks 8, 4 per node\nshard optimizer, gradients over node",
    "ranks 4\nzero 2",
])
def test_printer_round_trip(text):
    s, _ = check(text)
    again, _ = check_text(print_schedule(s), "h.zs")
    a, b = without_spans(s), without_spans(again)
    a.name = b.name
    assert a == b


def test_the_config_carries_the_hierarchy():
    """The runtime reads the node layout from the graph's config: flat defaults, or as written."""
    s, _ = check("ranks 4 on cpu\nzero 3")
    config = s.to_config()
    assert (config["per_node"], config["secondary"]) == (None, None)
    assert config["shard_over"] == dict.fromkeys(("optimizer", "gradients", "parameters"), "all")
    s, _ = check("ranks 4 on cpu, 2 per node\nzero 3\nsecondary parameters over node")
    config = s.to_config()
    assert (config["per_node"], config["secondary"]) == (2, "node")
