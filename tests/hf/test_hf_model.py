"""HF families as zdsl units, in one process: the same numbers as transformers, causal attention
whatever the attention implementation, names that map back to the checkpoint, seeded init."""
from __future__ import annotations

import pytest
import torch
from hf_tiny import CONFIGS, CONTEXT, VOCAB, save_tiny, transformers_loss, transformers_model

from zdsl.model.hf_folder import HF_FAMILIES, HfModelError
from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.hf import FAMILIES, load
from zdsl.schedule import ModelSpec

FAMILY_NAMES = list(CONFIGS)


def zdsl_model(folder, seed: int = 0, **overrides):
    return load(ModelSpec("hf", overrides, path=str(folder)), seed=seed)


def logits(model, batch: Batch) -> torch.Tensor:
    """The head's logits for ``batch``, the units run as zdsl runs them."""
    model.prepare(batch)
    x = batch.input_ids
    for unit in model.units()[:-1]:
        x = unit(x, batch)
    return model.units()[-1].logits(x)


def windows(batch: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, CONTEXT + 1), generator=g)


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def pretrained(request, tmp_path_factory):
    return request.param, save_tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_every_family_is_built():
    assert tuple(FAMILIES) == HF_FAMILIES == tuple(CONFIGS)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_loss_is_transformers_loss(pretrained, attn):
    _, folder = pretrained
    rows = windows()
    idx, targets = rows[:, :-1], rows[:, 1:]
    with torch.no_grad():
        ours = zdsl_model(folder, attn_implementation=attn)(idx, targets)
        theirs = transformers_loss(transformers_model(folder, attn), idx, targets)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


def test_eager_and_sdpa_agree(pretrained):
    _, folder = pretrained
    rows = windows(seed=2)
    with torch.no_grad():
        eager, sdpa = (zdsl_model(folder, attn_implementation=a)(rows[:, :-1], rows[:, 1:]) for a in ("eager", "sdpa"))
    assert float(eager) == pytest.approx(float(sdpa), rel=1e-6)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_is_causal(pretrained, attn):
    """A later token changes no earlier position's logits (and does change its own)."""
    _, folder = pretrained
    model = zdsl_model(folder, attn_implementation=attn)
    ids = windows()[:, :-1]
    changed = ids.clone()
    k = CONTEXT // 2
    changed[:, k] = (changed[:, k] + 1) % VOCAB
    with torch.no_grad():
        before = logits(model, Batch(ids, ids))
        after = logits(model, Batch(changed, changed))
    assert torch.equal(before[:, :k], after[:, :k])
    assert not torch.allclose(before[:, k:], after[:, k:])


def test_padding_is_not_seen(pretrained):
    """Keys marked padding by the attention mask are invisible to every real position."""
    _, folder = pretrained
    model = zdsl_model(folder, attn_implementation="eager")
    ids = windows()[:, :-1]
    mask = torch.ones_like(ids)
    mask[:, 3:5] = 0
    other = ids.clone()
    other[:, 3:5] = (other[:, 3:5] + 7) % VOCAB
    with torch.no_grad():
        a = logits(model, Batch(ids, ids, attention_mask=mask))
        b = logits(model, Batch(other, other, attention_mask=mask))
    assert torch.equal(a[:, 5:], b[:, 5:])
    assert torch.equal(a[:, :3], b[:, :3])


def test_names_map_to_the_checkpoint(pretrained):
    family, folder = pretrained
    model = zdsl_model(folder)
    theirs = transformers_model(folder)
    names = dict(theirs.named_parameters())          # a tied lm_head appears once, as the embedding
    assert sorted(model.hf_names().values()) == sorted(names)
    ours = {model.hf_name(u, n): p for u, unit in enumerate(model.units()) for n, p in unit.named_parameters()}
    for name, p in ours.items():
        assert torch.equal(p, names[name]), name
    assert bool(model.tied) == (family == "gpt2")


def test_seeded_init_from_config_alone(tmp_path):
    for family in FAMILY_NAMES:
        folder = save_tiny(family, tmp_path / family, weights=False)
        state = torch.random.get_rng_state()
        a, b, c = zdsl_model(folder, seed=3), zdsl_model(folder, seed=3), zdsl_model(folder, seed=4)
        assert torch.equal(torch.random.get_rng_state(), state)        # torch's global RNG untouched
        pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
        assert not all(torch.equal(pa[n], pc[n]) for n in pa)
        std = a.config.initializer_range
        for name, p in pa.items():
            if name.endswith("bias"):
                assert not p.any(), name
            elif "norm" in name or ".ln_" in name:
                assert torch.equal(p, torch.ones_like(p)), name
            elif p.numel() > 1000 and "c_proj" not in name:
                assert p.std().item() == pytest.approx(std, rel=0.1), name


def test_overrides_shrink_the_model(tmp_path):
    folder = save_tiny("llama", tmp_path / "llama", weights=False)
    model = zdsl_model(folder, layers=1, width=32, heads=4, ffn=48)
    assert len(model.units()) == 3
    assert model.config.head_dim == 8 and model.config.num_key_value_heads == 2    # head_dim follows
    assert model.units()[1].layer.mlp.up_proj.weight.shape == (48, 32)
    gpt = zdsl_model(save_tiny("gpt2", tmp_path / "gpt2", weights=False), layers=3, context=8, hidden_size=32)
    assert len(gpt.units()) == 5 and gpt.units()[0].wpe.weight.shape == (8, 32)
    with pytest.raises(HfModelError) as err:
        zdsl_model(folder, layerz=2)
    assert err.value.key == "layerz" and "layers" in err.value.hint
    with pytest.raises(HfModelError) as err:
        zdsl_model(save_tiny("gpt2", tmp_path / "g", weights=False), kv_heads=2)
    assert err.value.key == "kv_heads"


def test_sizing_on_meta_reads_no_weights(pretrained):
    _, folder = pretrained
    with torch.device("meta"):
        model = zdsl_model(folder)
    assert all(p.is_meta for p in model.parameters())
    batch = Batch(torch.zeros(1, 8, dtype=torch.long, device="meta"), torch.zeros(1, 8, dtype=torch.long, device="meta"))
    assert model(batch).is_meta


def test_sharded_weights_and_unprefixed_names_load(tmp_path):
    """Shards listed by model.safetensors.index.json; GPT-2's original files, whose names lack
    the ``transformer.`` prefix: both load to transformers' numbers."""
    from safetensors.torch import load_file, save_file
    rows = windows(seed=3)
    for family in ("llama", "gpt2"):
        folder = save_tiny(family, tmp_path / family)
        with torch.no_grad():
            expected = float(transformers_loss(transformers_model(folder), rows[:, :-1], rows[:, 1:]))
        sharded = tmp_path / f"{family}-sharded"
        transformers_model(folder).save_pretrained(sharded, max_shard_size="40KB")
        assert (sharded / "model.safetensors.index.json").is_file()
        with torch.no_grad():
            assert float(zdsl_model(sharded)(rows[:, :-1], rows[:, 1:])) == pytest.approx(expected, rel=1e-6)
    tensors = load_file(tmp_path / "gpt2" / "model.safetensors")
    save_file({k.removeprefix("transformer."): v.contiguous() for k, v in tensors.items()},
              tmp_path / "gpt2" / "model.safetensors")
    assert not any(k.startswith("transformer.") for k in load_file(tmp_path / "gpt2" / "model.safetensors"))
    with torch.no_grad():
        loss = zdsl_model(tmp_path / "gpt2")(rows[:, :-1], rows[:, 1:])
        expected = transformers_loss(transformers_model(tmp_path / "gpt2-sharded"), rows[:, :-1], rows[:, 1:])
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
