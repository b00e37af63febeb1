"""The unit protocol's per-batch context (Batch, prepare, takes_batch units) and its loss (-100 ignored)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zdsl.runtime.models.batch import IGNORE_INDEX
from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.loss import causal_lm_loss


def _logits_labels(seed: int = 0, B: int = 3, T: int = 8, V: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    return logits, labels


def test_the_loss_of_all_counted_labels_is_cross_entropy_s_mean_bit_for_bit():
    logits, labels = _logits_labels()
    want = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
    assert torch.equal(causal_lm_loss(logits, labels), want)
    half = logits.to(torch.bfloat16)   # computed in fp32 whatever the logits' dtype
    got = causal_lm_loss(half, labels)
    assert got.dtype == torch.float32
    assert torch.equal(got, F.cross_entropy(half.float().view(-1, half.shape[-1]), labels.reshape(-1)))


def test_ignored_labels_are_not_counted_in_the_loss_nor_its_gradient():
    logits, labels = _logits_labels(1)
    labels[:, :4] = IGNORE_INDEX
    logits.requires_grad_(True)
    loss = causal_lm_loss(logits, labels)
    loss.backward()
    counted = logits[:, 4:].detach()
    want = F.cross_entropy(counted.reshape(-1, counted.shape[-1]), labels[:, 4:].reshape(-1))
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert logits.grad[:, :4].abs().sum() == 0
    assert logits.grad[:, 4:].abs().sum() > 0


def test_a_micro_batch_with_no_counted_label_gives_zero_loss_and_zero_gradient():
    logits, labels = _logits_labels(2)
    logits.requires_grad_(True)
    loss = causal_lm_loss(logits, torch.full_like(labels, IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() == 0


def test_batch_positions_default_to_0_to_T_in_every_row_and_move_with_to():
    idx = torch.randint(0, 5, (2, 4))
    batch = Batch.of(idx, idx)
    assert batch.positions is None and batch.attention_mask is None and batch.extras == {}
    assert torch.equal(batch.position_ids(), torch.arange(4).expand(2, 4))
    given = torch.tensor([[3, 4, 5, 6], [0, 1, 2, 3]])
    batch = Batch(idx, idx, positions=given, attention_mask=torch.ones(2, 4), extras={"k": torch.ones(1), "n": 3})
    assert batch.position_ids() is given
    moved = batch.to("meta")
    assert moved.input_ids.is_meta and moved.labels.is_meta and moved.positions.is_meta
    assert moved.attention_mask.is_meta and moved.extras["k"].is_meta and moved.extras["n"] == 3
    assert batch.input_ids.device.type == "cpu"   # a copy, the original stays
