"""``synthetic(vocab, context)``: learnable token streams, no files needed.

Each sample is an arithmetic progression modulo ``vocab`` with a start and a
stride (1..8) drawn from the sample's key: a model can learn to continue it,
so the loss falls (a useful smoke signal), and every token id in
``0..vocab-1`` occurs.
"""
from __future__ import annotations

import numpy as np
import torch


def synthetic_tokens(keys: np.ndarray, vocab: int, length: int) -> torch.Tensor:
    """``(len(keys), length)`` int64 tokens, a pure function of the keys."""
    start = (keys % np.uint64(vocab)).astype(np.int64)
    stride = ((keys >> np.uint64(32)) % np.uint64(8)).astype(np.int64) + 1
    pos = np.arange(length, dtype=np.int64)
    return torch.from_numpy((start[:, None] + stride[:, None] * pos[None, :]) % vocab)
