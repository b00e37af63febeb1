"""The built-in GPT's attention mask for padded or packed rows: one additive (B, 1, T, T) mask per
micro-batch that every block shares (not a boolean one that scaled_dot_product_attention converts,
and saves, in each block), the same bits as the boolean mask, and counted once by the planner."""
from __future__ import annotations

import pytest
import torch

from zdsl.compile.models import units_for
from zdsl.runtime.models import gpt
from zdsl.runtime.models.batch import Batch
from zdsl.schedule import DataSpec
from zdsl.schedule import ModelSpec

CFG = dict(layers=3, width=32, heads=4, vocab=64, context=24)
B, T = 3, 24


def _batch(masked: bool) -> Batch:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG["vocab"], (B, T), generator=g)
    batch = Batch.of(idx, idx.roll(-1, 1))
    batch.positions = torch.arange(T).repeat(B, 1)     # (B, T) either way: the embedding saves them
    if masked:                           # row 0 padded at the end, row 1 packs two segments
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, 17:] = 0
        segments = torch.zeros(B, T, dtype=torch.long)
        segments[1, 10:] = 1
        batch.positions[1, 10:] -= 10
        batch.attention_mask, batch.segments = mask, segments
    return batch


def _model(dtype):
    return gpt.build(**CFG, seed=3).to(dtype)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    model.prepare(batch)
    loss = model(batch)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_shared_additive_mask_gives_the_boolean_masks_bits(dtype, monkeypatch):
    model = _model(dtype)
    shared = _loss_and_grads(model, _batch(True))
    boolean = gpt.attention_mask
    monkeypatch.setattr(gpt, "attention_mask", lambda batch, dtype=None: boolean(batch))   # as before: bool
    per_block = _loss_and_grads(model, _batch(True))
    assert all(torch.equal(a, b) for a, b in zip(shared, per_block))
    assert torch.isfinite(shared[0])


def _saved_bytes(model, batch) -> int:
    """Bytes of the distinct storages autograd saves for backward over a forward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t
    model.prepare(batch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_masked_batch_saves_one_mask_for_all_blocks_and_the_planner_counts_it(dtype):
    model = _model(dtype)
    extra = _saved_bytes(model, _batch(True)) - _saved_bytes(model, _batch(False))
    mask_bytes = B * T * T * dtype.itemsize
    assert extra == mask_bytes                   # one (B, 1, T, T) mask, not one per block
    spec = ModelSpec("gpt", dict(CFG))
    plain = units_for(spec, T)
    masked = units_for(spec, T, data=DataSpec(kind="jsonl"))
    counted = sum(u.input_elems_per_seq + u.act_elems_per_seq + u.extras_elems_per_seq for u in masked) \
        - sum(u.input_elems_per_seq + u.act_elems_per_seq + u.extras_elems_per_seq for u in plain)
    assert counted * B * dtype.itemsize == mask_bytes


def test_a_plain_batch_needs_no_mask():
    batch = _batch(False)
    assert gpt.attention_mask(batch, torch.float32) is None
    _model(torch.float32).prepare(batch)
    assert not batch.extras
