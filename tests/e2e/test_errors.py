"""Diagnostics: the exact rendered form, and positioned errors for hostile input."""
from __future__ import annotations

import pytest

from zdsl.check.checker import check_text

from zdsl.check.checker import load_schedule
from zdsl.check.loop import run_refusals
from zdsl.lang.errors import Diagnostic
from zdsl.lang.errors import ZsError
from zdsl.lang.errors import render
from zdsl.schedule import Span

HEADER = "model gpt(layers=2, width=64, heads=4, vocab=256, context=32)\n"


def only(text: str, file: str = "t.zs") -> Diagnostic:
    with pytest.raises(ZsError) as exc:
        check_text(text, file)
    return exc.value.diagnostics[0]


def test_render_exact_format():
    text = HEADER + "zero 2\noffload  gradient -> cpu\n"
    d = only(text)
    assert render(d, text) == (
        "t.zs:3:10: error: unknown state 'gradient'\n"
        "    offload  gradient -> cpu\n"
        "             ^~~~~~~~\n"
        "hint: did you mean 'gradients'?")


def test_render_uses_the_given_source_when_the_line_was_not_kept():
    d = Diagnostic("error", Span("x.zs", 2, 3, 6), "bad thing", "fix it")
    assert render(d, "first\nab cde fg\n") == (
        "x.zs:2:3: error: bad thing\n    ab cde fg\n      ^~~\nhint: fix it")


def test_render_warning_and_no_hint():
    d = Diagnostic("warning", Span("x.zs", 1, 1, 2), "careful")
    assert render(d, "z") == "x.zs:1:1: warning: careful\n    z\n    ^"


def test_render_keeps_tabs_so_the_caret_lines_up():
    d = Diagnostic("error", Span("x.zs", 1, 3, 4), "m")
    assert render(d, "\t\tX").splitlines()[1:] == ["    \t\tX", "    \t\t^"]


def test_render_without_a_place():
    d = Diagnostic("error", None, "unknown --set key 'stpes'", "did you mean 'steps'?")
    assert render(d) == "zdsl: error: unknown --set key 'stpes'\nhint: did you mean 'steps'?"


def test_render_reads_the_file_when_no_text_is_given(tmp_path):
    path = tmp_path / "f.zs"
    path.write_text(HEADER + "zero 7\n")
    with pytest.raises(ZsError) as exc:
        load_schedule(str(path))
    d = exc.value.diagnostics[0]
    d.source_line = None
    assert render(d).splitlines()[1:3] == ["    zero 7", "         ^"]


def test_syntax_error_points_at_the_token_with_expected():
    d = only(HEADER + "ranks 2 of cpu\n")
    assert (d.span.line, d.span.column, d.span.end_column) == (2, 9, 11)
    assert d.message == "unexpected 'of'" and "'on'" in d.hint


def test_unexpected_end_of_line_and_file():
    d = only(HEADER + "zero\n")
    assert (d.span.line, d.span.column) == (2, 5) and d.message == "unexpected end of line"
    d = only(HEADER + "forward unit u {\n compute u\n")
    assert d.message == "unexpected end of file" and d.span.line == 4


def test_non_utf8_is_positioned(tmp_path):
    path = tmp_path / "bad.zs"
    path.write_bytes(HEADER.encode() + b"zero \xff3\n")
    with pytest.raises(ZsError) as exc:
        load_schedule(str(path))
    d = exc.value.diagnostics[0]
    assert (d.span.line, d.span.column) == (2, 6) and "0xff" in d.message
    assert "UTF-8" in render(d)


@pytest.mark.parametrize("text, words", [
    ("schedule a\x00b\n", "NUL"),
    ("zero 3 $\n", "unexpected character '$'"),
    ('schedule a "open\n', "unterminated string"),
    ("zero " + "9" * 5000 + "\n", "too large"),
    ("optimizer adamw(lr=" + "1" * 400 + ".5)\n", "out of range"),
    ("model gpt(x=" + "(" * 5000 + "\n", "unexpected"),
    ("forward unit u { gather parameters[u+" + "9" * 40 + "] }\n", "below 1000000000"),
    ("\u202e zero 3\n", "U+202E"),
], ids=lambda v: repr(v)[:24])
def test_hostile_input_gives_positioned_errors(text, words):
    with pytest.raises(ZsError) as exc:
        check_text(text, "t.zs")
    d = next((d for d in exc.value.diagnostics if words in d.message), None)
    assert d is not None, [d.message for d in exc.value.diagnostics]
    assert d.span is not None and not d.message.startswith("internal error")
    render(d, text)


def test_an_empty_file_is_a_loop_schedule_that_zdsl_run_refuses_positioned():
    schedule, _ = check_text("", "t.zs")             # model and batches come from the user's loop
    refusals = run_refusals(schedule)
    assert [d.message.split(":")[0] for d in refusals] == ["zdsl run needs a model statement",
                                                           "zdsl run needs a data statement"]
    assert all(d.span is not None and d.span.line == 1 and d.hint for d in refusals)


def test_warnings_do_not_fail():
    s, warnings = check_text(HEADER + "zero 1\npersist below 10\n", "t.zs")
    assert s.persist_below == 10
    assert render(warnings[0]).startswith("t.zs:3:1: warning: persist")


def test_render_cuts_long_lines_around_the_caret():
    line = "train steps=" + "9" * 3000 + ", batch=x"
    d = only(HEADER + line + "\n")
    shown = render(d, None).splitlines()
    assert len(shown[1]) < 200 and shown[1].startswith("    train steps=999")
    d = Diagnostic("error", Span("x.zs", 1, 3003, 3004), "m")
    text, caret = render(d, line).splitlines()[1:3]
    assert len(text) < 200 and text[caret.index("^")] == line[3002]
