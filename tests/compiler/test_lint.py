"""ruff (lint and import order) and mypy pass over zdsl/ and runtime/, with pyproject.toml's config
(mypy over a link tree of the installed package's layout, so it resolves zdsl.runtime).

The test extra installs both, so a finding fails here as it would in review; the message is the
tool's own output, file and line first.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:                   # mypy, which the test extra installs, brings the backport before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    done = run_tool("ruff", "check", "--no-cache", "zdsl", "runtime")
    assert done.returncode == 0, done.stdout + done.stderr


def package_tree(into: Path) -> dict[str, str]:
    """Symlinks laid out as the installed package: pyproject's package-dir puts zdsl.runtime in
    runtime/, which mypy run in the checkout sees as a top-level package, so it would resolve no
    ``from zdsl.runtime... import``. Returns the tree's folder prefixes -> the checkout's."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    (into / "zdsl").mkdir()
    for entry in (ROOT / dirs["zdsl"]).iterdir():
        (into / "zdsl" / entry.name).symlink_to(entry)
    prefixes = {}
    for package, folder in dirs.items():
        if package != "zdsl":
            (into / package.replace(".", "/")).symlink_to(ROOT / folder)
            prefixes[package.replace(".", "/") + "/"] = folder + "/"
    return prefixes


@pytest.mark.slow      # a clean checkout's first run reads torch's stubs: tens of seconds
def test_mypy_finds_nothing(tmp_path):
    prefixes = package_tree(tmp_path)
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(ROOT / ".mypy_cache")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    report = done.stdout[-6000:] + done.stderr
    for tree, checkout in prefixes.items():      # a finding reads as the checkout's file
        report = report.replace(tree, checkout)
    assert done.returncode == 0, report
