"""Helpers the test folders share; importable by name because tests/ is on the path (see conftest.py)."""
from __future__ import annotations

import os
import subprocess
import sys


def zdsl(*args, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """Run the zdsl command as a user would, outside any launcher's rank variables; output captured."""
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "zdsl.cli", *args], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=timeout)
