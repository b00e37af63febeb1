"""Helpers the test folders share; importable by name because tests/ is on the path (see conftest.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def zdsl(*args, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """Run the zdsl command as a user would, outside any launcher's rank variables; output captured."""
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "zdsl.cli", *args], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=timeout)


def sized(zs) -> None:
    """Compile ``zs`` here, as a ``zdsl check`` before its run would: an HF model's units go to zdsl's
    sizing cache, so the run's launcher takes them from there instead of importing torch and
    transformers (seconds on a small machine, and not what the test is about); this process has both."""
    from zdsl.driver import compile_file
    compiled = compile_file(str(zs), {})
    assert compiled.ok, [d.message for d in compiled.diagnostics]


def private_cache(monkeypatch, folder: Path) -> Path:
    """Point ZDSL_CACHE at ``folder`` for this test, with a torch floor in it (a typical one: 300 MiB a
    process, 150 MiB shared), so that ``zdsl plan`` there takes it instead of measuring the floor in a
    subprocess that imports torch (seconds of CPU, and not what a test using this is about)."""
    import importlib.metadata
    import json
    import platform

    from zdsl.planner.machine_fit import floor_cache
    monkeypatch.setenv("ZDSL_CACHE", str(folder))
    path = floor_cache(importlib.metadata.version("torch"), platform.python_version())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"private": 300 << 20, "shared": 150 << 20}))
    return folder


# A tiny ZeRO-3 schedule for the command-line tests (compiles in milliseconds, no files).
SMALL = """\
schedule small "a tiny ZeRO-3 schedule"
model     gpt(layers=2, width=32, heads=4, vocab=64, context=8)
data      synthetic(vocab=64, context=8)
train     steps=2, batch=2, precision=fp32
optimizer adamw(lr=1e-3)
ranks     2 on cpu
zero      3
prefetch  parameters 1 units ahead
"""

QUICKSTART = Path(__file__).parents[1] / "programs" / "quickstart.zs"     # gpt vocab=256, context=32, 2 ranks


def quickstart_with_data(folder: Path, data: str, name: str = "data.zs") -> Path:
    """programs/quickstart.zs with its data statement replaced by ``data``, written into ``folder``
    (where the statement's relative paths then point)."""
    text = QUICKSTART.read_text()
    old = 'data      corpus("stdlib", context=32)'
    assert old in text
    out = folder / name
    out.write_text(text.replace(old, f"data      {data}"))
    return out


def assert_refused(zs: Path, expected: list[str], env=None) -> None:
    """``zdsl check`` and ``zdsl run`` of ``zs`` both end in exit status 1 with an error positioned in
    ``zs`` that holds every text of ``expected``, never a traceback."""
    for command in ("check", "run"):
        proc = zdsl(command, str(zs), env=env)
        assert proc.returncode == 1, (zs.name, command, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert f"{zs.name}:" in proc.stderr, proc.stderr           # positioned at the statement
        for part in expected:
            assert part in proc.stderr, (command, part, proc.stderr)
