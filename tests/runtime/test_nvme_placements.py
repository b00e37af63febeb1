"""Each state's NVMe placement is honoured at run time: its own folders, block and depth.

A rank of a ZeRO-3 schedule with parameters and optimizer state on NVMe: each state's swap files
appear only under its own folder(s), a placement over two folders stripes its files over both,
two states naming one folder with different block and depth get a swapper each, and every one
of these trains to the bits of the one-folder run.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from zdsl.model.units import gpt_units
from zdsl.driver import compile_schedule
from zdsl.schedule import Placement

from parity.test_state_vs_ddp import MODEL
from parity.test_state_vs_ddp import make_schedule

STEPS = 3


def train(placement: dict[str, Placement]) -> tuple[list[float], dict[Path, set[str]], list]:
    """Losses of a one-rank run, the swap files (by their buffer's kind) found under each folder
    after the last step, and the swappers the rank opened."""
    from zdsl.runtime.data import make_batch
    from zdsl.runtime.models.batch import Batch
    from zdsl.runtime.models.gpt import GPT
    from zdsl.runtime.state.rank import RankState

    schedule = make_schedule(1, 3, offload={"parameters": "nvme", "optimizer": "nvme"})
    schedule.train.steps = STEPS
    schedule.placement = placement
    graph = compile_schedule(schedule, gpt_units(**MODEL))
    state = RankState(graph, GPT(**MODEL, seed=0), 0, 1, device="cpu")
    t, losses = schedule.train, []
    try:
        for step in range(STEPS):
            state.step_begin(step, [Batch.of(*make_batch(schedule.data, t.seed, step, 0, 0, 1, t.batch))])
            for op in graph.ops:
                state.run_op(op)
            losses.append(state.step_end()["loss"])
        folders = {Path(f) for p in placement.values() for f in p.paths}
        kinds = {f: {swap.name.split("[")[0] for swap in f.rglob("*.swap")} for f in folders}
        return losses, kinds, state.opened_swappers
    finally:
        state.close_swap()


def nvme(*folders: Path, block: int = 1 << 16, depth: int = 4) -> Placement:
    return Placement("nvme", tuple(str(f) for f in folders), block_bytes=block, queue_depth=depth)


@pytest.fixture(scope="module")
def group():
    """A gloo group of one rank in this process, for every test here (the reference's run too)."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_folder(tmp_path_factory, group):
    """The reference: both states in one folder, one swapper."""
    folder = tmp_path_factory.mktemp("one")
    losses, kinds, swappers = train({"parameters": nvme(folder), "optimizer": nvme(folder)})
    assert kinds == {folder: {"param_shard", "optim"}} and len(swappers) == 1
    return losses


def test_each_states_files_are_only_in_its_own_folder(tmp_path, one_folder):
    a, b = tmp_path / "a", tmp_path / "b"
    losses, kinds, swappers = train({"parameters": nvme(a, block=1 << 20, depth=8),
                                     "optimizer": nvme(b, block=256 << 10, depth=2)})
    assert kinds == {a: {"param_shard"}, b: {"optim"}}
    assert sorted((s.block_bytes, s.queue_depth) for s in swappers) == [(256 << 10, 2), (1 << 20, 8)]
    assert losses == one_folder


def test_a_placement_over_two_folders_stripes_its_files_over_both(tmp_path, one_folder):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    losses, kinds, swappers = train({"parameters": nvme(a, b, block=4096), "optimizer": nvme(c)})
    assert kinds == {a: {"param_shard"}, b: {"param_shard"}, c: {"optim"}}
    [striped] = [s for s in swappers if len(s.folders) == 2]
    assert [f.parent for f in striped.folders] == [a, b]      # each folder's rank0 folder
    assert losses == one_folder


def test_one_folder_with_two_settings_gets_a_swapper_for_each(tmp_path, one_folder):
    """Honoured, not refused: DeepSpeed users point both states at one drive, and each swapper has
    its own run folder there."""
    folder = tmp_path / "shared"
    losses, kinds, swappers = train({"parameters": nvme(folder, block=8192, depth=2),
                                     "optimizer": nvme(folder, block=1 << 16, depth=4)})
    assert kinds == {folder: {"param_shard", "optim"}}
    assert sorted(s.block_bytes for s in swappers) == [8192, 1 << 16]
    assert len({s.run_dir for s in swappers}) == 2
    assert losses == one_folder
    assert list(folder.iterdir()) == []             # its rank0 folder went with the last swapper closed


def test_every_swappers_transfers_are_stamped_for_the_stream_checker(tmp_path, group, monkeypatch):
    """The CPU stream checker sees each placement's swapper's reads and writes (host_access), and a
    schedule with a swapper per state and a striped one checks clean."""
    from zdsl.driver import compile_file
    from zdsl.runtime.run.hb_steps import check_steps
    from zdsl.runtime.io.host_access import host_access
    from zdsl.runtime.offload import swap
    stamped = []

    def counting(reads=(), writes=()):
        stamped.append(1)
        host_access(reads, writes)

    monkeypatch.setattr(swap, "host_access", counting)
    path = tmp_path / "hb.zs"
    path.write_text(f"""schedule hb
model     gpt(layers=2, width=32, heads=2, vocab=256, context=16)
data      corpus("stdlib", context=16)
train     steps=2, batch=2
ranks     1 on cpu
zero      3
offload   parameters -> nvme("{tmp_path / 'a'}", "{tmp_path / 'b'}", block=8KiB, depth=2)
offload   optimizer  -> nvme("{tmp_path / 'c'}", block=64KiB, depth=4)
""")
    compiled = compile_file(str(path), None, simulate=False)
    assert compiled.ok, [d.message for d in compiled.diagnostics]
    checker = check_steps(compiled.graph, compiled.schedule, steps=2)
    nvme_ops = sum(op.kind.startswith("nvme.") for op in compiled.graph.ops)
    assert checker.clocks.races == [] and nvme_ops and len(stamped) >= 2 * nvme_ops
