"""The evaluation graph of ``eval every N steps on SOURCE``: the forward phase alone, verified."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zdsl.compile.eval_graph import FORWARD_KINDS
from zdsl.compile.eval_graph import forward_only
from zdsl.compile.eval_graph import held_states
from zdsl.driver import compile_file
from helpers import zdsl

ROOT = Path(__file__).parents[2]
EVAL = 'every 2 steps on synthetic(vocab=128) batches=3'


def compiled(program: str, **sets):
    c = compile_file(str(ROOT / "programs" / program), {"eval": EVAL, **sets})
    assert c.ok, [d.message for d in c.diagnostics]
    return c


@pytest.mark.parametrize("program, sets", [
    ("quickstart.zs", {}),
    ("quickstart.zs", {"zero": "0"}),
    ("zero1.zs", {}),
    ("zero2.zs", {}),
    ("zero3.zs", {"prefetch": "parameters 2 units ahead"}),
    ("nvme.zs", {}),
    ("offload_optimizer.zs", {}),
    ("pipelines.zs", {}),        # hand-written templates: their forward one
])
def test_forward_ops_only_on_the_training_buffers(program, sets):
    c = compiled(program, **sets)
    train, ev = c.graph, c.eval_graph
    assert forward_only(ev) and {op.kind for op in ev.ops} <= set(FORWARD_KINDS)
    assert not [d for d in c.diagnostics if "evaluation" in d.message]      # verified: nothing found
    # the runtime runs it on the training's buffers: every one it names is there, same size and place
    for name, buf in ev.buffers.items():
        if name == "token":
            continue
        assert name in train.buffers, name
        assert (buf.tier, buf.persistent and train.buffers[name].persistent) == (train.buffers[name].tier,
                                                                                  buf.persistent)
        if buf.kind != "act":
            assert buf.bytes == train.buffers[name].bytes, name
    units = len(train.units)
    assert [op.unit for op in ev.ops if op.kind == "compute.forward"] == list(range(units))
    assert ev.accumulate == 1 and all(op.micro == 0 and op.phase == "forward" for op in ev.ops)
    if train.stage == 3:       # each unit gathered as its forward needs it, prefetch as in training
        gathered = [op for op in ev.ops if op.kind == "comm.all_gather"]
        assert len(gathered) == sum(u.parts for u in train.units) + sum(len(u.uses) for u in train.units)
        train_forward = [op.kind for op in train.ops if op.phase == "forward" and op.micro == 0]
        assert [op.kind for op in ev.ops if op.kind != "mem.free"] == \
            [k for k in train_forward if k != "mem.free"]
    assert not [n for n, b in ev.buffers.items() if b.persistent and not b.kind.startswith("param")
                and n != "loss"]
    assert c.eval_sim.memory.peak("device") < c.sim.memory.peak("device")


def test_training_states_held_beside_it_are_counted():
    c = compiled("quickstart.zs")
    held = held_states(c.graph, c.eval_graph)
    grads_optim_norm = sum(b.bytes for b in c.graph.buffers.values()
                          if b.persistent and b.kind in ("grad_shard", "optim", "norm") and b.tier == "device")
    assert held["device"] == grads_optim_norm > 0


def test_sized_at_the_eval_context():
    long = compiled("quickstart.zs")
    short = compiled("quickstart.zs", eval="every 2 steps on synthetic(vocab=128, context=8)")
    act = lambda c: sum(b.bytes for b in c.eval_graph.buffers.values() if b.kind == "act")   # noqa: E731
    assert act(short) * 4 == act(long)        # context 8 against the training's 32
    assert [u.numel for u in short.eval_graph.units] == [u.numel for u in long.graph.units]


def test_no_eval_no_graph():
    c = compile_file(str(ROOT / "programs" / "quickstart.zs"), {})
    assert c.ok and c.eval_graph is None and c.graph.config["eval"] is None


def test_a_missing_eval_source_is_a_positioned_error(tmp_path):
    path = tmp_path / "t.zs"
    path.write_text((ROOT / "programs" / "quickstart.zs").read_text()
                    + 'eval every 5 steps on tokens("val.bin") batches=2\n')
    r = zdsl("check", str(path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = len(path.read_text().splitlines())
    assert f"t.zs:{line}:" in r.stderr and "val.bin" in r.stderr


def test_plan_shows_the_evaluation(tmp_path):
    r = zdsl("plan", str(ROOT / "programs" / "quickstart.zs"), "--set", f"eval={EVAL}")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("eval every 2 steps, 3 batches"))
    assert "forward-only graph of" in line and "peak device" in line
    r = zdsl("plan", str(ROOT / "programs" / "quickstart.zs"), "--set", f"eval={EVAL}", "--json")
    ev = json.loads(r.stdout)["eval"]
    assert ev["batches"] == 3 and ev["predicted_eval_s"] == pytest.approx(3 * ev["predicted_batch_s"])
    assert 0 < ev["peak"]["device"]


def test_a_budget_the_evaluation_overruns_is_an_error_at_the_eval_statement(tmp_path):
    """Training on 1-token rows fits 5 MiB; evaluating 32-token rows beside the states training
    keeps does not."""
    path = tmp_path / "t.zs"
    path.write_text((ROOT / "programs" / "quickstart.zs").read_text().replace(
        'data      corpus("stdlib", context=32)', 'data      corpus("stdlib", context=1)')
        + 'memory device 5MiB\neval every 2 steps on corpus("stdlib", context=32)\n')
    c = compile_file(str(path), {"batch": "256"})
    (error,) = [d for d in c.diagnostics if d.severity == "error"]
    assert "evaluating needs" in error.message and "over the budget of 5.00 MiB" in error.message
    assert error.span.line == len(path.read_text().splitlines())
    assert c.sim.memory.peak("device") <= 5 << 20      # the training graph alone fits
