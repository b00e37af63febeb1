"""``data synthetic(vocab=N, context=N)``: learnable token streams made from the sample's key, no
file (``zdsl/runtime/data/synthetic.py``); its vocab and context default to the model's."""
from __future__ import annotations

from zdsl.sources.base import DataSource


class SyntheticSource(DataSource):
    kind = "synthetic"
    settings = ("context", "vocab")
    example = "synthetic(vocab=256, context=64)"
    vocab_from_model = True


SOURCE = SyntheticSource()
