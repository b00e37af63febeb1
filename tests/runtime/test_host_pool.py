"""The host pool reuses freed host buffers without raising the peak or handing out memory in use."""
import torch

from zdsl.runtime.io.aligned import is_aligned
from zdsl.runtime.state.host_pool import HostPool, typed

MB = 1 << 20


def test_a_freed_block_serves_the_next_request_of_its_size_aligned():
    pool = HostPool()
    a = pool.take(3 * MB)
    ptr = a.data_ptr()
    assert is_aligned(a) and a.numel() == 3 * MB
    pool.give(a)
    del a
    b = pool.take(3 * MB)
    assert b.data_ptr() == ptr and pool.reused == 1 and pool.fresh == 1


def test_taken_plus_kept_never_exceed_the_most_taken_at_once():
    pool = HostPool()
    a, b = pool.take(4 * MB), pool.take(4 * MB)      # the mark: 8 MB
    pool.give(a)
    pool.give(b)
    del a, b
    c = pool.take(6 * MB)                             # no 6 MB block: both 4 MB ones go first
    assert pool.taken_bytes + pool.kept_bytes <= 8 * MB
    assert pool.kept_bytes == 0 and pool.fresh == 3
    pool.give(c)
    del c
    d = pool.take(2 * MB)                             # 6 kept + 2 taken = 8: room, the 6 MB stays
    assert pool.kept_bytes == 6 * MB and pool.taken_bytes == 2 * MB
    assert pool.high_bytes == 8 * MB
    del d


def test_a_block_someone_still_views_is_not_handed_out_again():
    pool = HostPool()
    block = pool.take(MB)
    kept_view = typed(block, 1000, torch.float32)[10:20]
    kept_view.fill_(7.0)
    pool.give(block)
    del block
    assert pool.shared == 1 and pool.kept_bytes == 0
    other = pool.take(MB)
    other.zero_()
    assert torch.all(kept_view == 7.0)                # the view's memory was not reused


def test_a_larger_kept_block_serves_a_request_of_at_least_half_its_size():
    pool = HostPool()
    full = pool.take(4 * MB)
    pool.give(full)
    del full
    shard = pool.take(2 * MB)                         # a gradient shard in its full gradient's block
    assert shard.numel() == 4 * MB and pool.reused == 1 and pool.taken_bytes == 4 * MB
    pool.give(shard)
    del shard
    small = pool.take(MB)                             # under half: a new block, the kept one unmapped
    assert small.numel() == MB and pool.fresh == 2 and pool.kept_bytes == 0
    assert pool.taken_bytes + pool.kept_bytes <= pool.high_bytes
