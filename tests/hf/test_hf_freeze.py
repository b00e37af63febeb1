"""``freeze`` on a Hugging Face model matches its own names (``model.embed_tokens.weight``,
``model.layers.0.*``) as well as zdsl's unit-local ones, and an unmatched one names the closest."""
from __future__ import annotations

import pytest

from hf_tiny import save_tiny
from zdsl.model.freeze import FreezeError
from zdsl.model.freeze import frozen_params
from zdsl.compile.models import units_for
from zdsl.schedule import ModelSpec


@pytest.fixture(scope="module")
def llama_units(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("llama") / "m", weights=False)
    return units_for(ModelSpec("hf", {}, path=str(folder)), 16)


def test_hf_names_and_unit_names_both_match(llama_units):
    by_hf = frozen_params(llama_units, ("model.embed_tokens.weight", "model.layers.0.*", "*input_layernorm*"))
    assert by_hf[0] == [True] and all(by_hf[1])
    assert [name for (name, _), f in zip(llama_units[2].params, by_hf[2]) if f] == ["layer.input_layernorm.weight"]
    assert frozen_params(llama_units, ("embed_tokens.*",))[0] == [True]


def test_an_unmatched_pattern_names_hf_names(llama_units):
    with pytest.raises(FreezeError) as info:
        frozen_params(llama_units, ("model.embed_token.weight",))
    assert "model.embed_tokens.weight" in info.value.hint
