"""``zdsl run --tensorboard DIR``: each step's metrics record as TensorBoard scalars (rank 0 writes).

One run folder per invocation: ``DIR/<schedule name>-<UTC time>`` (``-2``, ``-3``... when two runs
start in the same second), so that TensorBoard pointed at ``DIR`` shows every run beside the others.
Every figure comes from :class:`~zdsl.runtime.run.train.StepMetrics`, the record ``--metrics`` and
the progress line are written from. The writer flushes after every step, so a run stopped by a
signal, or one that fails, keeps every step it finished.
"""
from __future__ import annotations

import time
from pathlib import Path

from zdsl.ir import TIERS

EXTRA = "pip install 'zdsl[tensorboard]'"


def missing_tensorboard() -> str | None:
    """Why ``--tensorboard`` cannot write here (the package is not installed), or None."""
    try:
        import tensorboard  # noqa: F401  (the optional extra)
    except ImportError:
        return f"--tensorboard needs the tensorboard package, an optional extra: {EXTRA}"
    return None


def run_folder(root: str | Path, name: str, now: float | None = None) -> Path:
    """A new folder under ``root`` for this invocation's event files."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        folder = Path(root) / (f"{name}-{stamp}" if n == 1 else f"{name}-{stamp}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"{root}: no free run folder for {name}-{stamp}")


class TensorBoardWriter:
    """Scalars per step under grouped tags; a context manager that flushes and closes on exit."""

    def __init__(self, root: str | Path, name: str):
        from torch.utils.tensorboard import SummaryWriter
        self.folder = run_folder(root, name)
        self.writer = SummaryWriter(log_dir=str(self.folder))

    def step(self, m) -> None:
        """Write one :class:`StepMetrics`; its step number is TensorBoard's step."""
        def add(tag, value, step):     # float64 tensors: the figures as --metrics has them, bytes exact
            self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
        add("loss/train", m.loss, m.step)
        if m.val_loss is not None:               # on the steps the schedule evaluates (runtime/run/evaluate.py)
            add("loss/val", m.val_loss, m.step)
        if m.lr is not None:
            add("lr", m.lr, m.step)
        if m.grad_norm is not None:
            add("grad_norm", m.grad_norm, m.step)
        add("throughput/tokens_per_s", m.tokens_per_s, m.step)
        add("time/step_ms", m.step_s * 1000.0, m.step)
        for tier in TIERS:     # the largest rank's peak, as the progress line shows it
            add(f"memory/{tier}_bytes", max((p.get(tier, 0) for p in m.peak_bytes.values()), default=0), m.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def __enter__(self) -> "TensorBoardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
