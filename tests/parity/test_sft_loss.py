"""Supervised fine-tuning through zdsl: the loss is cross-entropy over the response tokens only.

The reference runs each record alone (no padding, no packing, no mask: plain causal attention from
position 0), tokenised by ``tokenizers`` directly, and averages cross-entropy over the labels that
are response tokens or the end of text. zdsl's loss on the rows ``data jsonl(...)`` gives (packed
rows with their segments, or padded rows) must equal it to 1e-6:

* the built-in GPT, packed and padded, in process (a packed row trains exactly as its records
  apart: the same loss and the same gradients);
* a tiny Hugging Face Llama (zdsl's units around transformers' decoder layers) against
  transformers' own ``LlamaForCausalLM`` on each record;
* ``zdsl run`` at ZeRO-3 on 2 ranks (the CLI, the launcher's tokenisation, the ranks' rows): the
  first step's loss is the mean over the ranks of the reference, and the records the context cuts
  are reported once;
* the GPT trained on packed rows at ZeRO-3, recomputing its blocks, equals torch DDP on the same rows
  to the bit (the masked attention through zdsl's units, shards and recompute is the model's own
  ``forward(batch)``). One micro-batch a step: accumulating at stage 3 sums the ranks' and the
  micro-batches' gradients in another order than DDP (tests/parity/test_run_vs_ddp.py).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import quickstart_with_data
from helpers import zdsl
from sft_data import record_tokens
from sft_data import sft_records
from sft_data import sft_spec
from sft_data import train_tokenizer
from sft_data import write_jsonl

from zdsl.runtime.data import jsonl as jsonl_module
from zdsl.runtime.data.keys import sample_keys
from zdsl.runtime.data.jsonl import sft_rows
from zdsl.runtime.models.gpt import GPT
from zdsl.runtime.models.protocol import run_units

pytest.importorskip("tokenizers")

CONTEXT = 32
GPT_ARGS = dict(layers=2, width=32, heads=2, vocab=256, context=CONTEXT)


@pytest.fixture
def sft(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CACHE", str(tmp_path / "cache"))
    jsonl_module._rows.cache_clear()
    records = sft_records(40, seed=1, long_every=9)              # a few longer than the context
    return write_jsonl(tmp_path / "sft.jsonl", records), train_tokenizer(tmp_path / "tokenizer.json"), records


def reference_loss(logits_of, tokenizer, records, context: int) -> torch.Tensor:
    """Mean cross-entropy over every record's counted labels, each record run alone."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for record in records:
        prompt, answer = record_tokens(tokenizer, record)
        tokens = torch.tensor((prompt + answer)[:context + 1])
        labels = tokens[1:]
        counted = torch.arange(len(labels)) + 1 >= len(prompt)          # the label is not a prompt token
        if not counted.any():
            continue
        logits = logits_of(tokens[:-1]).double()
        total = total + F.cross_entropy(logits[counted], labels[counted], reduction="sum")
        count += int(counted.sum())
    return total / count


def gpt_logits(model: GPT):
    """The GPT on one sequence from position 0, plain causal attention (no batch, no mask)."""
    def logits_of(ids):
        x = model.embedding(ids[None])
        for block in model.blocks:
            x = block(x)
        return F.linear(model.head.ln_f(x), model.embedding.wte.weight)[0]
    return logits_of


def records_of(rows, row_ids, records):
    return [records[r] for row in row_ids for r in range(rows.first[row], rows.first[row + 1])]


def test_gpt_loss_is_cross_entropy_over_response_tokens_packed_or_padded(sft):
    path, tokenizer, records = sft
    model = GPT(**GPT_ARGS, seed=0)
    packed = sft_rows(sft_spec(path, tokenizer, CONTEXT, pack=True))
    padded = sft_rows(sft_spec(path, tokenizer, CONTEXT, pack=False))
    assert packed.truncated > 0 and packed.rows < len(records)
    row_ids = list(range(5))
    chosen = records_of(packed, row_ids, records)
    assert len(chosen) > len(row_ids)                                     # rows that really pack records
    with torch.no_grad():
        want = float(reference_loss(gpt_logits(model), tokenizer, chosen, CONTEXT))
        plain = float(model(packed.batch(np.array(row_ids, dtype=np.uint64)).input_ids,
                            packed.batch(np.array(row_ids, dtype=np.uint64)).labels))
    losses, grads = {}, {}
    for name, rows, keys in [("packed", packed, row_ids), ("padded", padded, [c["id"] for c in chosen])]:
        model.zero_grad()
        loss = run_units(model, rows.batch(np.array(keys, dtype=np.uint64)))
        loss.backward()
        losses[name] = loss.item()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert losses["packed"] == pytest.approx(want, rel=1e-6, abs=0)
    assert losses["padded"] == pytest.approx(want, rel=1e-6, abs=0)
    assert abs(plain - want) > 1e-3              # without the mask and positions the loss differs: it can fail
    for n in grads["packed"]:
        assert torch.allclose(grads["packed"][n], grads["padded"][n], rtol=1e-5, atol=1e-7), n


def test_hf_llama_loss_equals_transformers_on_each_record_alone(sft, tmp_path):
    pytest.importorskip("transformers")
    from hf.hf_tiny import save_tiny          # tests/hf, a folder beside this one
    from hf.hf_tiny import transformers_model

    from zdsl.runtime.models.protocol import build_model
    from zdsl.schedule import ModelSpec

    path, tokenizer, records = sft
    folder = save_tiny("llama", tmp_path / "llama", max_position_embeddings=CONTEXT)
    ours = build_model(ModelSpec("hf", {}, path=str(folder)), seed=0)
    theirs = transformers_model(folder).eval()
    rows = sft_rows(sft_spec(path, tokenizer, CONTEXT, pack=True))
    row_ids = list(range(4))
    with torch.no_grad():
        want = float(reference_loss(lambda ids: theirs(input_ids=ids[None]).logits[0], tokenizer,
                                    records_of(rows, row_ids, records), CONTEXT))
        got = float(run_units(ours, rows.batch(np.array(row_ids, dtype=np.uint64))))
        unmasked = rows.batch(np.array(row_ids, dtype=np.uint64))
        unmasked.attention_mask = unmasked.segments = unmasked.positions = None
        blind = float(run_units(ours, unmasked))
    assert got == pytest.approx(want, rel=1e-6, abs=0)
    assert abs(blind - want) > 1e-4


@pytest.mark.slow      # spawns 2 ranks
def test_zdsl_run_at_zero3_on_two_ranks_trains_on_response_tokens_only(sft, tmp_path):
    from zdsl.driver import compile_file

    path, tokenizer, records = sft
    zs = quickstart_with_data(tmp_path, f'jsonl("{path.name}", tokenizer="{tokenizer.name}", pack=true)', "sft.zs")
    metrics = tmp_path / "metrics.jsonl"
    proc = zdsl("run", str(zs), "--quiet", "--set", "steps=1", "--metrics", str(metrics),
                env={"ZDSL_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("records are longer than context=32") == 1, proc.stderr     # once, not per rank
    got = json.loads(metrics.read_text().splitlines()[0])["loss"]

    schedule = compile_file(str(zs), {}, simulate=False).schedule
    assert schedule.stage == 3 and schedule.ranks == 2 and schedule.train.accumulate == 1
    model_args = dict(schedule.model.args)
    model = GPT(**model_args, seed=schedule.train.seed)
    rows = sft_rows(schedule.data)
    B = schedule.train.batch
    per_rank = []
    with torch.no_grad():
        for rank in range(2):
            keys = sample_keys(schedule.train.seed, 0, 0, rank * B, B)
            row_ids = (keys % np.uint64(rows.rows)).astype(np.int64)
            per_rank.append(float(reference_loss(gpt_logits(model), tokenizer, records_of(rows, row_ids, records),
                                                 schedule.data.args["context"])))
    assert got == pytest.approx(sum(per_rank) / 2, rel=1e-6, abs=0)


def sft_schedule(spec, world: int):
    from zdsl.schedule import ModelSpec, OptimizerSpec, Schedule, TrainSpec
    return Schedule(name="sft", model=ModelSpec("gpt", dict(GPT_ARGS)), data=spec,
                    train=TrainSpec(steps=3, batch=3, accumulate=1, precision="fp32", seed=0),
                    optimizer=OptimizerSpec(kind="adamw", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
                    ranks=world, stage=3, recompute={1, 2})


def zdsl_and_ddp(rank: int, world: int, spec) -> dict:
    from ddp_reference import ddp_train, run_steps

    from zdsl.model.units import gpt_units
    from zdsl.driver import compile_schedule
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.state.rank import RankState

    sched = sft_schedule(spec, world)
    t = sched.train
    graph = compile_schedule(sched, gpt_units(**GPT_ARGS))
    state = RankState(graph, build_model(sched.model, seed=t.seed), rank, world, device="cpu")
    losses = [row["loss"] for row in run_steps(graph, state, sched, rank, world)]
    ref, ref_losses = ddp_train(GPT_ARGS, spec, seed=t.seed, steps=t.steps, batch=t.batch, accumulate=t.accumulate,
                                optimizer=sched.to_config()["optimizer"], rank=rank, world=world)
    return dict(zdsl=state.export_state(), losses=losses, ref=ref, ref_losses=ref_losses)


@pytest.mark.slow      # spawns 2 ranks
def test_gpt_on_packed_rows_at_zero3_with_recompute_equals_ddp_to_the_bit(sft):
    from ddp_reference import spawn

    path, tokenizer, _ = sft
    spec = sft_spec(path, tokenizer, CONTEXT, pack=True)
    for rank, r in enumerate(spawn(zdsl_and_ddp, 2, spec)):
        bad = [k for k in r["ref"] if not torch.equal(r["zdsl"][k], r["ref"][k])]
        assert not bad, f"rank {rank}: differs from DDP in {bad[:4]}"
        assert r["losses"] == r["ref_losses"] and all(np.isfinite(r["losses"]))
