"""The causal language-model loss every model's last unit returns (built-in, HF and users')."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zdsl.runtime.models.batch import IGNORE_INDEX


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy in fp32, the mean over this micro-batch's counted tokens.

    ``logits``: ``(..., vocab)``; ``labels``: the matching int64 shape, already shifted
    (``labels[b, t]`` is the token to predict at ``t``), ``IGNORE_INDEX`` not counted. The
    same bits as ``F.cross_entropy(logits.float().view(-1, V), labels.reshape(-1))``. A
    micro-batch with no counted token gives 0 (not NaN) and a zero gradient."""
    flat = labels.reshape(-1)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), flat, ignore_index=IGNORE_INDEX)
    # torch's mean over zero tokens is 0/0 (its backward already writes no gradient there); no
    # host sync to find out, and 3 kernels forward, 1 backward
    return loss.masked_fill((flat == IGNORE_INDEX).all(), 0.0)
