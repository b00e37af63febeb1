"""Bad Hugging Face input is a positioned error with a way out, from `zdsl check` and `zdsl run`,
never a traceback. `zdsl check` runs in the test's process where no environment is set (a fresh
process would import transformers again: most of each check's time); `zdsl run` and the hub
cache's variables run it as a user does."""
from __future__ import annotations

import json
import subprocess

import pytest
from hf_tiny import save_tiny
from helpers import zdsl

from zdsl.check import model as model_checks
from zdsl.cli import main
from zdsl.check.checker import check_text
from zdsl.lang.errors import ZsError


def schedule(tmp_path, model: str) -> str:
    path = tmp_path / "run.zs"
    path.write_text(f"{model}\ndata synthetic(context=8)\ntrain steps=1, batch=1\nranks 2\nzero 3\n")
    return str(path)


def check(path, capsys) -> subprocess.CompletedProcess:
    """``zdsl check path`` in this process: its exit status and output, as a subprocess gives them."""
    capsys.readouterr()
    status = main(["check", str(path)])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["zdsl", "check", str(path)], status, out.out, out.err)


def failed(result, *words: str) -> str:
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "Traceback" not in out, out
    for word in words:
        assert word in out, out
    return out


def test_a_folder_without_config_json(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    failed(check(schedule(tmp_path, 'model hf("empty")'), capsys), "run.zs:1:10", "has no config.json")


def test_a_missing_folder_says_how_to_get_it(tmp_path, capsys):
    failed(check(schedule(tmp_path, 'model hf("org/nowhere")'), capsys), "run.zs:1:10",
           "local Hugging Face cache", "huggingface-cli download org/nowhere")


def test_an_unsupported_model_type(tmp_path, capsys):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    failed(check(schedule(tmp_path, 'model hf("bert")'), capsys), "run.zs:1:10", "'bert'",
           "gpt2, llama", '"file.py:build"')


def test_weights_whose_shapes_disagree_with_the_config(tmp_path, capsys):
    folder = save_tiny("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 300
    (folder / "config.json").write_text(json.dumps(config))
    failed(check(schedule(tmp_path, 'model hf("m")'), capsys), "run.zs:1:7",
           "'model.embed_tokens.weight'", "(256, 64)", "(300, 64)")


def test_an_override_that_changes_shapes_of_loaded_weights(tmp_path, capsys):
    save_tiny("gpt2", tmp_path / "m")
    failed(check(schedule(tmp_path, 'model hf("m", width=32)'), capsys), "'transformer.wte.weight'",
           "(256, 64)", "(256, 32)")


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_truncated_safetensors_file(tmp_path, command, capsys):
    folder = save_tiny("gpt2", tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    path = schedule(tmp_path, 'model hf("m")')
    failed(check(path, capsys) if command == "check" else zdsl(command, path), "run.zs:1:7",
           "model.safetensors is truncated")


def test_an_unknown_override_names_the_closest(tmp_path, capsys):
    save_tiny("llama", tmp_path / "m", weights=False)
    failed(check(schedule(tmp_path, 'model hf("m", layerz=1)'), capsys), "run.zs:1:15",
           "no setting 'layerz'", "did you mean 'layers'")


def test_data_longer_than_the_model(tmp_path, capsys):
    save_tiny("llama", tmp_path / "m", weights=False)
    path = tmp_path / "long.zs"
    path.write_text('model hf("m")\ndata synthetic(context=64)\n')
    failed(check(str(path), capsys), "long.zs:2:16", "data context 64 is longer than the model's context 32")


def test_without_transformers_the_extra_is_named(tmp_path, monkeypatch):
    save_tiny("llama", tmp_path / "m", weights=False)
    monkeypatch.setattr(model_checks, "transformers_installed", lambda: False)
    with pytest.raises(ZsError) as err:
        check_text('model hf("m")\n', str(tmp_path / "s.zs"))
    d = err.value.diagnostics[0]
    assert (d.span.line, d.span.column) == (1, 7) and "pip install 'zdsl[hf]'" in d.hint


def test_a_hub_id_is_found_in_the_local_cache_only(tmp_path):
    snapshot = tmp_path / "cache" / "models--org--tiny" / "snapshots" / "abc123"
    save_tiny("llama", snapshot, weights=False)
    (tmp_path / "cache" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "cache" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    ok = zdsl("check", schedule(tmp_path, 'model hf("org/tiny")'),
              env={"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    failed(zdsl("check", schedule(tmp_path, 'model hf("org/other")'),
                env={"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}), "run.zs:1:10")
