"""``pinned=false`` on a placement reaches the task graph: the host buffers that placement put on
the host carry ``Buffer.pinned = False`` (the runtime then allocates them pageable,
tests/runtime/test_cuda_ordering.py), and the graph's JSON carries it both ways."""
from __future__ import annotations

from zdsl.driver import compile_file
from zdsl.ir import Buffer
from zdsl.ir import TaskGraph

from helpers import SMALL


def _graph(tmp_path, offload: str) -> TaskGraph:
    path = tmp_path / "pinned.zs"
    path.write_text(SMALL + offload + "\n")
    out = compile_file(str(path), None, simulate=False)
    assert out.ok, [d.message for d in out.diagnostics]
    return out.graph


def _host(graph: TaskGraph) -> dict[str, Buffer]:
    return {name: b for name, b in graph.buffers.items() if b.tier == "host"}


def test_pinned_false_on_the_optimizer_makes_its_host_buffers_pageable(tmp_path):
    graph = _graph(tmp_path, "offload optimizer -> cpu(pinned=false)")
    host = _host(graph)
    assert any(b.kind == "optim" for b in host.values())
    assert any(b.kind == "grad_shard" for b in host.values())      # the host step's staging copies too
    assert not [name for name, b in host.items() if b.pinned]
    assert all(b.pinned for b in graph.buffers.values() if b.tier != "host")
    back = TaskGraph.from_json(graph.to_json())
    assert back == graph and not any(b.pinned for b in _host(back).values())


def test_each_placement_pins_its_own_state(tmp_path):
    graph = _graph(tmp_path, "offload optimizer -> cpu(pinned=true)\noffload parameters -> cpu(pinned=false)")
    host = _host(graph)
    assert {b.kind for b in host.values() if not b.pinned} == {"param_shard"}
    assert all(b.pinned for b in host.values() if b.kind == "optim")


def test_the_default_is_pinned_and_the_json_round_trips(tmp_path):
    for offload in ("offload optimizer -> cpu", "offload optimizer -> cpu(pinned=true)"):
        graph = _graph(tmp_path, offload)
        assert _host(graph) and all(b.pinned for b in graph.buffers.values())
        text = graph.to_json()
        assert '"pinned":false' not in text
        assert TaskGraph.from_json(text) == graph
    assert TaskGraph.from_json(_graph(tmp_path, "offload optimizer -> cpu(pinned=false)").to_json()) \
        .digest() != graph.digest()
