"""The data-source registries: every kind has both sides, and preparing one loads only what it needs."""
from __future__ import annotations

import subprocess
import sys

from zdsl.runtime.data import MODULES
from zdsl.runtime.data import runtime_source
from zdsl.sources import SOURCES


def test_every_kind_the_checker_accepts_has_a_runtime_side_and_no_other():
    assert set(MODULES) == set(SOURCES)
    for kind in SOURCES:
        assert runtime_source(kind).kind == kind == SOURCES[kind].kind


def test_preparing_a_source_with_nothing_to_prepare_loads_neither_torch_nor_numpy():
    """The launcher's pre-flight prepares every source; corpus and synthetic prepare nothing, and a
    launcher that imported torch for them would take seconds before any rank starts."""
    code = ("import sys\nfrom zdsl.runtime.data import prepare\nfrom zdsl.schedule import DataSpec\n"
            "for spec in (DataSpec('corpus', 'stdlib', {'context': 8}), DataSpec('synthetic', None, {'context': 8})):\n"
            "    assert prepare(spec, None) == (None, None)\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
