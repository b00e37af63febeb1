"""Parsing: the grammar loads strictly, every program parses, each form reads as meant."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from zdsl.lang import ast
from zdsl.check.checker import check_text
from zdsl.check.checker import load_schedule
from zdsl.lang.errors import ZsError
from zdsl.lang.parse import grammar_text
from zdsl.lang.parse import parse_file
from zdsl.lang.parse import parse_text
from zdsl.lang.parse import parser
from zdsl.check.printer import print_schedule
from zdsl.check.printer import without_spans
from zdsl.schedule import Pipeline
from zdsl.schedule import PipeStmt
from zdsl.schedule import Ref
from zdsl.lang.sizes import SizeError
from zdsl.lang.sizes import format_size
from zdsl.lang.sizes import parse_size

PROGRAMS = sorted((Path(__file__).resolve().parents[2] / "programs").glob("*.zs"))
HEADER = "model gpt(layers=2, width=64, heads=4, vocab=256, context=32)\n"


def test_grammar_is_strict_lalr():
    pytest.importorskip("interegular")
    assert parser(strict=True, cache=False).options.strict
    assert "start:" in grammar_text()   # the package data is readable


def test_there_are_example_programs():
    names = {p.name for p in PROGRAMS}
    assert {"quickstart.zs", "zero1.zs", "zero2.zs", "zero3.zs", "offload_optimizer.zs",
            "nvme.zs", "pipelines.zs", "user_model.zs"} <= names


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.name)
def test_every_program_parses_and_checks(path):
    program = parse_file(str(path))
    assert program.statements
    schedule, warnings = load_schedule(str(path), units_for=_fake_units_for)
    assert not [w for w in warnings if w.is_error]
    assert schedule.spans["model"].file == str(path)


def _fake_units_for(spec, data=None):
    """Sizes a user's model without torch: 4 units of 10 parameters. A Hugging Face model is sized
    for real (its parameter names are what a program's `freeze` names)."""
    from zdsl.check.checker import default_units_for
    from zdsl.model.units import UnitSpec
    if spec.kind == "hf":
        from zdsl.compile.models import units_for
        return units_for(spec, data=data)
    units = default_units_for(spec)
    return units if units is not None else [UnitSpec(f"u{i}", [("w", (10,))]) for i in range(4)]


def test_comments_blank_lines_crlf_bom_and_no_final_newline():
    text = "\ufeff# head\r\n\r\nschedule s \"d\"  # trailing\r\n  \r\n" + HEADER.strip() + "  # x"
    program = parse_text(text, "t.zs")
    assert [s.keyword for s in program.statements] == ["schedule", "model"]


def test_statement_spans_point_at_keywords():
    program = parse_text("schedule s\n\n   zero 3\n", "t.zs")
    zero = program.statements[1]
    assert (zero.key_span.line, zero.key_span.column, zero.key_span.end_column) == (3, 4, 8)


@pytest.mark.parametrize("line, depth", [("prefetch 2", 2), ("prefetch parameters 3 units ahead", 3),
                                          ("prefetch parameters 1 unit ahead", 1), ("prefetch 0", 0)])
def test_prefetch_forms(line, depth):
    schedule, _ = check_text(HEADER + "zero 3\n" + line + "\n")
    assert schedule.prefetch == depth


def test_recompute_forms():
    assert check_text(HEADER + "recompute blocks")[0].recompute == {1, 2}
    assert check_text(HEADER + "recompute all")[0].recompute == {0, 1, 2, 3}
    assert check_text(HEADER + "recompute none")[0].recompute == set()
    assert check_text(HEADER + "recompute units 0, 2..3")[0].recompute == {0, 2, 3}


def test_overlap_forms():
    assert check_text(HEADER + "overlap none")[0].overlap == set()
    assert check_text(HEADER + "overlap gather/forward, scatter/backward")[0].overlap == \
        {"gather/forward", "scatter/backward"}
    assert check_text(HEADER + "overlap read")[0].overlap == {"read/forward", "read/backward",
                                                               "read/step"}


def test_policies_fill_the_schedule():
    text = HEADER + """
data      synthetic(vocab=128, context=16)
train     steps=5, batch=2, accumulate=3, precision=bf16, seed=7
optimizer sgd(lr=0.1, momentum=0.9, clip=none)
ranks     4 on cuda
shard     optimizer, gradients, parameters
offload   optimizer -> cpu(pinned=false, ratio=0.5)
offload   parameters -> nvme("/tmp/zs", block=1MiB, depth=16)
bucket    64MiB
persist   below 1KiB
memory    device 80GiB, host 1.5TB, nvme 1TiB
machine   cuda(flops=1e15, link=2e11)
checkpoint every 10 steps -> "ckpt" keep 3
"""
    s, _ = check_text(text)
    assert (s.train.steps, s.train.batch, s.train.accumulate, s.train.precision, s.train.seed) == \
        (5, 2, 3, "bf16", 7)
    assert (s.optimizer.kind, s.optimizer.lr, s.optimizer.momentum, s.optimizer.clip) == \
        ("sgd", 0.1, 0.9, None)
    assert (s.ranks, s.device, s.stage) == (4, "cuda", 3)
    assert s.placement["optimizer"].tier == "cpu" and s.placement["optimizer"].ratio == 0.5
    assert not s.placement["optimizer"].pinned
    p = s.placement["parameters"]
    assert (p.tier, p.paths, p.block_bytes, p.queue_depth) == ("nvme", ("/tmp/zs",), 1 << 20, 16)
    assert s.bucket_bytes == 64 << 20
    assert s.persist_below == 1024 // 2          # bytes of bf16 -> parameters
    assert s.memory == {"device": 80 << 30, "host": 1_500_000_000_000, "nvme": 1 << 40}
    assert (s.machine.name, s.machine.compute.flops, s.machine.collectives.node.bandwidth) == ("cuda", 1e15, 2e11)
    assert (s.checkpoint.every, s.checkpoint.dir, s.checkpoint.keep) == (10, "ckpt", 3)
    assert s.data.args == {"vocab": 128, "context": 16}
    assert s.spans["offload.parameters"].line == 9 and s.spans["memory.host"].line == 12


def test_pipelines_are_parsed_into_the_contract():
    text = HEADER + """zero 3
forward unit u {
    read      parameters[u+2] from nvme
    copy      parameters[u+1] to device
    gather    parameters[u+1]
    compute   u
    free      parameters[u]
}
backward unit u { compute u }
step unit v {
    step 0 on cpu
    write optimizer[v] to nvme
}
"""
    s, _ = check_text(text)
    fwd = s.pipelines["forward"]
    assert [(x.verb, x.ref.state, x.ref.offset, x.tier) for x in fwd.body] == [
        ("read", "parameters", 2, "nvme"), ("copy", "parameters", 1, "device"),
        ("gather", "parameters", 1, None), ("compute", "units", 0, None),
        ("free", "parameters", 0, None)]
    step = s.pipelines["step"]
    assert step.var == "v" and step.body[0].ref.absolute == 0 and step.body[0].tier == "cpu"
    assert s.spans["forward"].line == 3


def test_sizes_parse_and_format():
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1.5KiB") == 1536
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("4096") == 4096
    for n in (0, 1, 1000, 1024, 1536, 64 << 20, 3 * 10 ** 12, 123457):
        assert parse_size(format_size(n)) == n
    with pytest.raises(SizeError) as exc:
        parse_size("64Mib")
    assert "MiB" in exc.value.hint
    with pytest.raises(SizeError):
        parse_size("0.5B")


def _pipelines():
    return {
        "forward": Pipeline("forward", "u", [
            PipeStmt("read", Ref("parameters", 2), "nvme"),
            PipeStmt("copy", Ref("parameters", 1), "device"),
            PipeStmt("gather", Ref("parameters", 1)),
            PipeStmt("compute", Ref("units", 0)),
            PipeStmt("free", Ref("parameters", 0))]),
        "backward": Pipeline("backward", "u", [
            PipeStmt("gather", Ref("parameters", -1)),
            PipeStmt("recompute", Ref("units", 0)),
            PipeStmt("compute", Ref("units", 0)),
            PipeStmt("scatter", Ref("gradients", 0)),
            PipeStmt("copy", Ref("gradients", 0), "host"),
            PipeStmt("free", Ref("gradients", 1))]),
        "step": Pipeline("step", "u", [
            PipeStmt("read", Ref("optimizer", -1), "nvme"),
            PipeStmt("step", Ref("units", 0), "cpu"),
            PipeStmt("write", Ref("optimizer", 0), "nvme"),
            PipeStmt("gather", Ref("parameters", 0, absolute=0))]),
    }


def test_printer_round_trips_hand_written_pipelines():
    text = HEADER + """data corpus("stdlib", context=16)
train steps=3, precision=bf16
optimizer adamw(lr=1e-4, betas=(0.8, 0.9), clip=0.5)
ranks 2 on cpu
zero 3
offload parameters -> nvme("/tmp/a \\"b\\"", block=8KiB)
offload optimizer -> nvme("/tmp/o", ratio=0.25, pinned=false)
prefetch 3
bucket 1536
overlap gather, scatter/backward
recompute units 0, 2..3
persist below 12345
memory device 3GiB, nvme 1TB
machine cpu(flops=1.5e10)
checkpoint every 2 steps -> "ck" keep 1
"""
    schedule, _ = check_text(text, "policy.zs")
    printed = print_schedule(schedule, _pipelines())
    again, _ = check_text(printed, "printed.zs")
    expected = dataclasses.replace(schedule, pipelines=_pipelines())
    assert without_spans(again) == without_spans(expected)
    # and printing is a fixed point
    assert print_schedule(again) == printed


def test_printer_round_trips_defaults():
    schedule, _ = check_text(HEADER)
    again, _ = check_text(print_schedule(schedule, {}))
    assert without_spans(again) == without_spans(schedule)


def test_ast_keeps_values_as_written():
    program = parse_text('model "m.py:build"(a=-1.5e3, b=(1, "x", none), c=64KiB)\n')
    call = program.statements[0].call
    assert isinstance(call.callee, ast.Str)
    assert [a.value.text for a in call.args if isinstance(a.value, ast.Num)] == ["-1.5e3", "64KiB"]


def test_syntax_error_is_zserror():
    with pytest.raises(ZsError):
        parse_text("zero\n")


def test_every_example_in_the_language_reference_parses():
    readme = (Path(__file__).resolve().parents[2] / "grammar" / "README.md").read_text()
    blocks = readme.split("```")[1::2]
    examples = [b for b in blocks if not b.lstrip().split(":")[0].endswith(".zs")]
    assert len(examples) > 15
    for block in examples:
        parse_text(block, "README.md")


def test_front_end_imports_no_torch():
    import subprocess
    import sys
    code = ("import sys, zdsl.check.checker, zdsl.check.printer, zdsl.lang.parse, zdsl.lang.errors, zdsl.lang.sizes; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
