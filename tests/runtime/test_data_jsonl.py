"""data jsonl(...): rows equal the records tokenised directly (prompt labels -100, padding masked),
packed rows hold every record once, each its own segment from position 0; records longer than the
context are truncated and counted; rows are a pure function of (seed, step, micro, sample); the
file is tokenised once into a cache; bad files are errors naming the line, never a traceback."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import quickstart_with_data
from helpers import zdsl
from sft_data import record_tokens
from sft_data import sft_records
from sft_data import sft_spec
from sft_data import train_tokenizer
from sft_data import write_jsonl

from zdsl.sources.jsonl import JsonlSourceError
from zdsl.sources.jsonl import check_jsonl
from zdsl.runtime.data import jsonl as jsonl_module
from zdsl.runtime.data import make_batch
from zdsl.runtime.data.keys import sample_keys
from zdsl.runtime.data.jsonl import jsonl_problem
from zdsl.runtime.data.jsonl import jsonl_tokens
from zdsl.runtime.data.jsonl import sft_rows
from zdsl.runtime.models.batch import IGNORE_INDEX
from zdsl.sources.text import TextSourceError

pytest.importorskip("tokenizers")

RECORDS = 30


@pytest.fixture
def sft(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path / "cache"))
    jsonl_module._rows.cache_clear()
    records = sft_records(RECORDS)
    return write_jsonl(tmp_path / "sft.jsonl", records), train_tokenizer(tmp_path / "tokenizer.json"), records


def expected_row(tokenizer, record, context):
    """A record alone in a row: inputs, labels (-100 on prompt tokens), mask, padded to ``context``."""
    prompt, answer = record_tokens(tokenizer, record)
    tokens = (prompt + answer)[:context + 1]
    n = len(tokens) - 1
    ids = tokens[:-1] + [answer[-1]] * (context - n)             # padded with the end-of-text id
    labels = [IGNORE_INDEX if t + 1 < len(prompt) else tokens[t + 1] for t in range(n)]
    return ids, labels + [IGNORE_INDEX] * (context - n), [1] * n + [0] * (context - n)


def test_an_unpacked_row_is_its_record_tokenised_directly_with_prompt_labels_ignored(sft):
    path, tokenizer, records = sft
    spec = sft_spec(path, tokenizer, context=24, pack=False)
    for seed, step, micro, rank in [(0, 0, 0, 0), (3, 5, 1, 1)]:
        batch = make_batch(spec, seed, step, micro, rank, 2, 6)
        assert batch.positions is None and batch.segments is None       # one record per row: 0..T-1
        keys = sample_keys(seed, step, 0, (micro * 2 + rank) * 6, 6)   # the step's global samples
        for b, r in enumerate((keys % np.uint64(RECORDS)).astype(int)):
            ids, labels, mask = expected_row(tokenizer, records[r], 24)
            assert batch.input_ids[b].tolist() == ids
            assert batch.labels[b].tolist() == labels
            assert batch.attention_mask[b].tolist() == mask
            counted = [t for t in labels if t != IGNORE_INDEX]
            assert counted == record_tokens(tokenizer, records[r])[1]     # exactly the response and eos


def test_packed_rows_hold_every_record_once_each_its_own_segment_from_position_zero(sft):
    path, tokenizer, records = sft
    context = 24
    spec = sft_spec(path, tokenizer, context=context, pack=True)
    rows = sft_rows(spec)
    assert rows.first[0] == 0 and rows.first[-1] == RECORDS and np.all(np.diff(rows.first) >= 1)
    assert rows.rows < RECORDS                                            # it packs
    keys = np.arange(rows.rows, dtype=np.uint64)                         # every row once
    batch = rows.batch(keys)
    for row in range(rows.rows):
        at, members = 0, range(rows.first[row], rows.first[row + 1])
        for segment, r in enumerate(members):
            ids, labels, _ = expected_row(tokenizer, records[r], context)
            n = sum(1 for t in expected_row(tokenizer, records[r], context)[2] if t)
            span = slice(at, at + n)
            assert batch.input_ids[row, span].tolist() == ids[:n]
            assert batch.labels[row, span].tolist() == labels[:n]
            assert batch.positions[row, span].tolist() == list(range(n))
            assert set(batch.segments[row, span].tolist()) == {segment}
            assert batch.attention_mask[row, span].tolist() == [1] * n
            at += n
        assert at <= context
        if rows.first[row + 1] < RECORDS:          # the next record would not have fitted
            assert at + sum(expected_row(tokenizer, records[rows.first[row + 1]], context)[2]) > context
        pad = slice(at, context)
        assert set(batch.segments[row, pad].tolist()) <= {len(members)}     # padding: a segment of its own
        assert not batch.attention_mask[row, pad].any()
        assert (batch.labels[row, pad] == IGNORE_INDEX).all()


def test_records_longer_than_the_context_are_truncated_and_counted(sft, tmp_path):
    _, tokenizer, _ = sft
    records = sft_records(RECORDS, long_every=4)
    path = write_jsonl(tmp_path / "long.jsonl", records)
    context = 16
    lengths = [sum(map(len, record_tokens(tokenizer, r))) for r in records]
    longer = sum(n > context + 1 for n in lengths)
    assert 0 < longer < RECORDS
    for pack in (False, True):
        spec = sft_spec(path, tokenizer, context=context, pack=pack)
        rows = sft_rows(spec)
        assert rows.truncated == longer
        problem, note = jsonl_problem(spec)
        assert problem is None and f"{longer} of {RECORDS} records are longer than context={context}" in note
    unpacked = sft_rows(sft_spec(path, tokenizer, context=context, pack=False))
    r = next(i for i, n in enumerate(lengths) if n > context + 1)
    batch = unpacked.batch(np.array([r], dtype=np.uint64))
    prompt, answer = record_tokens(tokenizer, records[r])
    assert batch.input_ids[0].tolist() == (prompt + answer)[:context]              # its first context+1 tokens
    assert batch.attention_mask[0].all()
    fits = sft_spec(path, tokenizer, context=64, pack=True)
    assert jsonl_problem(fits) == (None, None)                                        # nothing said when nothing is cut


def test_a_context_that_leaves_no_response_token_is_an_error(sft, tmp_path):
    _, tokenizer, _ = sft
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "what is 1 plus 2 ? " * 4, "response": "3"}] * 3)
    problem, _ = jsonl_problem(sft_spec(path, tokenizer, context=8, pack=True))
    assert "no record keeps a response token within context=8" in problem


def test_rows_are_a_pure_function_of_seed_step_micro_and_global_sample(sft):
    path, tokenizer, _ = sft
    for pack in (False, True):
        spec = sft_spec(path, tokenizer, context=24, pack=pack)
        whole = make_batch(spec, 7, 2, 1, 0, 1, 8)
        halves = [make_batch(spec, 7, 2, 1, r, 2, 4) for r in range(2)]
        for name in ("input_ids", "labels", "attention_mask", "positions", "segments"):
            a = getattr(whole, name)
            if a is None:
                assert pack is False and name in ("positions", "segments")
                continue
            assert torch.equal(a, torch.cat([getattr(h, name) for h in halves]))
        jsonl_module._rows.cache_clear()                        # a new process: the same rows
        assert torch.equal(make_batch(spec, 7, 2, 1, 0, 1, 8).input_ids, whole.input_ids)
        assert not torch.equal(make_batch(spec, 7, 3, 1, 0, 1, 8).input_ids, whole.input_ids)


def test_the_file_is_tokenised_once_and_again_when_it_or_the_fields_change(sft):
    path, tokenizer, records = sft
    before = jsonl_module.TOKENISED
    first = jsonl_tokens(str(path), str(tokenizer), "prompt", "response")
    again = jsonl_tokens(str(path), str(tokenizer), "prompt", "response")
    assert jsonl_module.TOKENISED == before + 1 and again == first
    assert first.records == RECORDS
    renamed = [{"q": r["prompt"], "a": r["response"]} for r in records]
    other = write_jsonl(path.parent / "renamed.jsonl", renamed)
    fields = jsonl_tokens(str(other), str(tokenizer), "q", "a")
    assert jsonl_module.TOKENISED == before + 2 and fields.path != first.path
    assert np.array_equal(np.fromfile(fields.path, dtype="<u2"), np.fromfile(first.path, dtype="<u2"))
    write_jsonl(path, records[:-1])
    changed = jsonl_tokens(str(path), str(tokenizer), "prompt", "response")
    assert jsonl_module.TOKENISED == before + 3 and changed.records == RECORDS - 1


BAD = {
    "bad_line": ('{"prompt": "a", "response": "b"}\n\n{"prompt": "a" "response": "b"}\n', "line 3 is not JSON"),
    "no_response": ('{"prompt": "a", "response": "b"}\n{"prompt": "a", "answer": "b"}\n',
                    'line 2 has no "response" field'),
    "no_prompt": ('{"response": "b"}\n', 'line 1 has no "prompt" field'),
    "not_text": ('{"prompt": "a", "response": 3}\n', 'line 1: "response" is a JSON int, not a string'),
    "not_object": ('["a", "b"]\n', "line 1 is a JSON list, not an object"),
    "empty": ("\n\n", "holds no record"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_file_is_an_error_naming_its_line(name, tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path / "cache"))
    text, expected = BAD[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_text(text)
    with pytest.raises(JsonlSourceError, match=expected.replace("(", r"\(").replace("?", r"\?")) as info:
        check_jsonl(path, "prompt", "response")
    assert str(path) in str(info.value)


def test_a_missing_tokenizer_is_an_error_naming_it(sft):
    path, tokenizer, _ = sft
    with pytest.raises(TextSourceError, match="tokenizer not found:.*missing.json"):
        jsonl_tokens(str(path), str(tokenizer.parent / "missing.json"), "prompt", "response")


def test_zdsl_check_and_run_name_bad_jsonl_data_at_the_statement(tmp_path):
    """Positioned errors (file:line:col, a hint), no traceback, and no rank started."""
    train_tokenizer(tmp_path / "tokenizer.json")
    write_jsonl(tmp_path / "good.jsonl", sft_records(5))
    for name in ("bad_line", "no_response", "empty"):
        (tmp_path / f"{name}.jsonl").write_text(BAD[name][0])
    cases = {
        'jsonl("bad_line.jsonl", tokenizer="tokenizer.json")': ["bad_line.jsonl line 3 is not JSON"],
        'jsonl("no_response.jsonl", tokenizer="tokenizer.json")': ['no_response.jsonl line 2 has no "response"'],
        'jsonl("empty.jsonl", tokenizer="tokenizer.json")': ["holds no record"],
        'jsonl("good.jsonl", tokenizer="missing.json")': ["tokenizer not found:", "missing.json"],
        'jsonl("good.jsonl")': ["jsonl needs a tokenizer"],
        'jsonl("nowhere.jsonl", tokenizer="tokenizer.json")': ["jsonl not found:", "nowhere.jsonl"],
        'jsonl("good.jsonl", tokenizer="tokenizer.json", pack=yes)': ["jsonl(pack=) must be true or false"],
    }
    for data, expected in cases.items():
        zs = quickstart_with_data(tmp_path, data, "sft.zs")
        for command in (("check", "run") if "bad_line" in data else ("check",)):
            proc = zdsl(command, str(zs), env={"ZDSL_CACHE": str(tmp_path / "cache")})
            assert proc.returncode == 1, (data, command, proc.stderr)
            assert "Traceback" not in proc.stderr, proc.stderr
            assert "sft.zs:" in proc.stderr, proc.stderr
            assert "hint:" in proc.stderr or "pack=yes" in data, proc.stderr
            for part in expected:
                assert part in proc.stderr, (data, command, proc.stderr)
    good = quickstart_with_data(tmp_path, 'jsonl("good.jsonl", tokenizer="tokenizer.json", pack=true)', "good.zs")
    proc = zdsl("check", str(good), env={"ZDSL_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
