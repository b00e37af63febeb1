"""One profile plans schedules of other shapes (zdsl/sim/rates.py): a unit's compute at its
precision's rate interpolated at its width, NVMe transfers at the rate of as many ranks as the
schedule runs; a profile without those fields plans as before; ``zdsl plan`` says what it lacks."""
from __future__ import annotations

import json
import math

import pytest

from helpers import private_cache

from zdsl.cli import main
from zdsl.driver import compile_file
from zdsl.sim import profile_cache
from zdsl.sim.rates import flops_at
from zdsl.sim.rates import gaps
from zdsl.sim.rates import unit_widths
from zdsl.sim.simulate import rated_durations
from zdsl.sim.simulate import simulate
from zdsl.schedule import MachineProfile

# A profile as calibrate writes it at 2 ranks: each rank's share of the disk, and one rank alone.
SHAPED = MachineProfile.of(name="cpu", flops=4e10, disk_read=1e9, disk_write=2e9, flops_widths=(64.0, 1024.0),
                           flops_fp32=(4e10, 1e11), flops_bf16=(5e10, 4e11), disk_ranks=2,
                           disk_read_alone=2.5e9, disk_write_alone=3.5e9)
PLAIN = MachineProfile.of(name="cpu", flops=4e10, disk_read=1e9, disk_write=2e9)


def schedule(tmp_path, width=256, precision="fp32", ranks=2, nvme=True, machine="", name="s.zs"):
    path = tmp_path / name
    nvme_lines = (f'offload parameters -> nvme("{tmp_path}/swap")\noffload optimizer -> nvme("{tmp_path}/swap")\n'
                  if nvme else "")
    path.write_text(f'schedule s\nmodel gpt(layers=2, width={width}, heads=4, vocab=256, context=32)\n'
                    f'data synthetic(vocab=256, context=32)\ntrain steps=1, batch=4, precision={precision}\n'
                    f'ranks {ranks} on cpu\nzero 3\n{nvme_lines}{machine}')
    return path


def graph_of(path, **sets):
    compiled = compile_file(str(path), sets, simulate=False)
    assert compiled.ok, [d.message for d in compiled.diagnostics]
    return compiled.graph


def seconds(graph, machine, kind):
    """Each op of ``kind``: (its rated seconds, the op)."""
    rated = rated_durations(graph, machine)
    return [(rated[i], op) for i, op in enumerate(graph.ops) if op.kind == kind]


def test_a_profile_without_shape_fields_prices_every_op_as_before(tmp_path):
    """Old caches and a user's machine line: forward and backward at ``flops``, transfers at
    ``disk_read``/``disk_write``, at any precision, width and rank count."""
    for width, precision, ranks in ((64, "fp32", 2), (1024, "bf16", 1), (256, "fp16", 4)):
        graph = graph_of(schedule(tmp_path, width, precision, ranks))
        for kind in ("compute.forward", "compute.backward"):
            for sec, op in seconds(graph, PLAIN, kind):
                assert sec == op.flops / PLAIN.compute.flops
        for sec, op in seconds(graph, PLAIN, "nvme.read"):
            assert sec == op.bytes / PLAIN.disk.read
        for sec, op in seconds(graph, PLAIN, "nvme.write"):
            assert sec == op.bytes / PLAIN.disk.write
        assert gaps(PLAIN, graph) == []


def test_a_machine_statement_without_shape_fields_keeps_the_graph_digest(tmp_path):
    """The shape fields enter the graph's config only where set: a schedule's digest (checked
    between ranks, recorded in checkpoints) is the one it had before they existed."""
    graph = graph_of(schedule(tmp_path, machine="machine cpu(flops=4e10)\n"))
    assert not {"flops_widths", "flops_bf16", "disk_ranks", "disk_read_alone"} & set(graph.config["machine"])
    shaped = graph_of(schedule(tmp_path, machine="machine cpu(flops=4e10, flops_widths=(64, 1024), "
                                                  "flops_fp32=(4e10, 1e11), disk_ranks=2, disk_read_alone=2e9)\n",
                               name="t.zs"))
    assert shaped.config["machine"]["flops_widths"] == [64.0, 1024.0]
    assert MachineProfile.of_config(json.loads(shaped.to_json())["config"]).compute.fp32 == (4e10, 1e11)


def test_compute_is_priced_at_the_schedules_precision(tmp_path):
    for precision, rate in (("fp32", 4e10), ("bf16", 5e10)):
        graph = graph_of(schedule(tmp_path, 64, precision))
        blocks = [(sec, op) for sec, op in seconds(graph, SHAPED, "compute.forward") if op.unit in (1, 2)]
        assert blocks and all(sec == pytest.approx(op.flops / rate) for sec, op in blocks)


def test_a_units_rate_is_interpolated_log_log_at_its_width(tmp_path):
    """Width 256 is halfway (in log) from 64 to 1024: the rate halfway in log, the geometric mean;
    outside the measured widths, the nearest end's."""
    assert flops_at((64.0, 1024.0), (4e10, 1e11), 256.0) == pytest.approx(math.sqrt(4e10 * 1e11))
    assert flops_at((64.0, 1024.0), (4e10, 1e11), 32.0) == 4e10
    assert flops_at((64.0, 1024.0), (4e10, 1e11), 4096.0) == 1e11
    for width, rate in ((256, math.sqrt(4e10 * 1e11)), (2048, 1e11)):
        graph = graph_of(schedule(tmp_path, width))
        assert unit_widths(graph)[1] == pytest.approx(width)          # a block's width, from its flops
        for kind in ("compute.forward", "compute.backward"):
            blocks = [(sec, op) for sec, op in seconds(graph, SHAPED, kind) if op.unit in (1, 2)]
            assert blocks and all(sec == pytest.approx(op.flops / rate) for sec, op in blocks)
    # the wider unit runs nearer the peak: a width-1024 step is priced below 16x a width-256 one's
    narrow, wide = (sum(s for s, _ in seconds(graph_of(schedule(tmp_path, w)), SHAPED, "compute.backward"))
                    for w in (256, 1024))
    assert wide < 16 * narrow * 0.7


@pytest.mark.parametrize("ranks, read, write", [(1, 2.5e9, 3.5e9), (2, 1e9, 2e9), (4, 0.5e9, 1e9)])
def test_nvme_transfers_are_priced_at_the_rate_of_the_schedules_ranks(tmp_path, ranks, read, write):
    """One rank has the disk to itself (the rate measured alone); more share the aggregate the
    profile's two ranks measured (2 x 1 GB/s read), each its part."""
    graph = graph_of(schedule(tmp_path, ranks=ranks))
    for kind, rate in (("nvme.read", read), ("nvme.write", write)):
        transfers = seconds(graph, SHAPED, kind)
        assert transfers and all(sec == pytest.approx(op.bytes / rate) for sec, op in transfers)
    assert gaps(SHAPED, graph) == []


def test_the_one_rank_disk_rate_moves_the_predicted_step(tmp_path):
    graph = graph_of(schedule(tmp_path, width=512, ranks=1))
    shared_only = SHAPED.with_fields(disk_read_alone=0.0, disk_write_alone=0.0)
    assert simulate(graph, SHAPED).lane_busy["nvme"] < 0.6 * simulate(graph, shared_only).lane_busy["nvme"]


def test_plan_says_what_the_profile_lacks_and_what_it_used(tmp_path):
    graph = graph_of(schedule(tmp_path, precision="fp16", ranks=1))
    no_alone = SHAPED.with_fields(disk_read_alone=0.0, disk_write_alone=0.0)
    said = gaps(no_alone, graph)
    assert len(said) == 2
    assert said[0].startswith("the profile has no fp16 compute rate (it has fp32, bf16 by width): used flops=4e+10")
    assert "one-rank disk rate" in said[1] and "each of 2 ranks' share" in said[1]
    fp16 = [(sec, op) for sec, op in seconds(graph, no_alone, "compute.forward") if op.unit == 1]
    assert fp16 and all(sec == op.flops / 4e10 for sec, op in fp16)
    for sec, op in seconds(graph, no_alone, "nvme.read"):
        assert sec == op.bytes / 1e9


def test_zdsl_plan_prints_the_gap_under_its_rates_line(tmp_path, capsys):
    path = schedule(tmp_path, precision="fp16", machine="machine cpu(flops=4e10, flops_widths=(64, 1024), "
                                                         "flops_fp32=(4e10, 1e11))\n")
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.strip().startswith("rates:"))
    assert out[at + 1].strip().startswith("the profile has no fp16 compute rate")


@pytest.mark.parametrize("args, message", [
    ("flops_widths=(64, 1024), flops_bf16=(1e10, 2e10, 3e10)", "flops_bf16 has 3 rate(s) for 2 flops_widths"),
    ("flops_widths=(1024, 64), flops_fp32=(1e10, 2e10)", "flops_widths must increase"),
    ("flops_widths=(64, 0)", "each of flops_widths must be greater than 0"),
    ("disk_ranks=-1", "disk_ranks must be"),
    ("disk_read_alone=-2e9", "disk_read_alone must be"),
    ("flops_widths=(64, 1024), flops_alone_bf16=(1e10, 2e10, 3e10)",
     "flops_alone_bf16 has 3 rate(s) for 2 flops_widths"),
    ("flops_widths=(64, 1024), flops_alone_fp32=(1e10, 0)", "each of flops_alone_fp32 must be greater than 0"),
    ("compute_ranks=-1", "compute_ranks must be"),
    ("compute_ranks=1.5", "compute_ranks"),
])
def test_the_checker_refuses_a_bad_shape_field_at_its_position(tmp_path, capsys, args, message):
    path = schedule(tmp_path, machine=f"machine cpu({args})\n")
    assert main(["check", str(path)]) != 0
    err = capsys.readouterr().err
    assert f"{path}:9:" in err and message in err and "Traceback" not in err


def test_an_older_cached_profile_is_measured_again_once_and_that_is_said(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ZDSL_CALIBRATE", "1")
    private_cache(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    path = profile_cache.profile_path("cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"profile": PLAIN.to_config(), "statement": "machine cpu(...)",
                                "when": "2026-11-25 20:45 UTC"}))             # format 1: no "format" key
    calls = []

    def quick():
        calls.append(1)
        profile_cache.write_profile(MachineProfile.of(name="cpu", flops=1e9, flops_widths=(64.0,),
                                                      flops_fp32=(1e9,)).to_config(), "machine cpu(...)")
    monkeypatch.setattr(profile_cache, "calibrate_in_runtime", quick)
    try:
        for _ in range(2):
            assert main(["plan", str(schedule(tmp_path, nvme=False))]) == 0
        err = capsys.readouterr().err
        assert calls == [1] and err.count("calibrated this machine again") == 1 and "older format" in err
        assert profile_cache.read_profile(path)[0].compute.fp32 == (1e9,)
    finally:
        profile_cache.enable(False)
