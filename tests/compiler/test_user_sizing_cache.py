"""A user's model (``model "file.py:build"``) is sized once and kept in the cache folder
(zdsl/compile/sizing_cache.py), like an HF folder: the next command gets the same units without
torch, and an edit to the factory's file, a file beside it, any file of the user's it loaded or
any file it read sizes it afresh."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zdsl.compile import sizing_cache
from zdsl.compile.models import units_for
from zdsl.schedule import ModelSpec

MODEL = '''from helper import layers
from user_models import build as small_lm


def build(hidden: int = 8, context: int = 16):
    return small_lm(hidden=hidden, context=context, layers=layers())
'''


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "sizing"


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A factory file importing a helper beside it; each test imports the helper afresh."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.py").write_text(MODEL)
    (tmp_path / "m" / "helper.py").write_text("def layers():\n    return 2\n")
    monkeypatch.delitem(sys.modules, "helper", raising=False)
    return tmp_path / "m"


def spec(folder, factory: str = "build", **args) -> ModelSpec:
    return ModelSpec("user", {"hidden": 8, **args}, factory=f"{folder / 'model.py'}:{factory}")


def no_runtime_sizing(monkeypatch):
    """Sizing through the runtime fails from here on: what comes back came from the cache."""
    monkeypatch.setitem(sys.modules, "zdsl.runtime.sizing", None)


def test_a_second_sizing_of_the_same_factory_is_the_first_ones_units(model, cache, monkeypatch):
    first = units_for(spec(model), 16)
    assert len(first) == 4 and len(list(cache.iterdir())) == 1
    held = sizing_cache.load(sizing_cache.sizing_key(spec(model), 16, None))
    assert held == first
    no_runtime_sizing(monkeypatch)
    assert units_for(spec(model), 16) == first
    with pytest.raises(Exception):           # other arguments are another sizing
        units_for(spec(model, hidden=16), 16)


def test_an_edited_helper_or_factory_file_sizes_afresh(model, cache, monkeypatch):
    (model / "settings.json").write_text("{}")
    first = units_for(spec(model), 16)
    (model / "helper.py").write_text("def layers():\n    return 3    # one more\n")
    monkeypatch.delitem(sys.modules, "helper")       # a new command: a new process imports it afresh
    assert len(units_for(spec(model), 16)) == len(first) + 1
    (model / "model.py").write_text(MODEL.replace("layers=layers()", "layers=1"))
    assert len(units_for(spec(model), 16)) == len(first) - 1
    key = sizing_cache.sizing_key(spec(model), 16, None)
    assert sizing_cache.load(key) is not None
    (model / "settings.json").write_text('{"layers": 3}')     # a file beside the factory's: it may read it
    assert sizing_cache.load(key) is None
    units_for(spec(model), 16)
    (model / "helper.py").unlink()                   # a source gone: a miss, never an error
    assert sizing_cache.load(key) is None


READS = '''import json
import os
from user_models import build as small_lm


def build(hidden: int = 8, context: int = 16):
    with open(os.environ["TEST_SIZING_LOG"], "a") as log:      # written, not read: not a source
        log.write("sized\\n")
    conf = json.load(open({conf!r}))
    return small_lm(hidden=hidden, context=context, layers=conf["layers"])
'''


def test_a_file_the_factory_reads_from_another_folder_sizes_it_afresh_when_it_changes(
        tmp_path, model, cache, monkeypatch):
    conf = tmp_path / "elsewhere" / "conf.json"
    conf.parent.mkdir()
    conf.write_text('{"layers": 2}')
    monkeypatch.setenv("TEST_SIZING_LOG", str(tmp_path / "sized.log"))
    (model / "model.py").write_text(READS.format(conf=str(conf)))
    first = units_for(spec(model), 16)
    key = sizing_cache.sizing_key(spec(model), 16, None)
    assert sizing_cache.load(key) == first             # the log it writes does not make it a miss
    conf.write_text('{"layers": 3}')
    assert sizing_cache.load(key) is None
    assert len(units_for(spec(model), 16)) == len(first) + 1
    assert (tmp_path / "sized.log").read_text().count("sized") == 2


def test_a_factory_named_by_module_is_not_kept(cache):
    assert sizing_cache.sizing_key(ModelSpec("user", {}, factory="user_models:build"), 16, None) is None


def test_an_edited_compiler_or_runtime_file_is_another_key(model, tmp_path, monkeypatch):
    """Why the commands below pin the code's stamp: the key holds every compiler and runtime file's
    mtime, so another engineer's save in the same tree between two commands is a miss."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "lower.py").write_text("x = 1\n")
    monkeypatch.setattr(sizing_cache, "_code_roots", lambda: [code])
    monkeypatch.setattr(sizing_cache, "_code", None)
    key = sizing_cache.sizing_key(spec(model), 16, None)
    assert key is not None and sizing_cache.sizing_key(spec(model), 16, None) == key
    st = (code / "lower.py").stat()
    os.utime(code / "lower.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1))     # saved again, same bytes
    monkeypatch.setattr(sizing_cache, "_code", None)                          # by the next command
    assert sizing_cache.sizing_key(spec(model), 16, None) != key


# Each command stamps the compiler's and runtime's files as it finds them; the tree may be edited
# between two commands (by another engineer or a mutation check), so both take this one stamp.
PINNED_CODE = "from zdsl.compile import sizing_cache; sizing_cache._code = 'one code for both commands'; "


def test_zdsl_check_of_a_sized_user_model_does_not_import_torch(model, cache):
    (model / "s.zs").write_text('schedule s\nmodel "model.py:build"(hidden=8, context=16)\n'
                                "data synthetic(vocab=64, context=16)\ntrain steps=1, batch=2\n"
                                "ranks 2 on cpu\nzero 3\n")
    # a copy beside the factory: the tests folder's, a source of the sizing, may be edited meanwhile
    shutil.copy(Path(__file__).resolve().parents[1] / "user_models.py", model)
    probe = (PINNED_CODE + "import sys; from zdsl.cli import main; code = main(['check', 's.zs']); "
             "print('torch' in sys.modules); sys.exit(code)")
    runs = [subprocess.run([sys.executable, "-c", probe], cwd=model, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert "s.zs: ok (4 units" in runs[1].stdout and "estimates" not in runs[0].stderr
    assert [r.stdout.splitlines()[-1] for r in runs] == ["True", "False"]
