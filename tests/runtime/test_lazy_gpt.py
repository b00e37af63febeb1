"""The built-in GPT built lazily (how a model above LAZY_ABOVE starts): the eager init's bits, unit by
unit, in order, with the tied head's parameter kept the same object."""
from __future__ import annotations

import pytest
import torch

from zdsl.runtime.models.gpt import GPT

ARGS = dict(layers=3, width=32, heads=4, vocab=64, context=16)


def test_lazy_units_get_the_eager_init_bit_for_bit():
    eager, lazy = GPT(**ARGS, seed=7), GPT(**ARGS, seed=7, lazy=True)
    assert lazy.is_lazy and all(p.is_meta for p in lazy.parameters())
    wte = lazy.embedding.wte.weight
    lazy.materialize_unit(0)
    assert not wte.is_meta and lazy.embedding.wte.weight is wte and lazy.is_lazy
    with pytest.raises(RuntimeError, match="in order"):
        lazy.materialize_unit(2)
    with pytest.raises(RuntimeError, match="materialize"):
        lazy(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    lazy.materialize()
    assert not lazy.is_lazy
    for (name, a), (_, b) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert torch.equal(a, b), name
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(eager(idx, idx), lazy(idx, idx))


def test_another_seed_gives_other_values():
    a, b = GPT(**ARGS, seed=1, lazy=True).materialize(), GPT(**ARGS, seed=2, lazy=True).materialize()
    assert not torch.equal(a.blocks[0].attn.c_attn.weight, b.blocks[0].attn.c_attn.weight)
