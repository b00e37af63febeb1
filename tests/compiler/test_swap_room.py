"""The pre-flight's swap check looks at every state's own folders: each folder's share of the swap
files, summed per filesystem, against that filesystem's free space; a folder that cannot be used
is named."""
from __future__ import annotations

import os
from pathlib import Path

from zdsl.driver import compile_file
from zdsl.planner import machine_fit
from zdsl.planner.machine_fit import FolderRoom
from zdsl.planner.machine_fit import Machine
from zdsl.planner.machine_fit import TorchFloor
from zdsl.planner.machine_fit import judge
from zdsl.planner.machine_fit import needs_of
from zdsl.planner.machine_fit import schedule_fit

NVME = Path(__file__).parents[2] / "programs" / "nvme.zs"
FLOOR = TorchFloor(0, 0, "test")
MACHINE = Machine(1 << 40, 2)
GiB = 1 << 30


def compiled(parameters: str, optimizer: str):
    c = compile_file(str(NVME), {"offload.parameters": parameters, "offload.optimizer": optimizer}, simulate=True)
    assert c.ok, [d.message for d in c.diagnostics]
    return c


def state_bytes(c, kind: str) -> int:
    return sum(-(-b.bytes // 4096) * 4096 for b in c.graph.buffers.values() if b.tier == "nvme" and b.kind == kind)


def test_each_folder_holds_its_own_states_share(tmp_path):
    a, b, c = (str(tmp_path / x) for x in "abc")
    two = compiled(f'nvme("{a}")', f'nvme("{b}", "{c}", block=4KiB)')
    needs = needs_of(two.graph, two.sim.memory.to_json())
    by_folder = {n.folder: (n.per_rank, n.states) for n in needs.swap}
    assert by_folder[a] == (state_bytes(two, "param_shard"), ("parameters",))
    optim = state_bytes(two, "optim")
    assert by_folder[b][1] == by_folder[c][1] == ("optimizer",)
    assert by_folder[b][0] + by_folder[c][0] == optim and abs(by_folder[b][0] - by_folder[c][0]) <= 4096 * 8
    assert needs.nvme_per_rank == sum(per for per, _ in by_folder.values())


def test_every_folder_is_asked_and_a_full_one_is_named(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setattr(machine_fit, "device_of", lambda folder: str(folder))     # two drives
    a.mkdir()
    b.mkdir()
    c = compiled(f'nvme("{a}")', f'nvme("{b}")')
    optim = state_bytes(c, "optim")
    asked = []

    class Stat:
        def __init__(self, path):
            asked.append(Path(path))
            free = optim if Path(path) == b else 1 << 40      # room for one rank's optimizer state of two
            self.f_frsize, self.f_bavail = 4096, free // 4096

    fit = schedule_fit(c, floor=FLOOR, machine=MACHINE, statvfs=Stat)
    assert sorted(asked) == [a, b]
    [refusal] = fit.refusals
    assert f"the swap folder {b} has" in refusal and f"({2 * optim} bytes: {optim} each)" in refusal
    lines = fit.summary()
    assert any(f"of parameters in {a}" in line for line in lines)
    assert any(f"of optimizer in {b}" in line for line in lines)


def test_folders_on_one_disk_share_its_free_space():
    needs = needs_of_two(per_rank=60 * GiB)
    apart = {"/a": FolderRoom(100 * GiB, device=1), "/b": FolderRoom(100 * GiB, device=2)}
    assert judge(needs, MACHINE, FLOOR, apart).fits
    together = {"/a": FolderRoom(100 * GiB, device=1), "/b": FolderRoom(100 * GiB, device=1)}
    [refusal] = judge(needs, MACHINE, FLOOR, together).refusals
    assert "the swap folders /a and /b are on one disk" in refusal and f"({120 * GiB} bytes" in refusal
    assert any("(one disk with /b)" in line for line in judge(needs, MACHINE, FLOOR, together).summary())


def needs_of_two(per_rank: int):
    from zdsl.planner.machine_fit import Needs
    from zdsl.planner.machine_fit import SwapNeed
    return Needs(1, 0, 2 * per_rank, (SwapNeed("/a", per_rank, ("parameters",)),
                                      SwapNeed("/b", per_rank, ("optimizer",))))


def test_a_folder_that_cannot_be_used_is_refused_by_name(tmp_path):
    blocked, gone = tmp_path / "blocked", tmp_path / "gone"
    blocked.write_text("a file where a folder should be")
    os.symlink(tmp_path / "unmounted", gone)
    c = compiled(f'nvme("{blocked / "swap"}")', f'nvme("{gone}")')
    refusals = schedule_fit(c, floor=FLOOR, machine=MACHINE).refusals
    assert any(f"the swap folder {blocked / 'swap'} (parameters) cannot be used: {blocked} is a file" in r
               for r in refusals), refusals
    assert any(f"the swap folder {gone} (optimizer) cannot be used: {gone} is a link to" in r for r in refusals)
