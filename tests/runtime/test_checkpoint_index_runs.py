"""A partly frozen unit's ``runs`` in a checkpoint index are (logical start, flat start, length)
triples; an index whose run has another length is refused as malformed, not read into a layout
that would place the unit's elements wrongly."""
import json

import pytest

from zdsl.runtime.checkpoint import CheckpointError, Index
from zdsl.runtime.checkpoint.index import body_digest


def index_bytes(runs: list[list[int]]) -> bytes:
    unit = {"name": "block.0", "prefix": "blocks.0", "dtype": "float32", "params": [["w", [4]], ["b", [4]]],
            "numel": 8, "padded_numel": 8, "parts": 2, "part_numel": 4, "ranks": 1,
            "frozen_parts": 1, "frozen_part_numel": 4, "runs": runs}
    index = Index(step=1, ranks=1, units=[], files=[])
    body = index.body()
    body["units"] = [unit]
    body["digest"] = body_digest(body)
    return json.dumps(body).encode()


def test_runs_of_three_are_read():
    index = Index.from_json_bytes(index_bytes([[0, 4, 4], [4, 0, 4]]), "index.json")
    assert index.units[0].runs == ((0, 4, 4), (4, 0, 4))


@pytest.mark.parametrize("run", [[0, 4], [0, 4, 4, 1]])
def test_a_run_of_another_length_is_a_malformed_index(run):
    with pytest.raises(CheckpointError, match="malformed index"):
        Index.from_json_bytes(index_bytes([run, [4, 0, 4]]), "index.json")
