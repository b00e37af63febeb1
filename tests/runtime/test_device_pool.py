"""A CPU rank's flat parameters and gradients come from the host pool: a step frees them and the
next one gets kept memory back, with the bits of newly allocated memory."""
from __future__ import annotations

import pytest
import torch

from zdsl.model.units import gpt_units
from zdsl.driver import compile_schedule
from zdsl.runtime.state import buffers
from zdsl.runtime.state.flat import can_lend

from ddp_reference import spawn
from parity.test_state_vs_ddp import MODEL
from parity.test_state_vs_ddp import make_schedule

pytestmark = pytest.mark.skipif(not can_lend(), reason="this torch cannot move memory between storages")


def _train(rank: int, world: int, stage: int, pooled: bool) -> dict:
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.models.batch import Batch
    from zdsl.runtime.models.gpt import GPT
    from zdsl.runtime.state.rank import RankState

    if not pooled:      # the memory allocator's fresh storage, as before the pool served flats
        buffers.can_lend = lambda: False
    schedule = make_schedule(world, stage=stage)
    graph = compile_schedule(schedule, gpt_units(**MODEL))
    state = RankState(graph, GPT(**MODEL, seed=0), rank, world, device="cpu")
    pool, t = state.table.pool, schedule.train
    fresh, taken, losses = [], [], []
    for step in range(t.steps):
        state.step_begin(step, [Batch.of(*make_batch(schedule.data, t.seed, step, 0, rank, world, t.batch))])
        for op in graph.ops:
            state.run_op(op)
        losses.append(state.step_end()["loss"])
        fresh.append(pool.fresh)
        taken.append(pool.fresh + pool.reused)
        assert not state.live_working()
    return dict(state=state.export_state(), losses=losses, fresh=fresh, taken=taken,
                held=pool.taken_bytes + pool.kept_bytes, high=pool.high_bytes,
                freed=[n for n, s in state.table.slots.items() if s.buf.kind in ("grad_full", "param_full")
                       and not s.buf.persistent])


@pytest.mark.slow      # 2 groups of 2 ranks per stage
@pytest.mark.parametrize("stage", [2, 3])
def test_freed_flats_get_their_memory_back_next_step_with_the_same_bits(stage):
    pooled = spawn(_train, 2, stage, True)
    fresh_memory = spawn(_train, 2, stage, False)
    for ours, theirs in zip(pooled, fresh_memory):
        assert ours["freed"], "the graph frees some flat buffer every step"
        assert ours["losses"] == theirs["losses"]
        assert all(torch.equal(ours["state"][k], theirs["state"][k]) for k in theirs["state"])
        # the flats come from the pool; after the first step at most a third of them are new blocks
        flats = [(a - b) - (c - d) for a, b, c, d in zip(ours["taken"][1:], ours["taken"], theirs["taken"][1:],
                                                         theirs["taken"])]
        new = [(a - b) - (c - d) for a, b, c, d in zip(ours["fresh"][1:], ours["fresh"], theirs["fresh"][1:],
                                                       theirs["fresh"])]
        assert ours["fresh"][0] > theirs["fresh"][0] and min(flats) >= len(ours["freed"])
        assert all(3 * n <= f for n, f in zip(new, flats)), (new, flats)
        assert ours["held"] <= ours["high"]


def test_a_lent_flat_takes_the_pool_block_and_gives_it_back_whole():
    from zdsl.runtime.state.flat import lend_storage
    from zdsl.runtime.state.flat import reclaim_storage
    from zdsl.runtime.state.host_pool import HostPool
    pool = HostPool()
    flat = torch.empty(1000)
    view = flat[10:20]
    flat.untyped_storage().resize_(0)
    block = pool.take(flat.numel() * 4)
    ptr = block.data_ptr()
    lend_storage(flat, block)
    view.fill_(3.0)                          # a view made before the loan sees the lent memory
    assert flat.data_ptr() == ptr and float(flat[15]) == 3.0 and block.untyped_storage().nbytes() == 0
    with pytest.raises(ValueError, match="bytes held"):
        lend_storage(flat, pool.take(4000))
    reclaim_storage(flat, block)
    assert flat.untyped_storage().nbytes() == 0 and block.view(torch.float32)[15] == 3.0
    pool.give(block)
    del block
    assert pool.kept_bytes == 4000 and pool.shared == 0
