"""The compiler never imports torch: `zdsl check` and `zdsl plan` stay instant and work without it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODULES = "zdsl, zdsl.cli, zdsl.check.checker, zdsl.compile.lower, zdsl.compile.verify, zdsl.sim.simulate"


def leaked(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code + "\nimport sys\n"
                           "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_compiler_modules_do_not_import_torch():
    assert leaked(f"import {MODULES}") == "[]"


def test_check_and_plan_of_a_builtin_model_do_not_import_torch():
    program = ROOT / "programs" / "quickstart.zs"
    code = ("import contextlib, io\nfrom zdsl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    assert main(['check', {str(program)!r}]) == 0\n"
            f"    assert main(['plan', {str(program)!r}, '--json']) == 0")
    assert leaked(code) == "[]"
