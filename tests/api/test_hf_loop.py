"""A Hugging Face causal LM in the user's own loop: ``initialize(..., model=hf_model)``.

One rank in-process, ZeRO-3, tiny configs built here (no downloads). The engine returns the
logits and the loop computes its own next-token loss from them; it must equal transformers' own
``model(input_ids, labels=...)`` loss at step 0, and the same loop in plain torch (the same
instance copied, torch's AdamW as the schedule names it) step by step and in the final weights,
all to the bit (one rank: the same layers, sums and updates in the same order).
``engine.export(DIR, format="hf")`` must give a folder ``from_pretrained`` loads, holding the
trained weights.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zdsl
from zdsl.errors import ZdslApiError
from zdsl.runtime.checkpoint.export_hf import hf_names_by_key
from zdsl.runtime.state.optim import make_torch_optimizer

sys.path.insert(0, str(Path(__file__).parents[1] / "hf"))
from hf_tiny import CONFIGS, VOCAB, save_tiny  # noqa: E402

transformers = pytest.importorskip("transformers")
CONTEXT, ROWS, STEPS = 16, 2, 3
SCHEDULE = f"""schedule hf_loop "a transformers model in the user's loop"
data      synthetic(vocab={VOCAB}, context={CONTEXT})
train     steps={STEPS}, batch={ROWS}, precision=fp32
optimizer adamw(lr=1e-2)
ranks     1 on cpu
zero      3
"""


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The user's loss: each position predicts the next token (transformers' shift, done by hand)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, CONTEXT), generator=g) for _ in range(STEPS)]


def tiny(family: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()   # eval: no dropout


def torch_loop(model, data, optimizer: dict) -> list[float]:
    """The reference: the same loop in plain torch on ``model`` itself."""
    opt = make_torch_optimizer(model.parameters(), optimizer)
    losses = []
    for ids in data:
        loss = next_token_loss(model(ids).logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_user_loss_equals_transformers_and_torch_loop(tmp_path, family):
    model = tiny(family)
    reference = copy.deepcopy(model)
    data = batches()
    with torch.no_grad():
        hf_loss = float(model(input_ids=data[0], labels=data[0]).loss)
    zs = tmp_path / "hf.zs"
    zs.write_text(SCHEDULE)
    losses = []
    with zdsl.initialize(zs, model=model) as engine:
        for ids in data:
            logits = engine(ids)
            assert logits.shape == (ROWS, CONTEXT, VOCAB)
            loss = next_token_loss(logits, ids)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        optimizer = engine.run.graph.config["optimizer"]
        trained = engine.state_dict()
        names = hf_names_by_key(engine.run.model)
        engine.export(tmp_path / "out", format="hf")
    # to the bit: one rank, transformers' own layers, the same order of every sum and update
    assert losses[0] == hf_loss
    assert losses == torch_loop(reference, data, optimizer)
    ref_params = dict(reference.named_parameters())
    by_hf = {hf_name: trained[key] for key, hf_name in names.items()}
    assert set(by_hf) <= set(ref_params) and len(by_hf) == len(trained)
    for hf_name, value in by_hf.items():
        assert not torch.equal(value, model.get_parameter(hf_name).detach()), f"{hf_name} did not train"
        assert torch.equal(value, ref_params[hf_name].detach()), hf_name
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    loaded_params = dict(loaded.named_parameters())
    for hf_name, value in by_hf.items():
        assert torch.equal(loaded_params[hf_name].detach(), value), hf_name


def test_a_folder_trains_as_its_instance_would(tmp_path):
    folder = save_tiny("llama", tmp_path / "llama")
    ids = batches()[0]
    with torch.no_grad():
        hf_loss = transformers.AutoModelForCausalLM.from_pretrained(folder)(input_ids=ids, labels=ids).loss.item()
    zs = tmp_path / "hf.zs"
    zs.write_text(SCHEDULE)
    with zdsl.initialize(zs, model=str(folder)) as engine:
        loss = next_token_loss(engine(ids), ids)
        assert loss.item() == hf_loss
        engine.backward(loss)
        engine.step()
        with pytest.raises(ZdslApiError, match='format="plain"|the formats are "hf"'):
            engine.export(tmp_path / "out", format="plain")


def test_a_family_zdsl_does_not_split_is_refused(tmp_path):
    config = transformers.OPTConfig(hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                                    vocab_size=VOCAB, max_position_embeddings=32, word_embed_proj_dim=16)
    zs = tmp_path / "hf.zs"
    zs.write_text(SCHEDULE)
    with pytest.raises(ZdslApiError, match=r"not 'opt'.*zdsl\.units"):
        zdsl.initialize(zs, model=transformers.OPTForCausalLM(config))
