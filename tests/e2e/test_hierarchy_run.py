"""Hierarchical sharding end to end (issue 57): ``zdsl run`` of 4 CPU ranks as 2 simulated nodes of
2, torchrun with two agents on localhost as two real "hosts" (``--nnodes 2 --nproc-per-node 2``),
and one checkpoint carried through three forms and two rank counts:

flat ZeRO-3 at 2 ranks (``zdsl run``, twice the batch per rank: the global batch of the others)
-> HSDP at 4 ranks (torchrun, resumed from its step 1) -> hpZ at 4 ranks as 2 nodes of 2
(``zdsl run``, resumed from HSDP's step 2).

A step resumed at the rank count that saved it has the loss the saving run had at that step, to
the bit: the weights come back re-cut bit for bit, and a forward's loss has no reduction across
ranks in it (each rank's own samples; the reported loss is the mean of the ranks' in rank order).
Across rank counts (2 ranks' mean of 4 samples each against 4 ranks' of 2) and after a step whose
reductions add in another order (HSDP's in-node then cross-node sum) the losses are within 1e-6.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import zdsl

HEAD = """\
model     gpt(layers=2, width=32, heads=4, vocab=64, context=8)
data      synthetic(vocab=64, context=8)
optimizer sgd(lr=0.05, momentum=0.9)
"""
FLAT = HEAD + "train steps=3, batch=4, precision=fp32\nranks 2 on cpu\nzero 3\n"
HSDP = HEAD + ("train steps=3, batch=2, precision=fp32\nranks 4 on cpu, 2 per node\n"
               "shard optimizer, gradients, parameters over node\n")
HPZ = HEAD + "train steps=3, batch=2, precision=fp32\nranks 4 on cpu, 2 per node\nzero 3\nsecondary parameters over node\n"


def losses(path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def torchrun_two_agents(zs: Path, args: list[str], tmp: Path, timeout: float = 300) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 2`` of ``zdsl run zs``: one agent per "host", on localhost."""
    from zdsl.runtime.dist.spawn import free_port
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    agents = []
    for node in (0, 1):
        log = open(tmp / f"agent{node}.log", "w")
        agents.append((subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
             "-m", "zdsl.cli", "run", str(zs), "--quiet", *args],
            env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for agent, _ in agents:
            assert agent.wait(timeout=timeout) == 0, (tmp / "agent0.log").read_text()[-3000:] + \
                (tmp / "agent1.log").read_text()[-3000:]
    finally:
        for agent, log in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            log.close()


@pytest.mark.slow
def test_a_checkpoint_continues_from_flat_at_two_ranks_to_hsdp_under_torchrun_to_hpz(tmp_path, capsys):
    files = {}
    for name, text in (("flat", FLAT), ("hsdp", HSDP), ("hpz", HPZ)):
        files[name] = tmp_path / f"{name}.zs"
        files[name].write_text(text)
    flat = zdsl("run", str(files["flat"]), "--quiet", "--metrics", str(tmp_path / "flat.jsonl"),
                "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "flat"))
    assert flat.returncode == 0, flat.stderr
    torchrun_two_agents(files["hsdp"], ["--metrics", str(tmp_path / "hsdp.jsonl"), "--resume",
                                        str(tmp_path / "flat" / "step-000001"), "--checkpoint-every", "1",
                                        "--checkpoint-dir", str(tmp_path / "hsdp")], tmp_path)
    hpz = zdsl("run", str(files["hpz"]), "--quiet", "--metrics", str(tmp_path / "hpz.jsonl"),
               "--resume", str(tmp_path / "hsdp" / "step-000002"))
    assert hpz.returncode == 0, hpz.stderr
    a, b, c = (losses(tmp_path / f"{name}.jsonl") for name in ("flat", "hsdp", "hpz"))
    assert sorted(b) == [1, 2] and sorted(c) == [2]
    assert abs(b[1] - a[1]) <= 1e-6 * abs(a[1])    # HSDP at 4 ranks from flat's step 1 at 2
    assert abs(b[2] - a[2]) <= 1e-6 * abs(a[2])
    assert c[2] == b[2]                            # hpZ from HSDP's step 2, to the bit
    from zdsl.cli import main            # in this process: a process of its own would import torch again
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "hsdp" / "step-000002")]) == 0
    shown = capsys.readouterr()
    assert "shards written by ranks 0-1" in shown.out, shown.out + shown.err
    from zdsl.runtime.checkpoint import parse_shard_key, read_index
    index = read_index(tmp_path / "hsdp" / "step-000002")      # one replica wrote each shard
    written = [sorted({parse_shard_key(k)[1] for k in f.tensors if parse_shard_key(k)}) for f in index.files]
    assert written[:2] == [["momentum", "param"]] * 2 and written[2:] == [[], []]


@pytest.mark.parametrize("local, per_node, over, problem", [
    ("2", "2 per node", "node", None),
    ("4", "2 per node", "node", "the schedule puts 2 ranks on each node, but the launcher started 4"),
    ("2", None, "node", "write `ranks 4, 2 per node`"),
    ("2", None, "all", None),                    # a flat schedule runs on any hosts
    (None, "2 per node", "node", None),           # no launcher's count: nothing to hold it to
])
def test_a_launchers_hosts_must_be_the_schedules_nodes(monkeypatch, local, per_node, over, problem):
    from zdsl.check.checker import check_text
    from zdsl.runtime.run.launch import nodes_problem
    ranks = "ranks 4 on cpu" + (f", {per_node}" if per_node else "")
    schedule, _ = check_text(f"{HEAD}{ranks}\nshard optimizer, gradients, parameters over {over}\n", "n.zs")
    monkeypatch.delenv("ZDSL_ERROR_FILE", raising=False)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    found = nodes_problem(schedule)
    assert (found is None) == (problem is None) and (problem is None or problem in found), found
    monkeypatch.setenv("ZDSL_ERROR_FILE", "/nonexistent")     # zdsl run's own launcher: nodes simulated
    assert nodes_problem(schedule) is None
