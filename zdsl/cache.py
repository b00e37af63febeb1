"""The folder where zdsl keeps what it built or measured on this machine: ``$ZDSL_CACHE``.

The runtime writes there (its C kernels, torch's memory floor per process, this machine's
calibrated profile); the planner reads the floor and the profile back without importing the runtime. Torch-free.
"""
from __future__ import annotations

from pathlib import Path

from zdsl import env


def cache_dir() -> Path:
    folder = env.get("ZDSL_CACHE")
    assert folder is not None, "ZDSL_CACHE has a registered default"
    return Path(folder).expanduser()
