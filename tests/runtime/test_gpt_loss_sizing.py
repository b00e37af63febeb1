"""The built-in GPT's head in a 2-byte dtype keeps the loss's log-probabilities in fp32
(runtime/models/loss.py), so its analytic sizing (``gpt_units``) counts them at two 2-byte
elements each, as the bytes autograd saves say (meta-device sizing, ``runtime/sizing.py``). At
ZeRO-Offload's DDP baseline (batch 32, vocabulary 50304) the term is 3.3 GB of a V100's 32 GiB."""
from __future__ import annotations

import pytest
import torch

from zdsl.model.units import gpt_units
from zdsl.runtime.models.gpt import build
from zdsl.runtime.sizing import model_unit_specs


@pytest.mark.parametrize("shape", [dict(layers=1, width=32, heads=4, vocab=101, context=64),
                                   dict(layers=2, width=48, heads=4, vocab=512, context=24)])
def test_the_heads_half_precision_activations_count_the_fp32_log_probabilities(shape):
    with torch.device("meta"):
        model = build(**shape)
    measured = model_unit_specs(model, "gpt", shape["context"])[-1].act_elems(2)
    planned = gpt_units(**shape)[-1].act_elems(2)
    tokens = shape["context"]
    # what the plan leaves out is per token, not per token and vocabulary entry: the int64 labels
    # and LayerNorm's fp32 mean and rstd, 8 two-byte elements a token
    assert 0 <= measured - planned <= 8 * tokens + 8, (measured, planned)
