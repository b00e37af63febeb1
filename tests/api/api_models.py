"""Models and data the API tests train: a user's own modules, not written for zdsl.

``Mlp`` is the seeds' DeepSpeed ``SimpleModel`` shape (fc1, ReLU, fc2 called in order by its own
``forward``); ``Residual`` adds its input back (no chain of children); ``batches`` is a
``data python(...)`` function of float features and class labels, drawn from its arguments alone.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
FEATURES, HIDDEN, CLASSES = 12, 16, 5


class Mlp(nn.Module):
    def __init__(self, features: int = FEATURES, hidden: int = HIDDEN, classes: int = CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        out = self.fc1(x)
        out = self.relu(out)
        return self.fc2(out)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, FEATURES)
        self.fc2 = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.fc2(x + self.fc1(x))


def mlp(seed: int = 0) -> Mlp:
    torch.manual_seed(seed)
    return Mlp()


def sequential(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                         nn.Linear(HIDDEN, CLASSES))


def batches(seed: int, step: int, micro: int, rank: int, world: int, batch: int):
    """Float features ``(batch, FEATURES)`` and class labels ``(batch,)``, from the arguments alone."""
    g = torch.Generator().manual_seed(hash((seed, step, micro, rank)))
    return torch.randn(batch, FEATURES, generator=g), torch.randint(CLASSES, (batch,), generator=g)


def schedule(folder: Path, *, ranks: int = 1, zero: int = 3, batch: int = 4, accumulate: int = 1,
             extra: str = "", name: str = "api.zs", model: str | None = None) -> Path:
    """A schedule for a model given to initialize (no model statement unless ``model``), sized from
    ``batches``."""
    text = (f"schedule api \"the API tests' schedule\"\n"
            + (f"model {model}\n" if model else "")
            + f"data python(\"{HERE / 'api_models.py'}:batches\")\n"
            f"train steps=4, batch={batch}, accumulate={accumulate}, precision=fp32\n"
            f"optimizer adamw(lr=1e-2)\n"
            f"ranks {ranks} on cpu\n"
            f"zero {zero}\n{extra}")
    path = folder / name
    path.write_text(text)
    return path
