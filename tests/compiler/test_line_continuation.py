"""Line continuation: a statement goes on past a line end inside '(' and after a trailing ','.

Positions stay those of the continued lines; an unclosed '(' is blamed where it opened; the
printer wraps long statements and its output is a fixed point that checks to the same schedule.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from zdsl.check.checker import check_text
from zdsl.lang.errors import ZsError
from zdsl.lang.parse import parse_text
from zdsl.check.printer import WIDTH
from zdsl.check.printer import print_schedule
from zdsl.check.printer import without_spans
from zdsl.check.printer import wrap_statement

HEADER = "model gpt(layers=2, width=64, heads=4, vocab=256, context=32)\n"
PROGRAMS = sorted((Path(__file__).resolve().parents[2] / "programs").glob("*.zs"))

WRAPPED = """\
model gpt(
    layers=2,       # a comment inside the parentheses
    width=64,

    heads=4, vocab=256,
    context=32
)
train steps=30,     # a comment after the comma
      batch=4,
      precision=fp32
optimizer adamw(lr=3e-3,
                betas=(0.9,
                       0.95),
                weight_decay=0.1)
memory device 3GiB,
       host 8GiB
shard optimizer,
      gradients
machine cpu(flops=1.5e10,
            memory_bw=2e10)
"""

ONE_LINE = """\
model gpt(layers=2, width=64, heads=4, vocab=256, context=32)
train steps=30, batch=4, precision=fp32
optimizer adamw(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
memory device 3GiB, host 8GiB
shard optimizer, gradients
machine cpu(flops=1.5e10, memory_bw=2e10)
"""


def _syntax_error(text: str):
    """The one diagnostic parsing ``text`` (as file w.zs) raises."""
    with pytest.raises(ZsError) as info:
        parse_text(text, "w.zs")
    (diag,) = info.value.diagnostics
    return diag


def _errors(text: str, file: str = "w.zs"):
    with pytest.raises(ZsError) as info:
        check_text(text, file)
    return [d for d in info.value.diagnostics if d.is_error], info.value


def test_wrapped_statements_check_to_the_one_line_schedule():
    wrapped, _ = check_text(WRAPPED, "w.zs")
    flat, _ = check_text(ONE_LINE, "w.zs")
    assert without_spans(wrapped) == without_spans(flat)
    assert wrapped.train.steps == 30 and wrapped.memory == {"device": 3 << 30, "host": 8 << 30}


def test_tokens_keep_the_line_and_column_they_are_on():
    program = parse_text(WRAPPED, "w.zs")
    model, train = program.statements[0], program.statements[1]
    assert [(a.key.value, a.key.span.line, a.key.span.column) for a in model.call.args] == [
        ("layers", 2, 5), ("width", 3, 5), ("heads", 5, 5), ("vocab", 5, 14), ("context", 6, 5)]
    assert [(a.key.value, a.span.line) for a in train.args] == [("steps", 8), ("batch", 9), ("precision", 10)]
    assert train.span.line == 8 and program.statements[2].span.line == 11


def test_a_line_end_still_ends_a_statement_outside_parentheses_without_a_comma():
    program = parse_text("train steps=30\nzero 2\n")
    assert [s.keyword for s in program.statements] == ["train", "zero"]
    with pytest.raises(ZsError) as info:       # no comma: 'batch=4' is a statement of its own
        parse_text("train steps=30\n      batch=4\n", "x.zs")
    (diag,) = info.value.diagnostics
    assert (diag.span.line, diag.span.column) == (2, 7) and "unknown statement" in diag.message


def test_checker_errors_point_at_the_second_and_third_line_of_a_statement():
    text = HEADER + "machine cpu(flops=1e10,\n            flopz=2e9,\n            memory_bw=-1)\n"
    errors, exc = _errors(text)
    places = {(d.span.line, d.span.column) for d in errors}
    assert (3, 13) in places                                # flopz: unknown keyword on line 3
    assert any(d.span.line == 4 for d in errors)            # memory_bw=-1 on line 4
    rendered = exc.render(text)
    assert "w.zs:3:13:" in rendered and "            flopz=2e9," in rendered


def test_syntax_errors_on_continued_lines_are_positioned_there():
    text = "machine cpu(flops=1e10,\n            link==2e9,\n            memory_bw=1)\n"
    diag = _syntax_error(text)
    assert (diag.span.line, diag.span.column) == (2, 18) and diag.message == "unexpected '='"
    text = "train steps=30,\n      batch=4,\n      precision fp32\n"
    diag = _syntax_error(text)
    assert (diag.span.line, diag.span.column) == (3, 17)


def test_an_unclosed_parenthesis_is_blamed_where_it_opened():
    text = HEADER + "machine cpu(flops=1e10\n\n# the next statement\ntrain steps=3\n"
    with pytest.raises(ZsError) as info:
        parse_text(text, "w.zs")
    (diag,) = info.value.diagnostics
    assert (diag.span.file, diag.span.line, diag.span.column) == ("w.zs", 2, 12)
    assert diag.message == "'(' is never closed"
    assert diag.hint == ("close it with ')' at the end of line 2, "
                         "or end line 2 with ',' if the statement goes on to line 5")
    assert "machine cpu(flops=1e10" in info.value.render(text)


def test_an_unclosed_parenthesis_at_the_end_of_file_is_blamed_where_it_opened():
    text = "optimizer adamw(lr=1e-3,\n  betas=(0.9, 0.95),\n  eps=1e-8\n\n"
    diag = _syntax_error(text)
    assert (diag.span.line, diag.span.column) == (1, 16)
    assert diag.hint == "close it with ')' at the end of line 3"


def test_the_innermost_open_parenthesis_is_blamed():
    text = "optimizer adamw(lr=1e-3, betas=(0.9,\n  0.95\nzero 2\n"
    diag = _syntax_error(text)
    assert (diag.span.line, diag.span.column) == (1, 32)


def test_a_comma_that_swallows_the_next_statement_is_blamed():
    text = HEADER + "shard optimizer,   # a stray comma\n\nzero 2\n"
    diag = _syntax_error(text)
    assert (diag.span.line, diag.span.column) == (2, 16)
    assert diag.message == "a statement does not end with ','"
    assert diag.hint == "remove this ','; with it the statement goes on to line 4's 'zero'"


def test_a_trailing_comma_at_the_end_of_file_is_blamed():
    with pytest.raises(ZsError) as info:
        parse_text("train steps=3,\n\n", "w.zs")
    (diag,) = info.value.diagnostics
    assert (diag.span.line, diag.span.column) == (1, 14)
    assert diag.hint == "remove this ','; with it the statement goes on to the end of the file"


def test_pipeline_bodies_still_end_statements_at_line_ends():
    text = HEADER + "forward unit u {\n    gather params[u]\n    compute u\n}\n"
    program = parse_text(text)
    assert len(program.statements[-1].body) == 2


# -- the printer --------------------------------------------------------------------

LONG_MACHINE = HEADER + (
    "machine cpu(flops=4.36e10, host_flops=3.1e10, link=1.2e9, latency=4.5e-05, scatter_link=1.1e9, "
    "scatter_latency=5e-05, reduce_link=1e9, reduce_latency=6e-05, pcie=1.5e10, memory_bw=2.1e10, "
    "host_memory_bw=1.8e10, disk_read=1.3e9, disk_write=1.1e9)\n"
    "train steps=30, batch=4, precision=fp32\n")


def _fmt(text: str) -> str:
    schedule, _ = check_text(text, "f.zs")
    return print_schedule(schedule)


def test_printer_wraps_a_long_machine_statement_one_setting_per_line():
    printed = _fmt(LONG_MACHINE)
    assert all(len(line) <= WIDTH for line in printed.splitlines())
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("machine"))
    assert lines[start] == "machine   cpu("
    assert lines[start + 1] == "    flops=43600000000.0,"
    end = lines.index(")", start)
    assert all(line.startswith("    ") and "=" in line for line in lines[start + 1:end])


@pytest.mark.parametrize("text", [LONG_MACHINE, WRAPPED, HEADER + "freeze " + ", ".join(
    f"block.{i % 2}.attn.c_{n}.*" for i in range(2) for n in ("attn", "proj")) + ", " + ", ".join(f"block.{i}.ln_{j}.*" for i in range(2) for j in (1, 2)) + "\n"], ids=["machine", "wrapped", "freeze"])
def test_fmt_is_a_fixed_point_and_checks_to_the_same_schedule(text):
    once = _fmt(text)
    assert _fmt(once) == once
    assert without_spans(check_text(once, "f.zs")[0]) == without_spans(check_text(text, "f.zs")[0])


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.name)
def test_fmt_round_trips_every_program(path, monkeypatch):
    monkeypatch.chdir(path.parent)
    text = path.read_text()
    try:
        schedule, _ = check_text(text, str(path))
    except ZsError:
        pytest.skip(f"{path.name} needs files this test does not make")
    once = print_schedule(schedule)
    again, _ = check_text(once, str(path))
    assert print_schedule(again) == once
    assert without_spans(again) == without_spans(schedule)


def test_wrap_statement_leaves_short_lines_and_strings_alone():
    assert wrap_statement("zero 3") == ["zero 3"]
    long_string = 'data corpus("' + "x, (y)" * 30 + '")'
    assert wrap_statement(long_string) == [long_string]      # one setting: nowhere to break
    lines = wrap_statement('data corpus("' + "a,b(" * 30 + '", context=32)')
    assert lines[0] == "data corpus(" and lines[1].endswith('",') and lines[-1] == ")"
