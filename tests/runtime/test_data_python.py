"""data python("file.py:batches"): the user's function gives each micro-batch; every broken contract is a
message naming the function and what it returned; zdsl check finds the function (without running it) and
sizes a user's model from what it returns."""
from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from zdsl.check.checker import check_text
from zdsl.lang.errors import ZsError
from zdsl.sources.python import PythonDataError
from zdsl.sources.python import defines
from zdsl.runtime.data import make_batch
from zdsl.runtime.data.python import python_problem
from zdsl.schedule import DataSpec
from zdsl.schedule import ModelSpec

CLASSIFIER = Path(__file__).parents[2] / "programs" / "classifier.py"

FUNCTIONS = '''
import numpy as np
import torch

def batches(seed, step, micro, rank, world, batch, features=4, scale=1.0):
    g = torch.Generator().manual_seed(hash((seed, step, micro, rank)))
    return scale * torch.randn(batch, features, generator=g), torch.randint(0, 3, (batch,), generator=g)

def tokens(seed, step, micro, rank, world, batch):
    ids = torch.arange(batch * 9).view(batch, 9) + 1000 * step + 100 * rank
    return ids[:, :-1], ids[:, 1:]

def triple(seed, step, micro, rank, world, batch):
    return torch.zeros(batch, 2), torch.zeros(batch), torch.zeros(batch)

def arrays(seed, step, micro, rank, world, batch):
    return np.zeros((batch, 2)), torch.zeros(batch, dtype=torch.long)

def rows(seed, step, micro, rank, world, batch):
    return torch.zeros(batch + 1, 2), torch.zeros(batch + 1, dtype=torch.long)

def scalar(seed, step, micro, rank, world, batch):
    return torch.zeros(batch, 2), torch.tensor(0)

def by_rank(seed, step, micro, rank, world, batch):
    return torch.zeros(batch, 2 + rank), torch.zeros(batch, dtype=torch.long)

def by_step(seed, step, micro, rank, world, batch):
    dtype = torch.float32 if step == 0 else torch.float64
    return torch.zeros(batch, 2, dtype=dtype), torch.zeros(batch, dtype=torch.long)

def global_random(seed, step, micro, rank, world, batch):
    return torch.randn(batch, 2), torch.zeros(batch, dtype=torch.long)

def no_arguments():
    return torch.zeros(1, 2), torch.zeros(1)

def raises(seed, step, micro, rank, world, batch):
    raise KeyError("shard-7")
'''


@pytest.fixture
def data_file(tmp_path) -> Path:
    path = tmp_path / "data.py"
    path.write_text(FUNCTIONS)
    return path


def spec(path: Path, name: str, **settings) -> DataSpec:
    return DataSpec("python", f"{path}:{name}", settings)


def test_make_batch_gives_the_functions_pair_with_the_settings(data_file):
    s = spec(data_file, "batches", features=5, scale=2.0)
    x, y = make_batch(s, 3, 2, 1, 1, 2, 6)
    assert x.dtype == torch.float32 and x.shape == (6, 5) and y.dtype == torch.int64 and y.shape == (6,)
    g = torch.Generator().manual_seed(hash((3, 2, 1, 1)))
    assert torch.equal(x, 2.0 * torch.randn(6, 5, generator=g))
    assert torch.equal(y, torch.randint(0, 3, (6,), generator=g))
    assert torch.equal(make_batch(s, 3, 2, 1, 1, 2, 6)[0], x)          # pure: the same call, the same batch
    assert not torch.equal(make_batch(s, 3, 3, 1, 1, 2, 6)[0], x)      # another step, another batch


def test_integer_inputs_pass_through_as_they_are(data_file):
    x, y = make_batch(spec(data_file, "tokens"), 0, 1, 0, 1, 2, 3)
    assert x.dtype == torch.int64 and x.shape == (3, 8) and int(x[0, 0]) == 1100
    assert torch.equal(y, x + 1)


@pytest.mark.parametrize("name, words", [
    ("triple", ["triple(seed=0, step=0, micro=0, rank=0, world=1, batch=4) returned a tuple of 3 items",
                "the pair (inputs, targets)"]),
    ("arrays", ["returned a value of type ndarray as inputs, not a torch tensor", "torch.from_numpy"]),
    ("rows", ["a float32 tensor of shape (5, 2) as inputs: 5 rows, but a micro-batch has batch=4 rows first"]),
    ("scalar", ["an int64 tensor of shape () as targets: a scalar"]),
    ("no_arguments", ["cannot call no_arguments(seed=0", "unexpected keyword argument 'seed'",
                      "it takes the keyword arguments seed, step, micro, rank, world, batch"]),
    ("raises", ["raises(seed=0, step=0, micro=0, rank=0, world=1, batch=4) raised KeyError: 'shard-7'"]),
    ("missing", ["defines no 'missing'"]),
])
def test_a_broken_contract_names_the_function_and_what_it_returned(data_file, name, words):
    with pytest.raises(PythonDataError) as info:
        make_batch(spec(data_file, name), 0, 0, 0, 0, 1, 4)
    message = str(info.value)
    assert message.startswith(f'data python("{data_file}:{name}")'), message
    for w in words:
        assert w in message, message


def test_a_setting_the_function_does_not_take_is_named(data_file):
    with pytest.raises(PythonDataError, match=r"with colour='red': got an unexpected keyword argument 'colour'"):
        make_batch(spec(data_file, "tokens", colour="red"), 0, 0, 0, 0, 1, 2)


def test_shapes_or_dtypes_that_change_between_calls_are_named_with_both_calls(data_file):
    s = spec(data_file, "by_step")
    make_batch(s, 0, 0, 0, 0, 1, 4)
    with pytest.raises(PythonDataError) as info:
        make_batch(s, 0, 1, 0, 0, 1, 4)
    assert ("by_step(seed=0, step=1, micro=0, rank=0, world=1, batch=4) returned inputs float64 (batch, 2) and "
            "targets int64 (batch,), but by_step(seed=0, step=0, micro=0, rank=0, world=1, batch=4) returned "
            "inputs float32 (batch, 2)") in str(info.value)


def test_the_preflight_catches_ranks_that_differ_and_a_function_that_is_not_pure(data_file):
    assert python_problem(spec(data_file, "batches"), 0, 2, 4) is None
    by_rank = python_problem(spec(data_file, "by_rank"), 0, 2, 4)
    assert "by_rank(seed=0, step=0, micro=0, rank=1, world=2, batch=4) returned inputs float32 (batch, 3)" in by_rank
    assert "but by_rank(seed=0, step=0, micro=0, rank=0, world=2, batch=4) returned inputs float32 (batch, 2)" \
        in by_rank
    impure = python_problem(spec(data_file, "global_random"), 0, 2, 4)
    assert "two calls of global_random(seed=0, step=0, micro=0, rank=0, world=2, batch=4) returned different " \
           "inputs" in impure and "pure function of its arguments" in impure


def test_a_module_function_is_found_by_zdsl_check_without_running_it_and_loads_by_its_dotted_name(tmp_path,
                                                                                                monkeypatch):
    package = tmp_path / "mydata"
    package.mkdir()
    ran = tmp_path / "ran"
    (package / "__init__.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    (package / "source.py").write_text(FUNCTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    s, _ = check_text(HEADER + 'data python("mydata.source:tokens")\n', str(tmp_path / "s.zs"))
    assert s.data.source == "mydata.source:tokens" and not ran.exists()
    assert check_errors(HEADER + 'data python("mydata.source:absent")\n', tmp_path / "s.zs") \
        and not ran.exists()
    x, y = make_batch(s.data, 0, 0, 0, 0, 1, 2)
    assert x.shape == (2, 8) and ran.exists()


# -- zdsl check ---------------------------------------------------------------------------

HEADER = 'schedule s\nmodel gpt(layers=1, width=32, heads=2, vocab=256, context=16)\n'


def check_errors(text: str, file: Path) -> list[str]:
    file.write_text(text)
    try:
        check_text(text, str(file))
    except ZsError as exc:
        return [f"{d.span.line}:{d.span.column} {d.message} | {d.hint}" for d in exc.diagnostics if d.is_error]
    return []


def test_zdsl_check_finds_the_function_without_running_it(tmp_path, data_file):
    zs = tmp_path / "s.zs"
    s, _ = check_text(HEADER + 'data python("data.py:raises", scale=2)\n', str(zs))
    assert s.data.kind == "python" and s.data.source == f"{data_file.resolve()}:raises"
    assert s.data.args == {"scale": 2}


@pytest.mark.parametrize("data, words", [
    ('python("nowhere.py:batches")', ["3:13 data file not found:", "nowhere.py",
                                      "relative to the schedule file"]),
    ('python("data.py:absent")', ["3:13 ", "data.py defines no function 'absent'",
                                  "def absent(seed, step, micro, rank, world, batch)"]),
    ('python("no_such_pkg.mod:batches")', ["3:13 no module named 'no_such_pkg.mod' on the Python path"]),
    ('python("data.py")', ['3:13 data python("data.py"): expected "file.py:function"']),
    ('python("data.py:batches", rank=1)', ["3:32 zdsl passes rank to the function itself"]),
    ('python()', ["3:6 python needs the function that makes batches"]),
    ('"data.py:batches"', ['3:6 data is corpus(...)', 'write python("data.py:batches") for your function']),
])
def test_zdsl_check_positions_a_missing_file_function_or_bad_setting(tmp_path, data_file, data, words):
    errors = check_errors(HEADER + f"data {data}\n", tmp_path / "s.zs")
    assert len(errors) == 1, errors
    for w in words:
        assert w in errors[0], errors


def test_defines_reads_the_top_level_of_the_source(tmp_path):
    path = tmp_path / "m.py"
    cases = {"def batches(): pass": True, "batches = make()": True, "from x import y as batches": True,
             "import batches": True, "from x import *": True, "if True:\n    def batches(): pass": True,
             "try:\n    from a import batches\nexcept ImportError:\n    pass": True,
             "def other():\n    batches = 1": False, "class C:\n    batches = 1": False, "": False}
    for source, expected in cases.items():
        path.write_text(source)
        assert defines(path, "batches") is expected, source


def test_a_user_model_is_sized_from_one_row_of_the_functions_tensors():
    from zdsl.runtime.sizing import units_for_user_model
    model = ModelSpec("user", dict(features=12, hidden=32, classes=5, layers=1), factory=f"{CLASSIFIER}:build")
    data = DataSpec("python", f"{CLASSIFIER}:batches", {"features": 12, "classes": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # traced on meta, not estimated
        units = units_for_user_model(model, data=data)
    assert [u.input_elems_per_seq for u in units] == [12, 32, 32]
    assert units[0].fwd_flops_per_seq == 2 * 12 * 32        # one row through the first linear layer


def test_zdsl_check_sizes_a_user_model_with_the_data_and_positions_a_broken_function_at_data(tmp_path):
    (tmp_path / "data.py").write_text(FUNCTIONS)
    model = f'model "{CLASSIFIER}:build"(features=4, hidden=8, classes=3, layers=1)\n'
    from zdsl.driver import memo_units_for
    zs = tmp_path / "s.zs"
    zs.write_text("schedule s\n" + model + 'data python("data.py:batches", features=4)\n')
    s, _ = check_text(zs.read_text(), str(zs), units_for=memo_units_for())
    assert s.data.args == {"features": 4}
    text = "schedule s\n" + model + 'data python("data.py:triple")\n'
    zs.write_text(text)
    with pytest.raises(ZsError) as info:
        check_text(text, str(zs), units_for=memo_units_for())
    [d] = [d for d in info.value.diagnostics if d.is_error]
    assert d.span.line == 3 and "triple(seed=0, step=0, micro=0, rank=0, world=1, batch=1) returned a tuple of 3" \
        in d.message


def test_zdsl_check_of_python_data_for_a_builtin_model_does_not_import_torch(tmp_path, data_file):
    """The function is found from its source; only a model built to be sized runs it (and torch)."""
    import subprocess
    import sys
    zs = tmp_path / "s.zs"
    zs.write_text(HEADER + 'data python("data.py:tokens")\n')
    code = ("import contextlib, io, sys\nfrom zdsl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    assert main(['check', {str(zs)!r}]) == 0\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name, words", [
    ("tokens", None),
    ("batches", ["a float32 tensor of shape (4, 4) as inputs, but model gpt(...) takes token ids: an integer "
                 "(batch, tokens) tensor"]),
    ("big_ids", ["big_ids(seed=0, step=0, micro=0, rank=1, world=2, batch=4) returned id 256 in inputs (row 3, "
                 "token 7), not in 0..255, the model's vocab"]),
    ("ignored_labels", None),
    ("long_rows", ["17 tokens per row, more than the model's context 16"]),
    ("class_labels", ["an int64 tensor of shape (4,) as targets, but model gpt(...) takes one integer label per "
                      "input token (shape (4, 8))"]),
])
def test_the_preflight_checks_token_ids_for_a_builtin_model(tmp_path, name, words):
    path = tmp_path / "ids.py"
    path.write_text(FUNCTIONS + textwrap.dedent('''
        def big_ids(seed, step, micro, rank, world, batch):
            ids = torch.zeros(batch, 8, dtype=torch.long)
            ids[-1, -1] = 255 + rank
            return ids, ids
        def ignored_labels(seed, step, micro, rank, world, batch):
            ids = torch.full((batch, 8), 255)
            return ids, torch.full((batch, 8), -100)
        def long_rows(seed, step, micro, rank, world, batch):
            return torch.zeros(batch, 17, dtype=torch.long), torch.zeros(batch, 17, dtype=torch.long)
        def class_labels(seed, step, micro, rank, world, batch):
            return torch.zeros(batch, 8, dtype=torch.long), torch.zeros(batch, dtype=torch.long)
    '''))
    gpt = ModelSpec("gpt", dict(layers=1, width=32, heads=2, vocab=256, context=16))
    problem = python_problem(spec(path, name), 0, 2, 4, model=gpt)
    if words is None:
        assert problem is None
    else:
        for w in words:
            assert w in problem, problem
    assert python_problem(spec(path, name), 0, 2, 4, model=ModelSpec("user", {}, factory="x.py:build")) is None


def test_the_classifiers_data_gives_any_split_of_a_global_batch_the_same_samples():
    """Rows numbered as zdsl's sources number them: 2 ranks x 1 micro-batch of 4 == 1 rank x 2 micro-batches
    of 4 == 1 rank x 1 micro-batch of 8, at every step; another step or seed, other samples."""
    s = DataSpec("python", f"{CLASSIFIER}:batches", {"features": 6, "classes": 3})
    for step in (0, 5):
        whole = make_batch(s, 1, step, 0, 0, 1, 8)
        ranks = [make_batch(s, 1, step, 0, r, 2, 4) for r in range(2)]
        micros = [make_batch(s, 1, step, m, 0, 1, 4) for m in range(2)]
        for split in (ranks, micros):
            assert all(torch.equal(torch.cat([part[k] for part in split]), whole[k]) for k in range(2))
    assert not torch.equal(make_batch(s, 1, 1, 0, 0, 1, 8)[0], make_batch(s, 1, 0, 0, 0, 1, 8)[0])
    assert not torch.equal(make_batch(s, 2, 0, 0, 0, 1, 8)[0], make_batch(s, 1, 0, 0, 0, 1, 8)[0])
