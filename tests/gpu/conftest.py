"""The GPU suite: every test in this folder needs CUDA and is skipped cleanly without it.

Run it on a machine with one or two GPUs: ``python -m pytest -m gpu tests/gpu``. The test
modules import zdsl and the helpers of tests/ inside their tests, not at the top, so the default
(CPU) run collects and skips them whatever those helpers become.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# the helpers this suite borrows: `zdsl` (e2e/test_run_cli.py) and `max_rel` (parity/test_run_vs_ddp.py),
# importable also when only tests/gpu is collected (tests/ itself is on the path: tests/conftest.py)
for folder in ("e2e", "parity"):
    if str(HERE.parent / folder) not in sys.path:
        sys.path.insert(0, str(HERE.parent / folder))


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the GPU suite (python -m pytest -m gpu tests/gpu) "
                                   "runs on a machine with one")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
