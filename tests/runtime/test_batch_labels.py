"""A batch without labels (``engine(x)`` given inputs alone) reaching a loss that needs them is
refused by name, not an AttributeError from inside the loss."""
from __future__ import annotations

import pytest
import torch

from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.gpt import GPT


def test_a_loss_without_labels_names_the_fix():
    model = GPT(layers=1, width=16, heads=2, vocab=32, context=8, seed=0)
    idx = torch.randint(0, 32, (2, 8))
    with pytest.raises(ValueError, match=r"needs labels .* give \(inputs, labels\)"):
        model(Batch(input_ids=idx, labels=None))


def test_labels_given_are_the_loss_labels():
    labels = torch.zeros(2, 8, dtype=torch.long)
    assert Batch(input_ids=labels, labels=labels).loss_labels() is labels
