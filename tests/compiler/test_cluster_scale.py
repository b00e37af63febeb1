"""Cluster scale without a cluster (issue 57): the shipped DGX profiles read as their sources
say, and a schedule of a 7B Llama-shaped GPT compiles to the same graph at 64, 1024 and 8192
ranks (the compiler is rank-free: the graph is one rank's), which zdsl plan prices per level."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zdsl.check.checker import load_schedule
from zdsl.cli import main

PROGRAMS = Path(__file__).resolve().parents[2] / "programs"
# Llama 2 7B's layers, width, heads, vocabulary and context, as the built-in GPT
LLAMA_7B = "model gpt(layers=32, width=4096, heads=32, vocab=32000, context=4096)\n"


@pytest.mark.parametrize("name, flops, hbm, nvlink, infiniband, pcie", [
    ("dgx-a100", 3.12e14, 2.039e12, 3.0e11, 2.5e10, 3.2e10),
    ("dgx-h100", 9.89e14, 3.35e12, 4.5e11, 5.0e10, 6.4e10),
])
def test_the_dgx_profiles_read_as_their_sources(tmp_path, name, flops, hbm, nvlink, infiniband, pcie):
    path = tmp_path / "s.zs"
    path.write_text(f'schedule s\n{LLAMA_7B}include "{PROGRAMS / "machines" / name}.zs"\n')
    schedule, _ = load_schedule(str(path))
    m = schedule.machine
    assert (m.name, m.compute.flops, m.compute.table("bf16"), m.compute.memory_bandwidth) == \
        ("cuda", flops, (flops,), hbm)
    assert (m.collectives.node.bandwidth, m.collectives.cluster_bandwidth, m.copies.pcie_bandwidth) == \
        (nvlink, infiniband, pcie)
    assert m.collectives.level(True).bandwidth == infiniband and m.collectives.slots == 1
    assert schedule.memory == {"device": 80 * 10**9}


def plan_json(tmp_path, capsys, ranks: int, form: str) -> dict:
    path = tmp_path / "llama.zs"
    path.write_text(f'schedule llama\n{LLAMA_7B}train batch=1, precision=bf16\nranks 64 on cuda, 8 per node\n'
                    f'{form}\nrecompute blocks\ninclude "{PROGRAMS / "machines" / "dgx-h100.zs"}"\n')
    assert main(["plan", str(path), "--json", "--set", f"ranks={ranks}", "--set", "per_node=8"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("form", ["zero 3", "shard optimizer, gradients, parameters over node",
                                  "zero 3\nsecondary parameters over node"])
def test_a_7b_model_plans_alike_on_64_1024_and_8192_ranks(tmp_path, capsys, form):
    plans = {ranks: plan_json(tmp_path, capsys, ranks, form) for ranks in (64, 1024, 8192)}
    assert len({p["ops"] for p in plans.values()}) == 1                  # one rank's graph, any world
    for ranks, p in plans.items():
        assert p["ranks"] == ranks and p["hierarchy"]["nodes"] == ranks // 8
        levels = p["comm_bytes_per_step_by_level"]
        assert levels["across_nodes"] > 0 and p["predicted_step_s"] > 0
        if form.startswith("shard"):          # HSDP: the same node shard whatever the world
            assert p["memory"]["device"]["model_states"] == plans[64]["memory"]["device"]["model_states"]
