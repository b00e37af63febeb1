"""``synthetic(vocab, context)``: learnable token streams, no files needed.

Each sample is an arithmetic progression modulo ``vocab`` with a start and a
stride (1..8) drawn from the sample's key: a model can learn to continue it,
so the loss falls (a useful smoke signal), and every token id in
``0..vocab-1`` occurs.
"""
from __future__ import annotations

from zdsl.runtime.data.source import TokenWindows


def synthetic_tokens(keys, vocab: int, length: int):
    """``(len(keys), length)`` int64 tokens, a pure function of the keys."""
    import numpy as np  # here, not at the top: the launcher's pre-flight imports this module
    import torch
    start = (keys % np.uint64(vocab)).astype(np.int64)
    stride = ((keys >> np.uint64(32)) % np.uint64(8)).astype(np.int64) + 1
    pos = np.arange(length, dtype=np.int64)
    return torch.from_numpy((start[:, None] + stride[:, None] * pos[None, :]) % vocab)


class SyntheticSource(TokenWindows):
    kind = "synthetic"

    def rows(self, spec, keys, context: int, next_keys):
        return synthetic_tokens(keys, self.vocab(spec), context + 1)


SOURCE = SyntheticSource()
