"""``link node=(RATE, LATENCY), cluster=(RATE, LATENCY)`` (issue 57): the collectives' link per
level, the same profile fields as the ``machine`` keywords ``link=, latency=, cluster_link=,
cluster_latency=``. It parses, checks, prints back, and plans as the keywords do; a level given
twice, an unknown level, a missing latency and a rate of 0 are errors where they are written; and
a schedule with only a ``link`` is planned with this machine's calibrated rates and its links."""
from __future__ import annotations

from pathlib import Path

import pytest

from zdsl.check.checker import check_text
from zdsl.check.printer import print_schedule, without_spans
from zdsl.driver import compile_schedule
from zdsl.lang.errors import ZsError
from zdsl.machine_profile import MachineProfile
from zdsl.model.units import gpt_units
from zdsl.sim import profile_cache
from zdsl.sim.simulate import simulate

MACHINES = Path(__file__).resolve().parents[2] / "programs" / "machines"
SHAPE = dict(layers=2, width=64, heads=4, vocab=128, context=16)
HEAD = ("model gpt(layers=2, width=64, heads=4, vocab=128, context=16)\ntrain batch=2, precision=fp32\n"
        "ranks 8 on cuda, 4 per node\nshard optimizer, gradients, parameters over node\n")
KEYWORDS = "machine cuda(flops=1e14, link=3e11, latency=1e-5, cluster_link=2.5e10, cluster_latency=2e-5)\n"
STATEMENT = "machine cuda(flops=1e14)\nlink node=(3e11, 1e-5),\n     cluster=(2.5e10, 2e-5)\n"


def checked(text: str, file: str = "s.zs"):
    schedule, _ = check_text(HEAD + text, file)
    return schedule


def errors(text: str) -> list:
    with pytest.raises(ZsError) as info:
        check_text(HEAD + text, "bad.zs")
    return [d for d in info.value.diagnostics if d.is_error]


def test_the_link_statement_sets_what_the_machine_keywords_do():
    by_statement, by_keywords = checked(STATEMENT), checked(KEYWORDS)
    assert by_statement.machine == by_keywords.machine
    collectives = by_statement.machine.collectives
    assert (collectives.node.bandwidth, collectives.node.latency) == (3e11, 1e-5)
    assert (collectives.cluster_bandwidth, collectives.cluster_latency) == (2.5e10, 2e-5)


def test_a_plan_with_the_link_statement_equals_the_keywords_plan():
    units = gpt_units(**SHAPE)
    plans = []
    for text in (STATEMENT, KEYWORDS):
        schedule = checked(text)
        graph = compile_schedule(schedule, units)
        plans.append((graph.config["machine"], simulate(graph, schedule.machine).step_s))
    assert plans[0] == plans[1]
    assert plans[0][1] > 0


def test_the_shipped_machine_files_plan_as_their_keyword_form_did():
    """programs/machines/*.zs give their links with the statement; the same figures as keywords
    (the files' form before) make the same profile."""
    for name, node, cluster in (("dgx-a100.zs", (3e11, 1e-5), (2.5e10, 2e-5)),
                                ("dgx-h100.zs", (4.5e11, 1e-5), (5e10, 2e-5))):
        text = (MACHINES / name).read_text()
        assert "\nlink node=(" in text and "cluster_link=" not in text
        shipped = checked(f'include "{MACHINES / name}"\n')
        keywords = text[:text.index("\nlink node=")].replace(
            "    pcie=", f"    link={node[0]}, latency={node[1]}, cluster_link={cluster[0]}, "
                        f"cluster_latency={cluster[1]},\n    pcie=")
        assert shipped.machine == checked(keywords + "\nmemory device 80GB\n").machine


@pytest.mark.parametrize("text", [STATEMENT, "link cluster=(5e7, 1e-4)\n", "machine cuda\nlink node=(1e9, 2e-5)\n",
                                  "machine cuda(flops=1e14, cluster_link=2e10)\n"])
def test_the_printer_prints_the_link_statement_back(text):
    schedule = checked(text)
    printed = print_schedule(schedule)
    assert ("\nlink      " in printed) == ("link " in text)
    assert without_spans(checked_text(printed)) == without_spans(schedule)


def checked_text(text: str):
    schedule, _ = check_text(text, "printed.zs")
    return schedule


def test_only_a_link_keeps_the_devices_rates_and_the_calibrated_ones(monkeypatch):
    """A CUDA schedule with no machine statement: CUDA's defaults with the links. Planned where a
    calibrated profile is used, that profile with the links (calibrate measures one machine)."""
    schedule = checked("link cluster=(5e9, 3e-5)\n")
    cuda = checked("")
    assert schedule.machine == cuda.machine.with_fields(cluster_bandwidth=5e9, cluster_latency=3e-5)
    measured = MachineProfile.of(name="cuda", flops=7e13, link_bandwidth=2e11, link_latency=4e-6)
    monkeypatch.setattr(profile_cache, "_enabled", True)
    monkeypatch.setattr(profile_cache, "_choice", profile_cache.Choice(measured, "rates: measured", None))
    planned = profile_cache.calibrated_for(schedule)
    assert planned == measured.with_fields(cluster_bandwidth=5e9, cluster_latency=3e-5)
    assert profile_cache.calibrated_for(cuda) == measured


@pytest.mark.parametrize("text, line, column, words, hint", [
    ("link rack=(1e9, 1e-5)\n", 5, 6, "no level 'rack'", "'node', 'cluster'"),
    ("link clustr=(1e9, 1e-5)\n", 5, 6, "no level 'clustr'", "did you mean 'cluster'?"),
    ("link node=3e11\n", 5, 11, "link node needs a latency too", "node=(3e11, 1e-5)"),
    ("link cluster=(1e9)\n", 5, 14, "link cluster needs a latency too", "cluster=(1e9, 1e-5)"),
    ("link node=(0, 1e-5)\n", 5, 12, "link node's rate must be greater than 0", "node=(2.5e10, 2e-5)"),
    ("link cluster=(1e9, -2e-5)\n", 5, 20, "link cluster's latency must be greater than 0", "cluster=("),
    ("link (1e9, 1e-5)\n", 5, 6, "link takes LEVEL=(RATE, LATENCY)", "link node=("),
])
def test_a_bad_link_is_an_error_where_it_is_written(text, line, column, words, hint):
    (error,) = errors(text)
    assert (error.span.file, error.span.line, error.span.column) == ("bad.zs", line, column)
    assert words in error.message and hint in error.hint, (error.message, error.hint)


def test_a_level_given_by_the_machine_keywords_and_the_link_statement_names_both():
    (error,) = errors("machine cuda(flops=1e14, cluster_latency=2e-5)\nlink node=(3e11, 1e-5), cluster=(2e10, 2e-5)\n")
    assert (error.span.line, error.span.column) == (6, 25)                   # the link statement's cluster
    assert "cluster link is given twice" in error.message and "bad.zs:5:26" in error.message
    assert "cluster_latency" in error.message and "link cluster=(RATE, LATENCY)" in error.hint


def test_a_level_given_by_two_link_statements_names_both():
    (error,) = errors("link node=(3e11, 1e-5)\nlink cluster=(2e10, 2e-5)\nlink node=(2e11, 1e-5)\n")
    assert (error.span.line, error.span.column) == (7, 6)
    assert "node link is given twice" in error.message and "bad.zs:5:6" in error.message


def test_set_link_replaces_only_the_levels_it_names():
    """``--set link="cluster=(...)"`` on a schedule whose links come from an included machine file:
    the cluster's rate is the override's, the node's the file's."""
    schedule, _ = check_text(HEAD + STATEMENT, "s.zs", overrides={"link": "cluster=(1e10, 5e-5)"})
    collectives = schedule.machine.collectives
    assert (collectives.node.bandwidth, collectives.node.latency) == (3e11, 1e-5)
    assert (collectives.cluster_bandwidth, collectives.cluster_latency) == (1e10, 5e-5)
    with pytest.raises(ZsError) as info:
        check_text(HEAD + STATEMENT, "s.zs", overrides={"link": "rack=(1e10, 5e-5)"})
    (error,) = [d for d in info.value.diagnostics if d.is_error]
    assert error.span.file == "--set" and "no level 'rack'" in error.message
