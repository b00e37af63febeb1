"""ZeRO's Table 2 and ZeRO-Offload's headline, reproduced by the planner's memory model
(zdsl/planner/state_fit.py over compiled graphs).

Assumptions, as the papers count: model states only (no activations, no working buffers), mixed
precision with Adam at 16 bytes a parameter (fp16 parameters 2, fp16 gradients 2, fp32 master,
momentum and variance 12), model parallelism 1, GB = 1e9 bytes (32 GB V100: 32e9; in GiB the
stage-1 figure would be 8.2B, not the paper's 7.6B). The GPT's shape does not matter: its states
are the same bytes per parameter (up to padding, well under the rounding here).

* ZeRO (Rajbhandari et al., 2020), Table 2, DP 64, 32 GB V100: baseline (DDP) 2B, P_os (stage 1)
  7.6B, P_os+g (stage 2) 14.4B, P_os+g+p (stage 3) 128B.
* ZeRO-Offload (Ren et al., 2021): 13B on one 32 GB V100 against 1.4B for PyTorch DDP. ZeRO-Offload
  keeps the fp16 parameters on the GPU (2 bytes a parameter) and the gradients and optimizer state
  on the host (zdsl: zero 2, offload optimizer -> cpu). Its figures are measured runs, whose
  activations take memory the model states leave: here 13B's states fit where DDP's do not, and the
  model-state bounds (16B offloaded, 2B with DDP) lie above the published 13B and 1.4B.
"""
from __future__ import annotations

import pytest

from zdsl.check.checker import check_text
from zdsl.driver import compile_schedule
from zdsl.model.units import gpt_units
from zdsl.planner.state_fit import largest_model
from zdsl.planner.state_fit import states_fit
from zdsl.sim.memory import zero_model_states

V100 = 32 * 10**9
SHAPE = dict(layers=4, width=1024, heads=16, vocab=32000, context=1024)


def graph(ranks: int, sharding: str, shape=SHAPE):
    model = "model gpt(" + ", ".join(f"{k}={v}" for k, v in shape.items()) + ")\n"
    schedule, _ = check_text(f"{model}train batch=1, precision=fp16\noptimizer adam(lr=1e-4)\n"
                             f"ranks {ranks} on cuda\n{sharding}\n", "table2.zs")
    return compile_schedule(schedule, gpt_units(**shape))


@pytest.mark.parametrize("stage, published", [(0, 2.0e9), (1, 7.6e9), (2, 14.4e9), (3, 128e9)])
def test_zero_table_2_at_dp_64_on_a_32_gb_v100(stage, published):
    largest = largest_model(graph(64, f"zero {stage}"), V100)
    assert largest == pytest.approx(published, rel=0.01)           # the paper rounds to 2-3 digits
    formula = V100 / sum(zero_model_states(1, 64, stage, "fp16", "adam").values())
    assert largest == pytest.approx(formula, rel=1e-6)               # the graph is the paper's formula


def test_zero_offload_trains_13b_on_one_v100_where_ddp_stops_under_2b():
    offload, ddp = graph(1, "zero 2\noffload optimizer -> cpu"), graph(1, "zero 0")
    assert largest_model(offload, V100) == pytest.approx(16e9, rel=1e-6)      # fp16 parameters alone
    assert largest_model(ddp, V100) == pytest.approx(2e9, rel=1e-6)           # all 16 bytes
    assert 13e9 <= largest_model(offload, V100) and 1.4e9 <= largest_model(ddp, V100) < 13e9
    thirteen = dict(layers=64, width=4096, heads=32, vocab=50304, context=1024)    # a 13.1B GPT
    assert states_fit(graph(1, "zero 2\noffload optimizer -> cpu", thirteen), V100)
    assert not states_fit(graph(1, "zero 0", thirteen), V100)
