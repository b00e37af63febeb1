"""The built-in GPT against its analytic sizes, the unit protocol, model loading and sizing."""
from __future__ import annotations

import textwrap

import pytest
import torch

from zdsl.schedule import ModelSpec
from zdsl.model.units import gpt_units
from zdsl.runtime.models.gpt import GPT
from zdsl.runtime.models.protocol import ModelProtocolError
from zdsl.runtime.models.protocol import build_model
from zdsl.runtime.models.protocol import check_model
from zdsl.runtime.models.protocol import load_factory
from zdsl.runtime.sizing import unit_specs

CONFIGS = [dict(layers=2, width=32, heads=2, vocab=64, context=16),
           dict(layers=3, width=48, heads=4, vocab=256, context=24),
           dict(layers=1, width=8, heads=1, vocab=5, context=3)]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_parameter_names_shapes_and_order_match_the_analytic_units(cfg):
    with torch.device("meta"):
        model = GPT(**cfg)
    specs = gpt_units(**cfg)
    units = model.units()
    assert [s.name for s in specs] == ["embedding", *[f"block.{i}" for i in range(cfg["layers"])], "head"]
    assert len(units) == len(specs)
    for unit, spec in zip(units, specs):
        assert [(n, tuple(p.shape)) for n, p in unit.named_parameters()] == spec.params
        assert sum(p.numel() for p in unit.parameters()) == spec.numel
    assert sum(s.numel for s in specs) == sum(p.numel() for p in model.parameters())
    assert [s.uses for s in specs][-1] == [0]
    assert model.tied == {(len(units) - 1, 0): "wte.weight"}


def test_head_reads_the_embedding_weight_without_registering_it():
    model = GPT(**CONFIGS[0], seed=0)
    assert not any(n.startswith("head.") and "wte" in n for n, _ in model.named_parameters())
    idx = torch.randint(0, 64, (2, 16))
    model(idx, idx).backward()
    assert model.embedding.wte.weight.grad is not None   # gradient from both the lookup and the head


def test_forward_equals_the_chain_of_units():
    model = GPT(**CONFIGS[0], seed=3)
    idx = torch.randint(0, 64, (2, 16))
    tgt = torch.randint(0, 64, (2, 16))
    x = idx
    units = model.units()
    for u in units[:-1]:
        x = u(x)
    assert torch.equal(units[-1](x, tgt), model(idx, tgt))


def test_init_is_deterministic_per_seed_and_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    before = torch.rand(3)
    torch.manual_seed(7)
    a = GPT(**CONFIGS[0], seed=1)
    assert torch.equal(torch.rand(3), before)
    b = GPT(**CONFIGS[0], seed=1)
    c = GPT(**CONFIGS[0], seed=2)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.embedding.wte.weight, c.embedding.wte.weight)
    # nanoGPT's scheme: LayerNorm 1/0, biases 0, std 0.02, residual projections scaled
    assert torch.equal(a.blocks[0].ln_1.weight, torch.ones(32))
    assert torch.equal(a.blocks[0].attn.c_attn.bias, torch.zeros(96))
    assert 0.015 < a.embedding.wte.weight.std() < 0.025
    assert a.blocks[0].attn.c_proj.weight.std() < 0.015


def test_a_meta_model_allocates_nothing():
    with torch.device("meta"):
        model = GPT(layers=48, width=1600, heads=25, vocab=50257, context=1024)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_build_model_builds_the_builtin_gpt_from_the_schedule_spec():
    model = build_model(ModelSpec("gpt", dict(CONFIGS[0])), seed=0)
    assert torch.equal(model.embedding.wpe.weight, GPT(**CONFIGS[0], seed=0).embedding.wpe.weight)
    with pytest.raises(ModelProtocolError, match="gpt"):
        build_model(ModelSpec("gpt", {"layerz": 2}))


USER_MODEL = '''
import torch, torch.nn as nn, torch.nn.functional as F

class Emb(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__(); self.table = nn.Embedding(vocab, hidden)
    def forward(self, idx): return self.table(idx)

class Mix(nn.Module):
    def __init__(self, hidden):
        super().__init__(); self.lin = nn.Linear(hidden, hidden)
    def forward(self, x): return x + torch.tanh(self.lin(x))

class Out(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__(); self.proj = nn.Linear(hidden, vocab)
    def forward(self, x, targets):
        return F.cross_entropy(self.proj(x).flatten(0, 1), targets.flatten())

class Tiny(nn.Module):
    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.emb, self.mix, self.out = Emb(vocab, hidden), Mix(hidden), Out(hidden, vocab)
    def units(self): return [self.emb, self.mix, self.out]
    def forward(self, idx, targets): return self.out(self.mix(self.emb(idx)), targets)

def build(hidden=16): return Tiny(hidden=hidden)
def broken(): return 42
class NoUnits(nn.Module):
    def __init__(self): super().__init__(); self.a = nn.Linear(2, 2)
def no_units(): return NoUnits()
def stray():
    m = Tiny(); m.extra = nn.Linear(2, 2); return m
def shared():
    m = Tiny(); m.out.proj2 = m.mix.lin; return m
def bad_tie():
    m = Tiny(); m.tied = {(2, 0): "nope.weight"}; return m
def raises(): raise RuntimeError("boom")

class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x * 2
    @staticmethod
    def backward(ctx, g): raise RuntimeError("no backward here")

class MixNoBackward(Mix):
    def forward(self, x): return _NoBackward.apply(super().forward(x))

def no_backward():
    m = Tiny(); m.mix = MixNoBackward(16); return m
'''


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(USER_MODEL))
    return path


def test_a_user_model_file_loads_builds_and_sizes_on_meta(model_file):
    spec = ModelSpec("user", {"hidden": 8}, factory=f"{model_file.name}:build")
    model = build_model(spec, seed=0, base_dir=model_file.parent)
    assert len(check_model(model, "x")) == 3
    specs = unit_specs(spec, context=4, base_dir=model_file.parent)
    assert [s.params for s in specs] == [[("table.weight", (32, 8))],
                                         [("lin.weight", (8, 8)), ("lin.bias", (8,))],
                                         [("proj.weight", (32, 8)), ("proj.bias", (32,))]]
    assert specs[1].fwd_flops_per_seq == 2 * 4 * 8 * 8
    assert specs[1].input_elems_per_seq == 4 * 8 and specs[0].input_elems_per_seq == 4
    assert all(s.act_elems_per_seq > 0 for s in specs)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_gpt_kernel_counts_are_what_its_units_dispatch(cfg, device):
    """zdsl.model.units.GPT_KERNELS against a count of the runtime's GPT, run on CPU, and on meta as a
    user's model is sized (where attention must count as the fused kernel a run dispatches)."""
    from zdsl.runtime.models.kernel_count import model_kernels
    with torch.device(device):
        model = GPT(**cfg)
        ids = torch.zeros(2, cfg["context"], dtype=torch.long)
    counts = model_kernels(model, model.units(), ids, ids.clone())
    assert counts == [(s.fwd_kernels, s.bwd_kernels) for s in gpt_units(**cfg)]


def test_a_user_models_kernels_counted_on_meta_are_those_it_runs_on_cpu(model_file):
    from zdsl.runtime.models.kernel_count import model_kernels
    spec = ModelSpec("user", {"hidden": 8}, factory=f"{model_file.name}:build")
    model = build_model(spec, seed=0, base_dir=model_file.parent)
    ids = torch.zeros(1, 4, dtype=torch.long)
    on_cpu = model_kernels(model, model.units(), ids, ids.clone())
    sized = unit_specs(spec, context=4, base_dir=model_file.parent)
    assert [(s.fwd_kernels, s.bwd_kernels) for s in sized] == on_cpu
    # Mix: addmm (+ t), tanh, add; backward adds 2 gradient accumulations to autograd's kernels
    assert on_cpu[1][0] >= 3 and on_cpu[1][1] > on_cpu[1][0]


def test_a_model_whose_backward_cannot_run_on_meta_keeps_its_forward_figures(model_file):
    from zdsl.runtime.sizing import ESTIMATED_KERNELS
    spec = ModelSpec("user", {}, factory=f"{model_file.name}:no_backward")
    with pytest.warns(UserWarning, match="kernel counts are estimates"):
        specs = unit_specs(spec, context=4, base_dir=model_file.parent)
    assert specs[1].fwd_flops_per_seq == 2 * 4 * 16 * 16          # measured, not the 2-per-parameter estimate
    assert [(s.fwd_kernels, s.bwd_kernels) for s in specs] == \
        [(ESTIMATED_KERNELS[0] * len(s.params), ESTIMATED_KERNELS[1] * len(s.params)) for s in specs]


def test_builtin_gpt_sizing_is_the_analytic_one():
    assert unit_specs(ModelSpec("gpt", dict(CONFIGS[0])), 16) == gpt_units(**CONFIGS[0])


def test_the_compiler_entry_point_reads_the_context_from_the_factory_arguments(model_file):
    from zdsl.runtime.sizing import units_for_user_model
    spec = ModelSpec("user", {"hidden": 8}, factory=f"{model_file}:build")
    assert units_for_user_model(spec)[1].input_elems_per_seq == 64 * 8
    assert units_for_user_model(spec, context=4)[1].input_elems_per_seq == 4 * 8


@pytest.mark.parametrize("factory, message", [
    ("nofile.py:build", "no such file"),
    ("my_model.py:missing", "defines no 'missing'"),
    ("my_model.py", "expected"),
    ("my_model.py:broken", "not a torch.nn.Module"),
    ("my_model.py:no_units", "no units\\(\\) method"),
    ("my_model.py:stray", "outside every unit: extra.weight"),
    ("my_model.py:shared", "registered in unit 1 and unit 2"),
    ("my_model.py:bad_tie", "has no parameter 'nope.weight'"),
    ("my_model.py:raises", "the factory failed: RuntimeError: boom"),
    ("no_such_pkg_zz.mod:build", "cannot import no_such_pkg_zz.mod"),
])
def test_models_that_break_the_protocol_get_a_clear_error(model_file, factory, message):
    with pytest.raises(ModelProtocolError, match=message):
        build_model(ModelSpec("user", {}, factory=factory), base_dir=model_file.parent)


def test_load_factory_imports_a_package_module():
    factory = load_factory("zdsl.runtime.models.gpt:build")
    assert isinstance(factory(layers=1, width=8, heads=1, vocab=5, context=3), GPT)
