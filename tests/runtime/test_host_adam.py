"""The host Adam step is bitwise torch.optim's, in every mode it offers."""

import pytest
import torch

from zdsl.runtime.offload import host_adam
from zdsl.runtime.offload.host_adam import HostAdamError
from zdsl.runtime.offload.host_adam import host_adamw_


def _state(n, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)
    g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)
    m = torch.randn(n, generator=gen) * 0.01
    v = torch.rand(n, generator=gen) * 1e-3
    g[:5] = 0.0
    v[:5] = 0.0  # rows that never saw a gradient (e.g. unused embedding rows): sqrt(0)
    if n > 20_010:  # subnormal second moments: the sqrt's special-value path
        g[20_000:20_010] = 0.0
        v[20_000:20_010] = 1e-41
    return p, g, m, v


def _torch_steps(p, g, m, v, steps, hp, adam_w, **opt_kwargs):
    """Run torch.optim for `steps` steps from the given state; return (param, exp_avg, exp_avg_sq)."""
    lr, b1, b2, eps, wd = hp
    param = torch.nn.Parameter(p.clone())
    cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    opt = cls([param], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, **opt_kwargs)
    opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    for _ in range(steps):
        param.grad = g.clone()
        opt.step()
    st = opt.state[param]
    return param.detach(), st["exp_avg"], st["exp_avg_sq"]


def _ours(p, g, m, v, steps, hp, adam_w, **kwargs):
    p, m, v = p.clone(), m.clone(), v.clone()
    g0 = g.clone()
    for step in range(1, steps + 1):
        host_adamw_(p, g, m, v, step, *hp, adam_w=adam_w, **kwargs)
    assert torch.equal(g, g0), "the gradient must not be modified"
    return p, m, v


HPS = [
    (1e-3, 0.9, 0.999, 1e-8, 0.01),
    (3e-4, 0.9, 0.95, 1e-6, 0.1),
    (1e-2, 0.3, 0.99, 1e-8, 0.0),  # lerp weight >= 0.5 takes ATen's other lerp branch
]


@pytest.mark.parametrize("n", [1, 17, 3 * 4096 + 5, 50_003])
@pytest.mark.parametrize("adam_w", [True, False])
def test_exact_matches_torch_single_tensor(n, adam_w):
    for i, hp in enumerate(HPS):
        state = _state(n, seed=i)
        want = _torch_steps(*state, 3, hp, adam_w, foreach=False)
        got = _ours(*state, 3, hp, adam_w)
        for w, o in zip(want, got):
            assert torch.equal(w, o), (hp, adam_w, (w != o).sum().item())


@pytest.mark.parametrize("threads", [2, 3])
def test_exact_on_several_threads_matches_torch(threads):
    """Ranges split across threads (OpenMP in the kernel, or the Python pool without it)
    with ragged ends and a special-value round inside one range."""
    hp = HPS[0]
    state = _state(3 * (1 << 16) + 77, seed=11)
    want = _torch_steps(*state, 2, hp, True, foreach=False)
    got = _ours(*state, 2, hp, True, threads=threads)
    for w, o in zip(want, got):
        assert torch.equal(w, o), (threads, (w != o).sum().item())


def test_exact_matches_torch_foreach_too():
    hp = HPS[1]
    state = _state(70_001, seed=7)
    want = _torch_steps(*state, 2, hp, True, foreach=True)
    got = _ours(*state, 2, hp, True)
    assert all(torch.equal(w, o) for w, o in zip(want, got))


@pytest.mark.parametrize("adam_w", [True, False])
def test_fused_flag_matches_torch_fused(adam_w):
    hp = HPS[0]
    state = _state(70_001, seed=3)
    want = _torch_steps(*state, 3, hp, adam_w, fused=True)
    got = _ours(*state, 3, hp, adam_w, fused=True)
    assert all(torch.equal(w, o) for w, o in zip(want, got))


def test_aten_tiled_fallback_is_exact(monkeypatch):
    monkeypatch.setattr(host_adam, "_TILE_ELEMS", 1000)  # many tiles and a ragged one
    monkeypatch.setitem(host_adam._kernel_state, "kernel", None)
    assert host_adam.exact_backend() == "aten_tiled"
    for adam_w in (True, False):
        state = _state(12_345, seed=11)
        want = _torch_steps(*state, 2, HPS[1], adam_w, foreach=False)
        got = _ours(*state, 2, HPS[1], adam_w)
        assert all(torch.equal(w, o) for w, o in zip(want, got))


def test_kernel_is_used_where_a_compiler_exists():
    # Not a correctness condition (the fallback is exact), but a silent fallback would cost 5x.
    from zdsl import env
    from zdsl.runtime.io import native

    if env.flag("ZDSL_NO_NATIVE"):
        pytest.skip("native kernels switched off by the environment")
    if native.compiler() is None:
        pytest.skip("no C compiler here ($CC, cc, gcc or clang): the exact ATen fallback runs instead")
    assert host_adam.exact_backend() == "kernel"


@pytest.mark.parametrize(
    "bad",
    [
        lambda p: p.double(),
        lambda p: p[::2],
        lambda p: p[:-1],
    ],
)
def test_bad_inputs_are_clear_errors(bad):
    p, g, m, v = _state(64, seed=0)
    with pytest.raises(HostAdamError):
        host_adamw_(bad(p), g, m, v, 1, *HPS[0])
