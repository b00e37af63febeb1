"""``nvme("A", "B", ...)``: one or more folders per placement, each state's own; checked, printed
back, and carried to the runtime in the graph's config."""
from __future__ import annotations

import pytest

from zdsl.check.checker import check_text
from zdsl.lang.errors import ZsError
from zdsl.check.printer import print_schedule
from zdsl.schedule import NVME_BLOCK
from zdsl.schedule import NVME_DEPTH
from zdsl.schedule import Placement
from zdsl.schedule import nvme_placements

HEAD = "schedule t\nmodel gpt(layers=2, width=64, heads=2, vocab=64, context=16)\nzero 3\n"


def checked(text: str, overrides: dict | None = None):
    return check_text(HEAD + text, "t.zs", overrides)[0]


def errors(text: str) -> list:
    with pytest.raises(ZsError) as info:
        checked(text)
    return [d for d in info.value.diagnostics if d.is_error]


def test_each_state_keeps_its_own_folders_block_and_depth():
    s = checked('offload parameters -> nvme("/mnt/a", "/mnt/b", block=1MiB, depth=8)\n'
                'offload optimizer -> nvme("/mnt/c", block=256KiB, depth=2)\n')
    assert s.placement["parameters"] == Placement("nvme", ("/mnt/a", "/mnt/b"), block_bytes=1 << 20, queue_depth=8)
    assert s.placement["optimizer"] == Placement("nvme", ("/mnt/c",), block_bytes=256 << 10, queue_depth=2)
    places = nvme_placements(s.to_config())
    assert places == {"parameters": s.placement["parameters"], "optimizer": s.placement["optimizer"]}


def test_the_config_lists_the_folders_and_defaults_come_from_one_home():
    s = checked('offload parameters -> nvme("/mnt/a")\noffload optimizer -> cpu\n')
    p = s.placement["parameters"]
    assert (p.paths, p.block_bytes, p.queue_depth) == (("/mnt/a",), NVME_BLOCK, NVME_DEPTH)
    config = s.to_config()["placement"]
    assert config["parameters"]["paths"] == ["/mnt/a"] and config["optimizer"]["paths"] == []
    several = Placement("nvme", ("/a", "/b")).to_config()
    assert several["paths"] == ["/a", "/b"]
    assert Placement.of_config(several) == Placement("nvme", ("/a", "/b"))


def test_the_printer_round_trips_several_folders():
    s = checked('offload parameters -> nvme("/mnt/a", "/mnt/b", depth=4)\n'
                'offload optimizer -> nvme("/mnt/a")\n')
    text = print_schedule(s)
    assert 'offload   parameters -> nvme("/mnt/a", "/mnt/b", depth=4)' in text
    assert check_text(text, "again.zs")[0].placement == s.placement


def test_an_override_of_one_option_keeps_every_folder():
    s = checked('offload parameters -> nvme("/mnt/a", "/mnt/b")\n', {"offload.parameters.block": "64KiB"})
    assert s.placement["parameters"].paths == ("/mnt/a", "/mnt/b")
    assert s.placement["parameters"].block_bytes == 64 << 10


def test_a_folder_named_twice_in_one_call_is_an_error_at_the_repeat():
    [e] = errors('offload parameters -> nvme("/mnt/a", "/mnt/b", "/mnt/a/")\n')
    assert "'/mnt/a/' is named twice" in e.message and (e.span.line, e.span.column) == (4, 48)
    assert "t.zs:4:28" in e.hint


@pytest.mark.parametrize("arg,words,column", [('""', "must not be empty", 38),
                                              ("3", "must be a string", 38)])
def test_a_bad_folder_is_an_error_where_it_is(arg, words, column):
    [e] = errors(f'offload parameters -> nvme("/mnt/a", {arg})\n')
    assert words in e.message and (e.span.line, e.span.column) == (4, column)


def test_two_states_may_share_a_folder_with_their_own_settings():
    s = checked('offload parameters -> nvme("/mnt/a", block=64KiB)\noffload optimizer -> nvme("/mnt/a", depth=2)\n')
    assert s.placement["parameters"].swap_key != s.placement["optimizer"].swap_key


def test_the_nvme_defaults_have_one_home():
    """The swapper and the rank's transfers take block and depth from zdsl/schedule.py, so a default
    changed there is the one every part uses; a literal default elsewhere would drift from it."""
    import re
    from pathlib import Path
    root = Path(__file__).parents[2]
    literal = re.compile(r"(block_bytes|queue_depth|block|depth)\b[^\n]*(1 << 20|1048576|\b8\))")
    for path in ("runtime/state/transfers.py", "runtime/offload/swap.py", "runtime/offload/stripes.py",
                 "runtime/offload/run_folder.py"):
        found = [line for line in (root / path).read_text().splitlines() if literal.search(line)]
        assert found == [], (path, found)
    assert Placement.of_config({"tier": "nvme", "paths": ["/a"]}) == Placement("nvme", ("/a",), block_bytes=NVME_BLOCK,
                                                                            queue_depth=NVME_DEPTH)
