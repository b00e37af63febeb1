"""An HF model's sizing is kept in the cache folder (zdsl/compile/sizing_cache.py): the next command
on the same folder gets the same units without building the model, and anything the units depend on
sizes it afresh."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hf_tiny import save_tiny

from zdsl.compile import sizing_cache
from zdsl.compile.models import units_for
from zdsl.schedule import ModelSpec


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "sizing"


def spec(folder, **args) -> ModelSpec:
    return ModelSpec("hf", args, path=str(folder))


def no_runtime_sizing(monkeypatch):
    """Sizing through the runtime fails from here on: what comes back came from the cache."""
    monkeypatch.setitem(sys.modules, "zdsl.runtime.sizing", None)


def test_a_second_sizing_of_the_same_folder_is_the_first_ones_units(tmp_path, cache, monkeypatch):
    folder = save_tiny("llama", tmp_path / "m")
    first = units_for(spec(folder), 16)
    assert len(list(cache.iterdir())) == 1
    no_runtime_sizing(monkeypatch)
    assert units_for(spec(folder), 16) == first
    with pytest.raises(Exception):           # another length is another sizing
        units_for(spec(folder), 32)


def test_a_changed_config_override_or_weights_file_sizes_afresh(tmp_path, cache):
    folder = save_tiny("gpt2", tmp_path / "m")
    first = units_for(spec(folder), 16)
    assert units_for(spec(folder, layers=1), 16) != first          # an override
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": 1}))
    assert units_for(spec(folder), 16) == units_for(spec(folder, layers=1), 16) != first
    (folder / "model.safetensors").write_bytes(b"\0" * 16)         # a weights file the sizing checks
    with pytest.raises(Exception, match="safetensors"):
        units_for(spec(folder), 16)


def test_an_unreadable_cache_entry_is_a_miss(tmp_path, cache):
    folder = save_tiny("gpt2", tmp_path / "m")
    first = units_for(spec(folder), 16)
    [entry] = cache.iterdir()
    entry.write_text("{not json")
    assert units_for(spec(folder), 16) == first
    assert json.loads(entry.read_text())["format"] == sizing_cache.FORMAT     # written again whole


# The key stamps the compiler's and runtime's files once per process, as it finds them; the tree may be
# edited between this process's sizing and the command's (another engineer's save, a mutation check),
# so both take one stamp (that an edit is another key: tests/compiler/test_user_sizing_cache.py).
STAMP = "one code for both commands"
PINNED_CODE = f"from zdsl.compile import sizing_cache; sizing_cache._code = {STAMP!r}; "


def test_zdsl_check_of_a_sized_folder_imports_neither_torch_nor_transformers(tmp_path, cache, monkeypatch):
    from zdsl.driver import compile_file
    monkeypatch.setattr(sizing_cache, "_code", STAMP)
    save_tiny("gpt2", tmp_path / "model")
    (tmp_path / "s.zs").write_text('schedule s\nmodel hf("model")\ndata synthetic(vocab=200, context=16)\n'
                                   "train steps=1, batch=2\nranks 2 on cpu\nzero 3\n")
    assert compile_file(str(tmp_path / "s.zs"), {}).ok           # sized here, as zdsl check sizes it
    probe = (PINNED_CODE + "import sys; from zdsl.cli import main; code = main(['check', 's.zs']); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "s.zs: ok (4 units" in run.stdout and run.stdout.splitlines()[-1] == "[]"


def test_a_sizing_that_fell_back_to_estimates_is_not_kept(tmp_path, cache, monkeypatch):
    import zdsl.runtime.sizing as sizing

    def cannot_trace(*args, **kwargs):
        raise RuntimeError("data-dependent control flow")
    monkeypatch.setattr(sizing, "_measure", cannot_trace)
    folder = save_tiny("gpt2", tmp_path / "m")
    for _ in range(2):                       # said each time, as it is sized each time
        with pytest.warns(UserWarning, match="flops and activations are estimates"):
            units_for(spec(folder), 16)
    assert not cache.exists() or not list(cache.iterdir())
