"""An eval pass's extras (an HF Llama's attention mask and rotary tables) as the runtime holds them
and the plan counts them: from the pass's first forward to its last one, let go when the pass ends.
The forward-only graph has no buffer that lives that long (a unit's input is freed after the next
unit's forward), so it records their bytes (``pass_extras``) and the plan's peaks add them."""
from __future__ import annotations

from pathlib import Path

import pytest

from sft_data import sft_records
from sft_data import train_tokenizer
from sft_data import write_jsonl

from zdsl.compile.eval_graph import pass_extras
from zdsl.driver import compile_file

BATCH, CONTEXT = 3, 16
ELEM = {"fp32": 4, "bf16": 2}


def _compile(tmp_path: Path, precision: str):
    from hf_tiny import save_tiny
    model = save_tiny("llama", tmp_path / "llama")
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(40))
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json")
    source = f'jsonl("{data}", tokenizer="{tokenizer}", pack=true, context={CONTEXT})'
    path = tmp_path / "s.zs"
    path.write_text(f"""\
model     hf("{model}")
data      {source}
train     steps=1, batch={BATCH}, precision={precision}
optimizer sgd(lr=0.1)
ranks     1 on cpu
eval      every 1 steps on {source} batches=1
""")
    compiled = compile_file(str(path), {}, simulate=True)
    assert compiled.ok, [d.message for d in compiled.diagnostics]
    return compiled


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_eval_pass_holds_its_mask_and_rotary_tables_to_its_end(tmp_path, one_rank_group, precision):
    from zdsl.planner.bound import worst_working
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.models.batch import as_batch
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState
    compiled = _compile(tmp_path, precision)
    s, ev = compiled.schedule, compiled.eval_graph
    head_dim = 64 // 4
    extras = (BATCH * CONTEXT * CONTEXT + 2 * BATCH * CONTEXT * head_dim) * ELEM[precision]
    assert pass_extras(ev) == {"device": extras}
    state = RankState(compiled.graph, build_model(s.model, seed=0, base_dir=str(tmp_path)), 0, 1, device="cpu")
    held = []
    with state.evaluation():
        state.eval_begin(as_batch(make_batch(s.eval.data, 0, 0, 0, 0, 1, BATCH)))
        for op in ev.ops:
            state.run_op(op)
            held.append(state.table.meter.held("extras[0]"))
        state.eval_end()
        ended = state.table.meter.held("extras[0]")
    device = state.memory_report()["tiers"]["device"]
    first = next(i for i, op in enumerate(ev.ops) if op.kind == "compute.forward")
    last = max(i for i, op in enumerate(ev.ops) if op.kind == "compute.forward")
    assert device["by_kind"]["extras"] == extras
    assert all(held[first:last + 1])            # from the pass's first forward to its last
    assert not ended                            # the pass's end lets them go
    # the plan's working figure for the pass, plus what it leaves out apart from the extras: the token
    # ids (int64) the runtime keeps beside the embedding's output, and the loss scalar
    uncounted = BATCH * CONTEXT * 8 + 4
    assert device["peak_working"] <= worst_working(ev)["device"] + pass_extras(ev)["device"] + uncounted
