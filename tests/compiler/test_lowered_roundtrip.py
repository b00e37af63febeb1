"""`zdsl plan --lowered` prints valid .zs whose compilation gives the same task graph.

For every program: compile it; print its lowered pipelines; compile that text;
the graphs must be equal op for op, buffer for buffer (source positions and
the file name aside: the printed file is another file). ``zdsl plan --lowered`` runs in this
process (a fresh one would import transformers again for each HF program; test_cli runs the command).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from zdsl.cli import main
from zdsl.driver import compile_file
from zdsl.driver import memo_units_for

PROGRAMS = sorted((Path(__file__).parents[2] / "programs").glob("*.zs"))


def comparable(graph) -> dict:
    raw = dataclasses.asdict(graph)
    for op in raw["ops"]:
        op.pop("span")
    raw["config"].pop("file", None)
    raw.pop("schedule")
    return raw


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.stem)
def test_lowered_output_compiles_to_the_same_graph(program, capsys):
    units_for = memo_units_for()
    original = compile_file(str(program), {}, units_for, simulate=False)
    assert original.ok, original.diagnostics
    capsys.readouterr()
    assert main(["plan", str(program), "--lowered"]) == 0
    out = capsys.readouterr().out
    assert "forward unit" in out and "backward unit" in out
    lowered = program.parent / f".lowered-{program.name}"   # beside it: relative paths still resolve
    try:
        lowered.write_text(out)
        again = compile_file(str(lowered), {}, units_for, simulate=False)
    finally:
        lowered.unlink(missing_ok=True)
    assert again.ok, again.diagnostics
    assert comparable(again.graph) == comparable(original.graph)
