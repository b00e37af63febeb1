"""`freeze PATTERN, ...` and `eval every N steps on SOURCE batches=K`: parsed, checked, printed back."""
from __future__ import annotations

import pytest

from zdsl.check.checker import check_text
from zdsl.lang.errors import ZsError
from zdsl.check.printer import print_schedule

BASE = """schedule t
model gpt(layers=2, width=64, heads=4)
data corpus("stdlib", context=32)
train steps=4, batch=2
"""


def check(extra: str, **overrides):
    return check_text(BASE + extra, "t.zs", overrides)[0]


def error_of(extra: str, **overrides):
    with pytest.raises(ZsError) as info:
        check(extra, **overrides)
    return info.value.diagnostics[0]


def test_freeze_globs_bare_and_quoted():
    s = check('freeze embedding.*, *.bias, "block.[01].ln_?.weight"\n')
    assert s.freeze == ("embedding.*", "*.bias", "block.[01].ln_?.weight")
    assert s.to_config()["freeze"] == ["embedding.*", "*.bias", "block.[01].ln_?.weight"]


def test_freeze_unmatched_names_the_closest():
    d = error_of("freeze embedin.*, *.bias\n")
    assert (d.span.line, d.span.column) == (5, 8)
    assert "matches no parameter" in d.message and "embedding.wte.weight" in d.hint


def test_freeze_everything_is_an_error():
    d = error_of("freeze *\n")
    assert "no parameter to train" in d.message


def test_eval_source_and_defaults():
    s = check("eval every 2 steps on synthetic(vocab=256) batches=3\n")
    assert (s.eval.every, s.eval.batches) == (2, 3)
    assert s.eval.data.kind == "synthetic" and s.eval.data.args["context"] == 32   # the training data's
    assert check("eval every 5 on corpus(\"stdlib\")\n").eval.batches == 1


def test_eval_errors_are_positioned():
    d = error_of("eval every 0 steps on synthetic(vocab=256)\n")
    assert d.span.line == 5 and "at least 1" in d.message
    d = error_of("eval every 2 steps on synthetic(vocab=999)\n")
    assert d.span.line == 5 and "larger than the model's vocab" in d.message
    d = error_of("eval every 2 steps on tokns(\"v.bin\")\n")
    assert d.span.line == 5 and "tokens" in (d.hint or "")


def test_unset_statements_are_empty_in_the_config():
    config = check("").to_config()
    assert config["freeze"] == [] and config["eval"] is None


def test_printed_back_and_set_from_the_command_line():
    s = check("", freeze="*.bias", eval='every 3 steps on corpus("stdlib") batches=2')
    assert s.freeze == ("*.bias",) and s.eval.every == 3
    again = check_text(print_schedule(s), "t.zs")[0]
    assert again.freeze == s.freeze and again.eval == s.eval
