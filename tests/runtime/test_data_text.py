"""data text("FILE or FOLDER", tokenizer=...): tokenised once into a cached token file, then read as
tokens(FILE) is; the cache is hit on a second run and redone when a document or the tokenizer changes."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from zdsl.runtime.data import make_batch
from zdsl.runtime.data.keys import sample_keys
from zdsl.runtime.data import text as text_module
from zdsl.runtime.data.text import text_problem
from zdsl.runtime.data.text import text_tokens
from zdsl.schedule import DataSpec
from zdsl.sources.text import TextSourceError
from zdsl.sources.text import text_files

tokenizers = pytest.importorskip("tokenizers")

CONTEXT = 8
DOCS = {"a.txt": "the cat sat on the mat\n", "b.md": "a dog ran to the cat\n",
        "sub/c.py": "print('the mat')\n"}


def train_tokenizer(path, eos="<|endoftext|>", words=("the", "cat", "sat", "on", "mat", "dog", "ran")):
    """A tiny WordLevel tokenizer made here (no network), saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]"] + ([eos] if eos else [])
    tok.train_from_iterator([" ".join(words)] * 3, trainers.WordLevelTrainer(special_tokens=special))
    tok.save(str(path))
    return path


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "docs"
    for name, text in DOCS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text * 5)
    (folder / ".hidden").write_text("not read")
    (folder / "blob.bin").write_bytes(b"\0\1\2")
    return folder, train_tokenizer(tmp_path / "tokenizer.json")


def spec(folder, tokenizer, vocab):
    return DataSpec("text", str(folder), {"context": CONTEXT, "vocab": vocab}, None, str(tokenizer))


def reference_ids(folder, tokenizer):
    """Each document through the tokenizer directly, the end-of-text id after each."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for name in sorted(DOCS, key=lambda n: n.split("/")):
        ids += tok.encode((folder / name).read_text(), add_special_tokens=False).ids + [eos]
    return np.array(ids, dtype=np.int64), eos


def test_the_folder_rule_skips_hidden_and_binary_files_in_sorted_order(corpus):
    folder, _ = corpus
    assert [p.relative_to(folder).as_posix() for p in text_files(folder)] == ["a.txt", "b.md", "sub/c.py"]


def test_batches_equal_direct_tokenisation_windowed_as_tokens_does(corpus):
    folder, tokenizer = corpus
    ids, eos = reference_ids(folder, tokenizer)
    made = text_tokens(str(folder), str(tokenizer))
    assert made.dtype == "uint16"
    assert np.array_equal(np.fromfile(made.path, dtype="<u2").astype(np.int64), ids)
    assert list(ids).count(eos) == 3 and ids[-1] == eos        # one end-of-text after each document
    s = spec(folder, tokenizer, made.vocab)
    for seed, step, micro, rank in [(0, 0, 0, 0), (5, 3, 1, 1)]:
        idx, targets = make_batch(s, seed, step, micro, rank, 2, 4)
        starts = (sample_keys(seed, step, 0, (micro * 2 + rank) * 4, 4) % np.uint64(len(ids) - CONTEXT)).astype(np.int64)
        rows = np.stack([ids[a:a + CONTEXT + 1] for a in starts])
        assert torch.equal(idx, torch.from_numpy(rows[:, :-1])) and torch.equal(targets, torch.from_numpy(rows[:, 1:]))


def test_a_single_file_is_one_document(corpus, tmp_path):
    folder, tokenizer = corpus
    made = text_tokens(str(folder / "a.txt"), str(tokenizer))
    ids = np.fromfile(made.path, dtype="<u2")
    assert made.tokens == len(ids) == 6 * 5 + 1


def test_the_second_run_hits_the_cache_and_a_change_invalidates_it(corpus):
    folder, tokenizer = corpus
    before = text_module.TOKENISED
    first = text_tokens(str(folder), str(tokenizer))
    stamp = os.stat(first.path).st_mtime_ns
    again = text_tokens(str(folder), str(tokenizer))
    assert again == first and os.stat(first.path).st_mtime_ns == stamp
    assert text_module.TOKENISED == before + 1
    (folder / "b.md").write_text("the dog sat\n")              # a document changes
    changed = text_tokens(str(folder), str(tokenizer))
    assert changed.path != first.path and text_module.TOKENISED == before + 2
    assert changed.tokens == 5 * 6 + 1 + 3 + 1 + 5 * 5 + 1     # print, (', the, mat, ')
    train_tokenizer(tokenizer, words=("the", "dog", "sat", "mat", "cat"))     # the tokenizer changes
    retrained = text_tokens(str(folder), str(tokenizer))
    assert retrained.path not in (first.path, changed.path) and text_module.TOKENISED == before + 3


def test_a_tokenizer_folder_with_an_eos_token_in_its_config(corpus, tmp_path):
    folder, _ = corpus
    model = tmp_path / "model"
    model.mkdir()
    train_tokenizer(model / "tokenizer.json", eos="</s>")
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    made = text_tokens(str(folder / "a.txt"), str(model))
    from tokenizers import Tokenizer
    assert np.fromfile(made.path, dtype="<u2")[-1] == Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("</s>")


def test_bad_inputs_are_errors_naming_what_is_wrong(corpus, tmp_path):
    folder, tokenizer = corpus
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blob").write_bytes(b"\0" * 10)
    no_eos = train_tokenizer(tmp_path / "no_eos.json", eos=None)
    cases = [((str(folder), str(tmp_path / "missing.json")), "tokenizer not found"),
             ((str(empty), str(tokenizer)), "no text files in"),
             ((str(tmp_path / "nowhere"), str(tokenizer)), "text not found"),
             ((str(folder), str(no_eos)), "has no end-of-text token")]
    for args, expected in cases:
        with pytest.raises(TextSourceError, match=expected):
            text_tokens(*args)
    made = text_tokens(str(folder), str(tokenizer))
    problem = text_problem(spec(folder, tokenizer, made.vocab - 1))
    assert problem and f"not below the model's vocab {made.vocab - 1}" in problem
    assert text_problem(spec(folder, tokenizer, made.vocab)) is None
    short = text_tokens(str(folder / "a.txt"), str(tokenizer))
    problem = text_problem(DataSpec("text", str(folder / "a.txt"), {"context": 40, "vocab": 9}, None, str(tokenizer)))
    assert problem == (f"text {folder / 'a.txt'} holds {short.tokens} tokens through its tokenizer; context=40 "
                       f"needs at least 41 (a window of context+1 tokens)")


RANK_CODE = """
import sys, time
from pathlib import Path
from zdsl.runtime.data import text
folder, source, tokenizer, ranks = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
real = text.tokenise
def counted(*args):
    with open(folder / "tokenised", "a") as log:
        log.write("tokenise\\n")
    time.sleep(0.5)                                  # long enough for the others to arrive meanwhile
    return real(*args)
text.tokenise = counted
(folder / f"ready{sys.argv[5]}").touch()
while len(list(folder.glob("ready*"))) < ranks:      # start together, as ranks under torchrun do
    time.sleep(0.01)
print(text.text_tokens(source, tokenizer).tokens)
"""


@pytest.mark.slow      # spawns 3 processes
def test_ranks_started_together_tokenise_once(corpus, tmp_path):
    import subprocess
    import sys
    folder, tokenizer = corpus
    procs = [subprocess.Popen([sys.executable, "-c", RANK_CODE, str(tmp_path), str(folder), str(tokenizer),
                               "3", str(r)], stdout=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert [int(o) for o in outs] == [len(reference_ids(folder, tokenizer)[0])] * 3
    assert (tmp_path / "tokenised").read_text().count("tokenise") == 1


def test_zdsl_check_names_the_extra_when_tokenizers_is_missing(corpus, monkeypatch):
    import importlib.util
    from zdsl.check.checker import check_text
    from zdsl.lang.errors import ZsError
    folder, tokenizer = corpus
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tokenizers" else real(name, *a))
    source = (f'schedule t\nmodel gpt(layers=1, width=8, heads=1, vocab=256, context=8)\n'
              f'data text("{folder}", tokenizer="{tokenizer}")\n')
    with pytest.raises(ZsError) as raised:
        check_text(source, "t.zs")
    errors = [d for d in raised.value.diagnostics if "tokenizers" in d.message]
    assert errors and "zdsl[hf]" in errors[0].message and errors[0].span.line == 3
