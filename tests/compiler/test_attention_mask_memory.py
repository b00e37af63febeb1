"""The plan counts the built-in GPT's attention mask: rows from ``jsonl(...)`` (padded or packed) make
the model hold one (B, 1, T, T) mask per micro-batch in the blocks' dtype (runtime/models/gpt.py;
tests/runtime/test_gpt_attention_mask.py measures it); plain token data needs none."""
from __future__ import annotations

from pathlib import Path

import pytest

from zdsl.driver import compile_file

PROGRAMS = Path(__file__).resolve().parents[2] / "programs"
BATCH, CONTEXT = 4, 64


def _plan(tmp_path: Path, data: str, precision: str):
    path = tmp_path / f"{precision}_{data.split('(')[0]}.zs"
    path.write_text(f"""\
model     gpt(layers=2, width=64, heads=4, vocab=4096, context={CONTEXT})
data      {data}
train     steps=3, batch={BATCH}, precision={precision}
ranks     1 on cpu
""")
    compiled = compile_file(str(path), {}, simulate=True)
    assert compiled.ok, [d.message for d in compiled.diagnostics]
    return compiled.sim.memory


@pytest.mark.parametrize("precision, elem", [("fp32", 4), ("bf16", 2)])
def test_masked_rows_add_one_mask_to_the_device_peak(tmp_path, precision, elem):
    jsonl = (f'jsonl("{PROGRAMS / "data" / "sft.jsonl"}", tokenizer="{PROGRAMS / "tokenizer.json"}", '
             f'pack=true, context={CONTEXT})')
    masked = _plan(tmp_path, jsonl, precision)
    plain = _plan(tmp_path, f"synthetic(context={CONTEXT}, vocab=4096)", precision)
    mask = BATCH * CONTEXT * CONTEXT * elem
    assert masked.peak("device") - plain.peak("device") == mask
    assert masked.working_at_peak("device")["activations"] - plain.working_at_peak("device")["activations"] == mask
