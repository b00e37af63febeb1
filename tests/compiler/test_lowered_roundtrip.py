"""`zdsl plan --lowered` prints valid .zs whose compilation gives the same task graph.

For every program: compile it; print its lowered pipelines; compile that text;
the graphs must be equal op for op, buffer for buffer (source positions and
the file name aside: the printed file is another file).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from zdsl.driver import compile_file

PROGRAMS = sorted((Path(__file__).parents[2] / "programs").glob("*.zs"))


def comparable(graph) -> dict:
    raw = dataclasses.asdict(graph)
    for op in raw["ops"]:
        op.pop("span")
    raw["config"].pop("file", None)
    raw.pop("schedule")
    return raw


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.stem)
def test_lowered_output_compiles_to_the_same_graph(program):
    original = compile_file(str(program), {}, simulate=False)
    assert original.ok, original.diagnostics
    out = subprocess.run([sys.executable, "-m", "zdsl.cli", "plan", str(program), "--lowered"],
                         capture_output=True, text=True, check=True).stdout
    assert "forward unit" in out and "backward unit" in out
    lowered = program.parent / f".lowered-{program.name}"   # beside it: relative paths still resolve
    try:
        lowered.write_text(out)
        again = compile_file(str(lowered), {}, simulate=False)
    finally:
        lowered.unlink(missing_ok=True)
    assert again.ok, again.diagnostics
    assert comparable(again.graph) == comparable(original.graph)
