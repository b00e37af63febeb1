"""`--format hf` export: a trained `model hf(...)` goes back to a folder transformers loads.

Two tiny models train 2 steps at 2 ranks, ZeRO-3, with a checkpoint after step 2 and
`zdsl run --export DIR --format hf`: a GPT-2 from a folder with weights (tied embeddings) and a
Llama from config.json alone with an override (untied, 3 layers where the folder says 2: only a
config.json written as trained loads without unexpected or missing keys). The checkpoint is then
exported with `zdsl export --format hf` (fp32, bf16, sharded) and the folders loaded with
`AutoModelForCausalLM.from_pretrained`.

The logits check compares transformers' model from the HF folder against zdsl's own model:
the same checkpoint exported as a plain state dict (zdsl's names, the other export path), loaded
strictly into the zdsl model built from the schedule's model spec, run through its units. So the
HF export's name mapping, config and tied weights are checked against an independent path, on
weights that training moved away from the source folder's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_tiny import CONTEXT, VOCAB, save_tiny
from helpers import sized
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from zdsl.runtime.models.batch import Batch
from zdsl.schedule import ModelSpec

ROOT = Path(__file__).parents[2]
FAMILIES = {               # family: (model statement's arguments, source folder saved with weights?)
    "gpt2": ("", True),
    "llama": (", layers=3", False),
}
TOKENIZER = {"model_max_length": CONTEXT, "tokenizer_class": "PreTrainedTokenizerFast"}


def zdsl(*args, cwd, ok=True):
    env = dict(os.environ)
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def export_here(work: Path, source: str, out: str, *options) -> None:
    """``zdsl export`` of ``work / source`` into ``work / out``, in this process (a fresh one would
    import torch and transformers again: most of a small export's time)."""
    from zdsl.cli import main
    assert main(["export", str(work / source), "-o", str(work / out), *map(str, options)]) == 0


def schedule_text(family: str) -> str:
    args, _ = FAMILIES[family]
    return (f'schedule {family}_export "export test"\n'
            f'model     hf("{family}"{args})\n'
            f"data      synthetic(vocab={VOCAB}, context={CONTEXT})\n"
            "train     steps=2, batch=2, precision=fp32\n"
            "optimizer adamw(lr=1e-2)\n"
            "ranks     2 on cpu\n"
            "zero      3\n")


def load_hf(folder):
    model, info = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    return model.eval(), info


def clean(info: dict) -> bool:
    return not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, tmp_path_factory):
    """A family's source folder, its checkpoint after 2 steps, the run's export and the checkpoint's."""
    family = request.param
    work = tmp_path_factory.mktemp(family)
    source = save_tiny(family, work / family, weights=FAMILIES[family][1],
                       **({"tie_word_embeddings": False} if family == "llama" else {}))
    (source / "tokenizer_config.json").write_text(json.dumps(TOKENIZER))
    (work / "run.zs").write_text(schedule_text(family))
    sized(work / "run.zs")
    zdsl("run", "run.zs", "--quiet", "--checkpoint-every", 2, "--checkpoint-dir", "ck", "--export", "run_hf",
         "--format", "hf", cwd=work)
    export_here(work, "ck", "ck_hf", "--format", "hf")
    return family, work


def zdsl_logits(work: Path, family: str, ids: torch.Tensor) -> torch.Tensor:
    """zdsl's model (spec as the schedule gives it) with the checkpoint's plain export, strictly."""
    from zdsl.runtime.checkpoint import export
    from zdsl.runtime.models.hf import load
    from safetensors.torch import load_file
    export(work / "ck", work / "plain.safetensors")
    overrides = {"layers": 3} if family == "llama" else {}
    model = load(ModelSpec("hf", overrides, path=str(work / family)))
    model.load_state_dict(load_file(str(work / "plain.safetensors")), strict=True)
    batch = Batch(input_ids=ids, labels=torch.zeros_like(ids))
    with torch.no_grad():
        model.prepare(batch)
        x = ids
        for unit in model.units()[:-1]:
            x = unit(x, batch)
        return model.units()[-1].logits(x)


@pytest.mark.slow
def test_checkpoint_export_loads_without_missing_or_unexpected_keys(trained):
    family, work = trained
    model, info = load_hf(work / "ck_hf")
    assert clean(info), info
    config = json.loads((work / "ck_hf" / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == [type(model).__name__]
    assert model.config.num_hidden_layers == (3 if family == "llama" else 2)    # the override, as trained


@pytest.mark.slow
def test_logits_equal_zdsl_models(trained):
    family, work = trained
    ids = torch.randint(0, VOCAB, (3, CONTEXT), generator=torch.Generator().manual_seed(1))
    model, _ = load_hf(work / "ck_hf")
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    ours = zdsl_logits(work, family, ids)
    assert (theirs - ours).abs().max() <= 1e-6
    if FAMILIES[family][1]:      # trained: the source folder's weights give other logits
        source, _ = load_hf(work / family)
        with torch.no_grad():
            assert (source(input_ids=ids).logits - ours).abs().max() > 1e-3


@pytest.mark.slow
def test_run_export_is_the_checkpoints(trained):
    family, work = trained
    model, info = load_hf(work / "run_hf")
    assert clean(info), info
    ran, saved = weights(work / "run_hf"), weights(work / "ck_hf")
    assert ran.keys() == saved.keys() and all(torch.equal(ran[k], saved[k]) for k in saved)
    assert not (work / "run_hf" / ".zdsl-state.safetensors").exists()


@pytest.mark.slow
def test_tied_weights_written_once_untied_both(trained):
    family, work = trained
    names = weights(work / "ck_hf")
    model, _ = load_hf(work / "ck_hf")
    if family == "gpt2":
        assert "transformer.wte.weight" in names and "lm_head.weight" not in names
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    else:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= names.keys()
        assert not torch.equal(names["model.embed_tokens.weight"], names["lm_head.weight"])
        assert torch.equal(model.lm_head.weight, names["lm_head.weight"])


@pytest.mark.slow
def test_bf16_export_loads_as_bf16(trained):
    family, work = trained
    export_here(work, "ck", "bf16", "--format", "hf", "--dtype", "bf16")
    model, info = load_hf(work / "bf16")
    assert clean(info), info
    assert model.dtype == torch.bfloat16
    assert json.loads((work / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    fp32 = weights(work / "ck_hf")
    assert all(torch.equal(t, fp32[k].to(torch.bfloat16)) for k, t in weights(work / "bf16").items())


@pytest.mark.slow
def test_sharded_export_has_an_index_and_loads(trained):
    family, work = trained
    export_here(work, "ck", "sharded", "--format", "hf", "--max-shard-size", "100KB")
    index = json.loads((work / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (work / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and "model.safetensors" not in shards
    assert set(index["weight_map"].values()) == set(shards)
    whole = weights(work / "ck_hf")
    assert index["weight_map"].keys() == whole.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    model, info = load_hf(work / "sharded")
    assert clean(info), info
    assert all(torch.equal(model.state_dict()[k], t) for k, t in whole.items())
    # exported again unsharded into the same folder: the old shards and index go
    export_here(work, "ck", "sharded", "--format", "hf")
    assert sorted(p.name for p in (work / "sharded").glob("model*")) == ["model.safetensors"]


@pytest.mark.slow
def test_tokenizer_files_are_copied(trained):
    family, work = trained
    assert json.loads((work / "ck_hf" / "tokenizer_config.json").read_text()) == TOKENIZER
    assert json.loads((work / "run_hf" / "tokenizer_config.json").read_text()) == TOKENIZER


@pytest.mark.slow
def test_hf_format_of_a_gpt_model_is_a_clear_error(tmp_path):
    quick = ROOT / "programs" / "quickstart.zs"
    proc = zdsl("run", quick, "--quiet", "--export", "out", "--format", "hf", cwd=tmp_path, ok=False)
    assert proc.returncode == 2 and "applies to `model hf(...)` models" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    zdsl("run", quick, "--quiet", "--set", "steps=1", "--checkpoint-every", 1, "--checkpoint-dir", "ck", cwd=tmp_path)
    proc = zdsl("export", "ck", "-o", "out", "--format", "hf", cwd=tmp_path, ok=False)
    assert proc.returncode == 1 and "applies to `model hf(...)` models" in proc.stderr
    assert "Traceback" not in proc.stderr
    plain = zdsl("export", "ck", "-o", "out.safetensors", cwd=tmp_path)      # the plain export stays
    assert "wrote" in plain.stdout


def test_bad_shard_size_is_refused_before_training(tmp_path):
    proc = zdsl("run", ROOT / "programs" / "quickstart.zs", "--export", "out", "--format", "hf",
                "--max-shard-size", "lots", cwd=tmp_path, ok=False)
    assert proc.returncode == 2 and "max shard size 'lots'" in proc.stderr and "Traceback" not in proc.stderr
    proc = zdsl("run", ROOT / "programs" / "quickstart.zs", "--format", "hf", cwd=tmp_path, ok=False)
    assert proc.returncode == 2 and "give --export DIR" in proc.stderr


def test_shard_sizes():
    from zdsl.runtime.checkpoint.export_hf import parse_size, plan_shards
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 << 20 and parse_size("4096") == 4096
    specs = [("a", "F32", (100,)), ("b", "F32", (100,)), ("c", "F32", (300,)), ("d", "F32", (10,))]
    assert plan_shards(specs, 800) == [[0, 1], [2], [3]]      # 400 + 400 fit, 1200 alone, then the rest
    assert plan_shards(specs, 10**9) == [[0, 1, 2, 3]]
