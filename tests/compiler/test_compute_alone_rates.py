"""A schedule of fewer ranks than the profile was measured by has more cores each: its compute is
priced at the tables one rank measured alone with every core (``flops_alone_*``,
zdsl/sim/rates.compute_tables); as many ranks keep the shared tables; a profile without
them plans as before."""
from __future__ import annotations

import math

import pytest

from tests.compiler.test_rates_by_shape import graph_of
from tests.compiler.test_rates_by_shape import schedule
from tests.compiler.test_rates_by_shape import seconds
from zdsl.sim.rates import for_graph
from zdsl.sim.rates import gaps
from zdsl.sim.simulate import simulate
from zdsl.schedule import MachineProfile

# As calibrate writes it on a 2-core node at 2 ranks: each rank's tables on one core, and rank 0's
# alone on both
MEASURED_AT_TWO = MachineProfile.of(name="cpu", flops=4e10, cores=1.0, flops_widths=(64.0, 1024.0),
                                    flops_fp32=(4e10, 1e11), flops_bf16=(5e10, 4e11), compute_ranks=2,
                                    flops_alone_fp32=(6e10, 1.8e11), flops_alone_bf16=(7e10, 6e11))


def block_rates(graph, machine, kind="compute.forward") -> list[float]:
    return [op.flops / sec for sec, op in seconds(graph, machine, kind) if op.unit in (1, 2)]


@pytest.mark.parametrize("precision, shared, alone", [("fp32", 4e10, 6e10), ("bf16", 5e10, 7e10)])
def test_a_one_rank_schedule_is_priced_at_the_table_measured_alone(tmp_path, precision, shared, alone):
    one = graph_of(schedule(tmp_path, 64, precision, ranks=1, nvme=False))
    two = graph_of(schedule(tmp_path, 64, precision, ranks=2, nvme=False, name="t.zs"))
    for kind in ("compute.forward", "compute.backward"):
        assert block_rates(one, MEASURED_AT_TWO, kind) == pytest.approx([alone] * 2)
        assert block_rates(two, MEASURED_AT_TWO, kind) == pytest.approx([shared] * 2)
    assert gaps(MEASURED_AT_TWO, one) == [] and gaps(MEASURED_AT_TWO, two) == []


def test_the_alone_table_is_interpolated_at_the_units_width_as_the_shared_one(tmp_path):
    one = graph_of(schedule(tmp_path, 256, "bf16", ranks=1, nvme=False))
    assert block_rates(one, MEASURED_AT_TWO) == pytest.approx([math.sqrt(7e10 * 6e11)] * 2)


def test_between_the_ranks_measured_and_one_the_rate_is_log_log_in_cores_per_rank(tmp_path):
    """A profile measured by 4 ranks (a core each of 4): 2 ranks have 2 cores each, halfway in log
    from the shared table's 1 to the alone table's 4; 4 and 8 ranks keep the shared table."""
    at_four = MEASURED_AT_TWO.with_fields(compute_ranks=4)
    for ranks, rate in ((1, 6e10), (2, math.sqrt(4e10 * 6e10)), (4, 4e10), (8, 4e10)):
        graph = graph_of(schedule(tmp_path, 64, ranks=ranks, nvme=False, name=f"r{ranks}.zs"))
        assert block_rates(graph, at_four) == pytest.approx([rate] * 2)


def test_resolving_the_profile_for_its_graph_again_changes_nothing(tmp_path):
    one = graph_of(schedule(tmp_path, 64, ranks=1, nvme=False))
    resolved = for_graph(MEASURED_AT_TWO, one)
    assert resolved.compute.fp32 == (6e10, 1.8e11) and for_graph(resolved, one) == resolved


def test_the_alone_table_moves_a_one_rank_step_and_not_a_two_rank_one(tmp_path):
    one = graph_of(schedule(tmp_path, 512, "bf16", ranks=1, nvme=False))
    two = graph_of(schedule(tmp_path, 512, "bf16", ranks=2, nvme=False, name="t.zs"))
    without = MEASURED_AT_TWO.with_fields(flops_alone_fp32=(), flops_alone_bf16=())
    assert simulate(one, MEASURED_AT_TWO).step_s < 0.9 * simulate(one, without).step_s
    assert simulate(two, MEASURED_AT_TWO).step_s == simulate(two, without).step_s


def test_a_profile_without_the_alone_tables_plans_as_before_and_plan_says_so(tmp_path):
    one = graph_of(schedule(tmp_path, 64, "bf16", ranks=1, nvme=False))
    without = MEASURED_AT_TWO.with_fields(flops_alone_fp32=(), flops_alone_bf16=())
    unknown = without.with_fields(compute_ranks=0)
    assert block_rates(one, without) == block_rates(one, unknown) == pytest.approx([5e10] * 2)
    assert simulate(one, without).step_s == simulate(one, unknown).step_s
    said = gaps(without, one)
    assert len(said) == 1 and said[0].startswith("the profile has no bf16 compute rate of one rank alone "
                                                 "(flops_alone_bf16): used each of 2 ranks' rate")
    assert gaps(unknown, one) == []


def test_a_machine_statement_without_the_alone_fields_keeps_the_graph_digest(tmp_path):
    plain = graph_of(schedule(tmp_path, machine="machine cpu(flops=4e10)\n", nvme=False))
    assert not {"compute_ranks", "flops_alone_fp32", "flops_alone_bf16"} & set(plain.config["machine"])
    shaped = graph_of(schedule(tmp_path, nvme=False, name="t.zs", machine=(
        "machine cpu(flops=4e10, flops_widths=(64, 1024), flops_fp32=(4e10, 1e11), compute_ranks=2, "
        "flops_alone_fp32=(6e10, 1.8e11))\n")))
    assert shaped.config["machine"]["flops_alone_fp32"] == [6e10, 1.8e11]
    assert shaped.config["machine"]["compute_ranks"] == 2
    assert MachineProfile.of_config(shaped.config).compute.alone_fp32 == (6e10, 1.8e11)
