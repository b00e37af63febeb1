"""The unit protocol's per-batch context (Batch, prepare, takes_batch units) and its loss (-100 ignored)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from zdsl.runtime.models.batch import IGNORE_INDEX
from zdsl.runtime.models.batch import Batch
from zdsl.runtime.models.loss import causal_lm_loss


def _logits_labels(seed: int = 0, B: int = 3, T: int = 8, V: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    return logits, labels


def test_the_loss_of_all_counted_labels_is_cross_entropy_s_mean_bit_for_bit():
    logits, labels = _logits_labels()
    want = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
    assert torch.equal(causal_lm_loss(logits, labels), want)
    half = logits.to(torch.bfloat16)   # computed in fp32 whatever the logits' dtype
    got = causal_lm_loss(half, labels)
    assert got.dtype == torch.float32
    assert torch.equal(got, F.cross_entropy(half.float().view(-1, half.shape[-1]), labels.reshape(-1)))


def test_ignored_labels_are_not_counted_in_the_loss_nor_its_gradient():
    logits, labels = _logits_labels(1)
    labels[:, :4] = IGNORE_INDEX
    logits.requires_grad_(True)
    loss = causal_lm_loss(logits, labels)
    loss.backward()
    counted = logits[:, 4:].detach()
    want = F.cross_entropy(counted.reshape(-1, counted.shape[-1]), labels[:, 4:].reshape(-1))
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert logits.grad[:, :4].abs().sum() == 0
    assert logits.grad[:, 4:].abs().sum() > 0


def test_a_micro_batch_with_no_counted_label_gives_zero_loss_and_zero_gradient():
    logits, labels = _logits_labels(2)
    logits.requires_grad_(True)
    loss = causal_lm_loss(logits, torch.full_like(labels, IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() == 0


def test_batch_positions_default_to_0_to_T_in_every_row_and_move_with_to():
    idx = torch.randint(0, 5, (2, 4))
    batch = Batch.of(idx, idx)
    assert batch.positions is None and batch.attention_mask is None and batch.extras == {}
    assert torch.equal(batch.position_ids(), torch.arange(4).expand(2, 4))
    given = torch.tensor([[3, 4, 5, 6], [0, 1, 2, 3]])
    batch = Batch(idx, idx, positions=given, attention_mask=torch.ones(2, 4), extras={"k": torch.ones(1), "n": 3})
    assert batch.position_ids() is given
    moved = batch.to("meta")
    assert moved.input_ids.is_meta and moved.labels.is_meta and moved.positions.is_meta
    assert moved.attention_mask.is_meta and moved.extras["k"].is_meta and moved.extras["n"] == 3
    assert batch.input_ids.device.type == "cpu"   # a copy, the original stays


# -- the calling convention, in the rank state and in sizing -----------------------------------------

def _single_rank(spec, stage: int = 0, accumulate: int = 1, recompute=()):
    from zdsl.driver import compile_schedule
    from zdsl.runtime.models.protocol import build_model
    from zdsl.runtime.sizing import units_for_user_model
    from zdsl.runtime.state.rank import RankState
    from zdsl.schedule import DataSpec, OptimizerSpec, Schedule, TrainSpec
    sched = Schedule(name="protocol", model=spec, data=DataSpec("synthetic", None, {"vocab": 64, "context": 16}),
                     train=TrainSpec(steps=1, batch=2, accumulate=accumulate, precision="fp32", seed=0),
                     optimizer=OptimizerSpec(kind="sgd", lr=0.1), ranks=1, stage=stage, recompute=set(recompute))
    graph = compile_schedule(sched, units_for_user_model(spec, 16))
    model = build_model(spec, seed=0)
    return sched, graph, model, lambda: RankState(graph, model, 0, 1, device="cpu")


def _batches(sched, step: int, n: int) -> list[Batch]:
    from zdsl.runtime.data import make_batch
    return [Batch.of(*make_batch(sched.data, 0, step, m, 0, 1, sched.train.batch)) for m in range(n)]


def _prepare_and_calls(rank: int, world: int) -> dict:
    """One step at accumulate 2 recomputing unit 1: what prepare got and what each unit got."""
    from user_models import BATCHED_FACTORY
    from zdsl.schedule import ModelSpec
    sched, graph, model, make_state = _single_rank(ModelSpec("user", {}, factory=BATCHED_FACTORY),
                                                   accumulate=2, recompute=(1,))
    prepared, seen = [], {}
    prepare = model.prepare

    def recording(batch):
        prepared.append((id(batch), torch.is_grad_enabled(), sorted(batch.extras)))
        prepare(batch)
    model.prepare = recording
    for u, unit in enumerate(model.units()):
        unit.register_forward_pre_hook(lambda m, args, u=u: seen.setdefault(u, []).append(id(args[1])))
    state = make_state()
    given = _batches(sched, 0, 2)
    state.step_begin(0, given)
    for op in graph.ops:
        state.run_op(op)
    kept = [id(b) for b in state.compute.batches]
    return dict(loss=state.step_end()["loss"], prepared=prepared, seen=seen,
                given_extras=[sorted(b.extras) for b in given], kept=kept)


def _first_form_loss(rank: int, world: int) -> tuple[float, float]:
    """A model whose units take the hidden state alone (the last ``(hidden, labels)``): zdsl's
    first loss and the model's own forward's."""
    from user_models import FACTORY
    from zdsl.runtime.models.protocol import build_model
    from zdsl.schedule import ModelSpec
    spec = ModelSpec("user", {"tied": True}, factory=FACTORY)
    sched, graph, model, make_state = _single_rank(spec)
    plain = build_model(spec, seed=0)
    state = make_state()
    batch = _batches(sched, 0, 1)
    state.step_begin(0, batch)
    for op in graph.ops:
        state.run_op(op)
    with torch.no_grad():
        return state.step_end()["loss"], float(plain(batch[0].input_ids, batch[0].labels))


@pytest.mark.slow   # a rank of its own (collectives need a process group)
def test_prepare_runs_once_per_micro_batch_and_every_unit_recomputed_or_not_sees_its_batch():
    from ddp_reference import spawn
    r = spawn(_prepare_and_calls, 1)[0]
    assert math.isfinite(r["loss"])
    ids = [i for i, _, _ in r["prepared"]]
    assert ids == r["kept"] and len(set(ids)) == 2
    assert all(not grad and extras == [] for _, grad, extras in r["prepared"])   # no_grad, fresh extras
    assert r["given_extras"] == [[], []]                 # the caller's batches are left as they were
    assert sorted(r["seen"]) == [0, 1, 2, 3]
    for u, calls in r["seen"].items():                   # unit 1 twice a micro-batch: forward, recompute
        assert sorted(calls) == sorted(ids * (2 if u == 1 else 1)), u


@pytest.mark.slow
def test_a_model_in_the_first_form_still_trains():
    from ddp_reference import spawn
    got, want = spawn(_first_form_loss, 1)[0]
    assert got == want


def test_step_begin_takes_batches_not_pairs():
    from user_models import FACTORY
    from zdsl.runtime.state.errors import StateError
    from zdsl.schedule import ModelSpec
    sched, _, _, make_state = _single_rank(ModelSpec("user", {}, factory=FACTORY))
    b = _batches(sched, 0, 1)[0]
    with pytest.raises(StateError, match="takes Batch objects"):
        make_state().step_begin(0, [(b.input_ids, b.labels)])


def test_a_model_taking_the_batch_is_sized_on_meta_with_prepare_as_it_runs():
    """prepare runs on the meta device and the units trace there (no fallback to estimates); the
    kernels counted on meta (attention with a boolean mask included) are those the CPU dispatches."""
    import warnings
    from user_models import BATCHED_FACTORY, build_batched
    from zdsl.runtime.models.kernel_count import model_kernels
    from zdsl.runtime.sizing import unit_specs
    from zdsl.schedule import ModelSpec
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # a unit that cannot run on meta would warn and estimate
        specs = unit_specs(ModelSpec("user", {}, factory=BATCHED_FACTORY), context=16)
    ids = torch.zeros(1, 16, dtype=torch.long)
    model = build_batched()
    assert [(s.fwd_kernels, s.bwd_kernels) for s in specs] == model_kernels(model, model.units(), ids, ids.clone())
    assert all(s.fwd_flops_per_seq > 0 and s.act_elems_per_seq > 0 for s in specs[1:])


def test_unit_grads_equal_torch_autograd_grad_to_the_bit_and_leave_sympy_unimported():
    """zdsl's backward hands its own grad_output to the engine: the same bits as
    torch.autograd.grad, without the shape check whose import (sympy) each rank paid in its first
    backward; a grad_output of another shape still gets torch's own error."""
    import subprocess
    import sys
    code = """
import sys, torch
from zdsl.runtime.models.protocol import unit_grads
torch.manual_seed(0)
layer = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
x = torch.randn(4, 5, 16, requires_grad=True)
g = torch.randn(4, 5, 16)
inputs = [x, *layer.parameters()]
ours = unit_grads(layer(x), inputs, g)
assert "sympy" not in sys.modules, "unit_grads imported sympy"
theirs = torch.autograd.grad(layer(x), inputs, grad_outputs=g, allow_unused=True)
assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
unused = torch.nn.Parameter(torch.ones(3))
assert unit_grads(layer(x), [x, unused], g)[1] is None
try:
    unit_grads(layer(x), inputs, torch.randn(4, 16))
except RuntimeError as exc:
    assert "Mismatch in shape" in str(exc), exc
else:
    raise AssertionError("a grad_output of another shape was taken")
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
