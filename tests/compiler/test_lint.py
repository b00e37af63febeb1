"""ruff (lint and import order) and mypy pass over zdsl/ and runtime/, with pyproject.toml's config.

The test extra installs both, so a finding fails here as it would in review; the message is the
tool's own output, file and line first.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    done = run_tool("ruff", "check", "--no-cache", "zdsl", "runtime")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow      # a clean checkout's first run reads torch's stubs: tens of seconds
def test_mypy_finds_nothing():
    done = run_tool("mypy")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr
