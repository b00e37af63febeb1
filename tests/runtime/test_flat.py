"""Flat parameters: views, freeing and re-gathering under autograd, sharding, collectives."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zdsl.model.layout import flat_layout
from zdsl.runtime.dist import collectives
from zdsl.runtime.state.flat import FlatParam
from zdsl.runtime.state.flat import alloc_storage
from zdsl.runtime.state.flat import free_storage
from zdsl.runtime.state.flat import is_freed
from zdsl.runtime.state.flat import layout_of
from zdsl.runtime.models.gpt import GPT

from ddp_reference import spawn

CFG = dict(layers=1, width=16, heads=2, vocab=32, context=8)


def _block_flat(ranks=2, parts=3, rank=0, dtype=torch.float32):
    model = GPT(**CFG, seed=0)
    block = model.blocks[0]
    reference = {n: p.detach().clone() for n, p in block.named_parameters()}
    numel = sum(p.numel() for p in block.parameters())
    lay = flat_layout(numel, ranks, bucket_elems=-(-numel // parts))
    fp = FlatParam(block, lay, rank, dtype, dtype, torch.device("cpu"))
    return block, fp, reference


def test_parameters_are_views_into_one_padded_flat_buffer():
    block, fp, reference = _block_flat()
    assert is_freed(fp.full) and is_freed(fp.grad)
    alloc_storage(fp.full)
    fp.full.copy_(fp.initial)
    for (name, p), off in zip(block.named_parameters(), fp.offsets):
        assert p.untyped_storage().data_ptr() == fp.full.untyped_storage().data_ptr()
        assert torch.equal(p, reference[name])
    assert fp.layout.padded_numel % (fp.layout.parts * 2) == 0
    assert torch.all(fp.initial[fp.layout.numel:] == 0)     # padding


def test_freeing_keeps_the_tensors_and_autograd_sees_the_regathered_data():
    block, fp, reference = _block_flat()
    alloc_storage(fp.full)
    fp.full.copy_(fp.initial)
    x = torch.randn(2, 8, 16, requires_grad=True)
    out = block(x)
    free_storage(fp.full)                                   # as after a stage-3 forward
    assert is_freed(fp.full) and all(p.untyped_storage().nbytes() == 0 for p in block.parameters())
    alloc_storage(fp.full)                                  # re-gather before backward
    fp.full.copy_(fp.initial)
    grads = torch.autograd.grad(out.sum(), [x, *fp.params])
    fresh = GPT(**CFG, seed=0).blocks[0]
    x2 = x.detach().requires_grad_()
    expect = torch.autograd.grad(fresh(x2).sum(), [x2, *fresh.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(grads, expect))


def test_shards_are_each_ranks_slice_of_every_part():
    _, fp0, _ = _block_flat(rank=0)
    _, fp1, _ = _block_flat(rank=1)
    lay = fp0.layout
    s0, s1 = fp0.shard_of(fp0.initial), fp1.shard_of(fp1.initial)
    assert s0.numel() == s1.numel() == lay.shard_numel
    rebuilt = torch.cat([torch.cat([p0, p1]) for p0, p1 in zip(fp0.shard_parts(s0), fp1.shard_parts(s1))])
    assert torch.equal(rebuilt, fp0.initial)


def test_layout_of_rejects_a_layout_that_does_not_split():
    with pytest.raises(ValueError, match="inconsistent layout"):
        layout_of(10, 11, 1, 2)


def test_a_unit_of_the_wrong_size_is_refused():
    block = GPT(**CFG, seed=0).blocks[0]
    with pytest.raises(ValueError, match="the compiled graph expects 5"):
        FlatParam(block, flat_layout(5, 1), 0, torch.float32, torch.float32, torch.device("cpu"))


def _collectives(rank: int, world: int, gather: str = "broadcast", scatter: str = "all_reduce") -> dict:
    collectives.GLOO_ALL_GATHER, collectives.GLOO_REDUCE_SCATTER = gather, scatter
    collectives.GLOO_NATIVE_BELOW = 0                 # these blocks are small: use the algorithm anyway
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        block, fp, _ = _block_flat(ranks=world, parts=3, rank=rank, dtype=dtype)
        lay = fp.layout
        shard = fp.shard_of(fp.initial).to(dtype)
        alloc_storage(fp.full)
        fp.full.zero_()
        works = [fp.gather(p, fp.full, shard, None, async_op=True) for p in range(lay.parts)]
        for w in works:
            w.wait()
        out[f"gather_{dtype}"] = torch.equal(fp.full, fp.initial.to(dtype))
        grad = torch.arange(lay.padded_numel, dtype=torch.float32).to(dtype) * (rank + 1)
        got = torch.zeros(lay.shard_numel, dtype=dtype)
        for p in range(lay.parts):
            fp.reduce_scatter(p, got, grad, None, async_op=False)
        expect = fp.shard_of(torch.arange(lay.padded_numel, dtype=torch.float32).to(dtype) * 3)
        out[f"reduce_scatter_{dtype}"] = torch.equal(got, expect)
    t = torch.full((4,), float(rank + 1))
    collectives.all_reduce(t)
    out["all_reduce"] = t.tolist() == [3.0] * 4
    out["fallbacks"] = dict(collectives.FALLBACKS)
    return out


@pytest.mark.slow                 # spawns ranks
@pytest.mark.parametrize("gather,scatter", [("broadcast", "exchange"), ("broadcast", "all_reduce"),
                                            ("broadcast", "reduce"),
                                            ("native", "native")])
def test_gather_and_reduce_scatter_per_part_on_two_gloo_ranks(gather, scatter):
    for rank, got in enumerate(spawn(_collectives, 2, gather, scatter)):
        assert got.pop("fallbacks") == {}, "gloo should have native flat collectives"
        assert all(got.values()), (rank, got)


def _fallback(rank: int, world: int) -> dict:
    def refuse(*args, **kwargs):
        raise RuntimeError("reduce_scatter_single is not supported by this backend")
    collectives._reduce_scatter = refuse
    collectives.GLOO_REDUCE_SCATTER = "native"      # reach the backend's own, which refuses
    inp = lambda: torch.arange(8, dtype=torch.float32) * (rank + 1)  # noqa: E731 (consumed by each call)
    out = torch.zeros(4)
    work = collectives.reduce_scatter(out, inp(), async_op=True)
    done = work.wait() and work.is_completed()
    again = torch.zeros(4)
    collectives.reduce_scatter(again, inp())
    return dict(out=out, again=again, done=done, fallbacks=dict(collectives.FALLBACKS))


@pytest.mark.slow                 # spawns ranks
def test_a_backend_without_reduce_scatter_falls_back_explicitly_and_counts_it():
    for rank, got in enumerate(spawn(_fallback, 2)):
        expect = (torch.arange(8, dtype=torch.float32) * 3)[rank * 4:(rank + 1) * 4]
        assert torch.equal(got["out"], expect) and torch.equal(got["again"], expect) and got["done"]
        assert got["fallbacks"] == {"reduce_scatter->all_reduce": 2}
