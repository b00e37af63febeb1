"""A micro-batch's extras (attention masks, rotary tables) as the runtime holds them and the plan
counts them. They live from the micro-batch's first forward to its last backward, one micro-batch's
at a time when micro-batches run one after another (accumulate > 1 held every micro-batch's for the
whole step, the plan one), and the plan counts them in the ``act`` of the micro-batch's first unit
with a backward, which lives as long: the meter's ``extras`` peak is the planned figure for the
built-in GPT and Hugging Face models, in fp32 and bf16, on padded or packed rows (``jsonl``) and on
plain ones (an HF model's causal mask, shared by the rows)."""
from __future__ import annotations

from pathlib import Path

import pytest

from sft_data import sft_records
from sft_data import train_tokenizer
from sft_data import write_jsonl

from zdsl.driver import compile_file

BATCH, CONTEXT, ACCUMULATE = 3, 16, 3
ELEM = {"fp32": 4, "bf16": 2}


def _compile(tmp_path: Path, model: str, data: str, more: str = "", precision: str = "fp32"):
    path = tmp_path / "s.zs"
    path.write_text(f"""\
model     {model}
data      {data}
train     steps=1, batch={BATCH}, accumulate={ACCUMULATE}, precision={precision}
optimizer sgd(lr=0.1)
ranks     1 on cpu
{more}""")
    compiled = compile_file(str(path), {}, simulate=True)
    assert compiled.ok, [d.message for d in compiled.diagnostics]
    return compiled


def _jsonl(tmp_path: Path) -> str:
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(40))
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json")
    return f'jsonl("{data}", tokenizer="{tokenizer}", pack=true, context={CONTEXT})'


def _hf(tmp_path: Path, family: str) -> str:
    from hf_tiny import save_tiny
    return f'hf("{save_tiny(family, tmp_path / family)}")'


def _step(compiled) -> tuple[dict, list[int]]:
    """One step on one rank: the meter's report, and the extras' bytes of every micro-batch when
    each starts (what the ones before it still hold)."""
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.models.batch import as_batch
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState
    s, graph = compiled.schedule, compiled.graph
    state = RankState(graph, build_model(s.model, seed=0, base_dir=str(Path(compiled.path).parent)), 0, 1,
                      device="cpu")
    state.step_begin(0, [as_batch(make_batch(s.data, 0, 0, m, 0, 1, BATCH)) for m in range(ACCUMULATE)])
    held_before = []
    for op in graph.ops:
        if op.kind == "compute.forward" and op.unit == 0:
            held_before.append(sum(b.extras_bytes() for b in state.compute.batches))
        state.run_op(op)
    state.step_end()
    assert not any(b.extras for b in state.compute.batches)
    return state.memory_report(), held_before


def _planned_extras(compiled) -> int:
    """What the plan counts for one micro-batch's extras."""
    first = compiled.units[0]
    return (BATCH * first.extras_elems_per_seq + first.extras_elems_per_batch) * _elem(compiled)


def _elem(compiled) -> int:
    return ELEM[compiled.schedule.train.precision]


def _check(compiled, expected: int) -> None:
    from zdsl.planner.bound import worst_working
    report, held_before = _step(compiled)
    device = report["tiers"]["device"]
    assert device["by_kind"]["extras"] == expected == _planned_extras(compiled)
    assert held_before == [0] * ACCUMULATE        # the micro-batches before each one let theirs go
    assert device["peak_working"] <= worst_working(compiled.graph)["device"]   # bf16: with the fp32 upcasts saved
    # the plan holds them with the input of the first unit with a backward: until the last one
    graph = compiled.graph
    holder = min(op.unit for op in graph.ops if op.kind == "compute.backward")
    spec = compiled.units[holder]
    own = BATCH * (spec.input_elems_per_seq + spec.act_elems(_elem(compiled))) * _elem(compiled)
    assert graph.buffers[f"act[{holder}]"].bytes == own + expected


def test_the_gpts_mask_on_packed_rows_is_held_one_micro_batch_at_a_time(tmp_path, one_rank_group):
    compiled = _compile(tmp_path, "gpt(layers=2, width=32, heads=4, vocab=256, context=16)", _jsonl(tmp_path))
    _check(compiled, BATCH * CONTEXT * CONTEXT * ELEM["fp32"])


@pytest.mark.parametrize("packed", [True, False], ids=["jsonl", "plain"])
def test_an_hf_gpt2s_mask_is_planned_as_held(tmp_path, one_rank_group, packed):
    data = _jsonl(tmp_path) if packed else f"synthetic(vocab=256, context={CONTEXT})"
    compiled = _compile(tmp_path, _hf(tmp_path, "gpt2"), data)
    rows = BATCH if packed else 1           # plain rows share one (1, 1, T, T) causal mask
    _check(compiled, rows * CONTEXT * CONTEXT * ELEM["fp32"])


@pytest.mark.parametrize("freeze, precision", [("", "fp32"), ("freeze embed_tokens.weight\n", "fp32"), ("", "bf16")],
                         ids=["fp32", "frozen_embedding", "bf16"])
def test_an_hf_llamas_mask_and_rotary_tables_are_planned_as_held(tmp_path, one_rank_group, freeze, precision):
    compiled = _compile(tmp_path, _hf(tmp_path, "llama"), _jsonl(tmp_path), freeze, precision)
    head_dim = 64 // 4
    _check(compiled, (BATCH * CONTEXT * CONTEXT + 2 * BATCH * CONTEXT * head_dim) * ELEM[precision])


def test_a_plain_gpt_batch_holds_no_extras(tmp_path, one_rank_group):
    compiled = _compile(tmp_path, "gpt(layers=2, width=32, heads=4, vocab=256, context=16)",
                        f"synthetic(vocab=256, context={CONTEXT})")
    report, _ = _step(compiled)
    assert "extras" not in report["tiers"]["device"]["by_kind"]
    assert _planned_extras(compiled) == 0
