"""The model and the data of programs/classifier.zs: an MLP that sorts float feature vectors into classes.

DeepSpeed's first example, in zdsl's terms. Two things a schedule can name live here:

- ``build(...)``, the model factory (``model "classifier.py:build"(...)``): a plain ``nn.Module``
  cut into units (zdsl shards, gathers and offloads one unit at a time; the unit protocol is
  written down in ``zdsl/runtime/models/protocol.py``).
- ``batches(...)``, the data function (``data python("classifier.py:batches", ...)``): what a
  DeepSpeed user hands over as ``training_data``. zdsl calls it for every micro-batch of every
  rank with ``seed, step, micro, rank, world, batch`` (and the schedule's settings) and trains
  on the ``(inputs, targets)`` it returns: here float features and integer class labels.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.protocol import run_units


# -- the data -----------------------------------------------------------------------------

def centers(seed: int, features: int, classes: int) -> torch.Tensor:
    """One point per class, ``(classes, features)``: the task itself, the same for every step and rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(classes, features, generator=g) * 1.5


def batches(seed: int, step: int, micro: int, rank: int, world: int, batch: int,
            features: int = 16, classes: int = 4, noise: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of this rank: ``batch`` points, each a class's center plus Gaussian noise.

    Returns ``(inputs, targets)``: float32 ``(batch, features)`` and int64 ``(batch,)`` labels.
    A pure function of its arguments, as zdsl requires: row ``i`` of rank ``rank``'s micro-batch
    ``micro`` is the step's global sample ``(micro * world + rank) * batch + i`` (zdsl's own
    sources number them so), drawn from a generator seeded by ``(seed, step, sample)``. So the
    DDP reference, a rerun and a run resumed from a checkpoint see the same numbers, and any
    split of the same global batch (2 ranks, or 1 rank accumulating 2 micro-batches) the same
    samples.
    """
    middle = centers(seed, features, classes)
    inputs = torch.empty(batch, features)
    targets = torch.empty(batch, dtype=torch.long)
    first = (micro * world + rank) * batch
    for i in range(batch):
        g = torch.Generator().manual_seed(hash((seed, step, first + i)))     # a tuple of ints hashes the same everywhere
        label = int(torch.randint(classes, (1,), generator=g))
        targets[i] = label
        inputs[i] = middle[label] + noise * torch.randn(features, generator=g)
    return inputs, targets


# -- the model: units -----------------------------------------------------------------------

class Input(nn.Module):
    """Unit 0: features ``(batch, features)`` -> hidden ``(batch, hidden)``. zdsl calls it with the
    data's inputs as they are (float32 here); under bf16 or fp16 its weights are in that dtype, so it
    casts the inputs to them (as a DeepSpeed user writes ``inputs.half()``)."""

    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(features, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x.to(self.fc.weight.dtype)))


class Block(nn.Module):
    """A middle unit: a residual layer, hidden -> hidden."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


class Head(nn.Module):
    """The last unit: hidden and the class labels -> the mean cross-entropy over the micro-batch
    (fp32, whatever the compute dtype)."""

    def __init__(self, hidden: int, classes: int):
        super().__init__()
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(x).float(), labels)


class Classifier(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, layers: int):
        super().__init__()
        self.input = Input(features, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = Head(hidden, classes)

    def units(self) -> list[nn.Module]:
        """The chain zdsl schedules: input layer, each block, head."""
        return [self.input, *self.blocks, self.head]

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """As a plain module (DDP, export): the loss of a micro-batch."""
        return run_units(self, Batch.of(inputs, labels))


def build(features: int = 16, hidden: int = 64, classes: int = 4, layers: int = 2) -> Classifier:
    """The factory a schedule names: ``model "classifier.py:build"(features=16, classes=4)``."""
    return Classifier(features, hidden, classes, layers)
