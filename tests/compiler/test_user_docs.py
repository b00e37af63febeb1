"""The user docs say what the code does: the README's test command is CI's, every relative link
points at a file that exists, and every schedule example parses.

A schedule example is a fenced block without a language (```); shell, Python and printed output
are tagged (```sh, ```python, ```text) and not parsed. grammar/README.md's examples are
test_parse.py's.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from zdsl.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def relative_links(text: str) -> list[str]:
    """The targets of markdown links that point into the tree (no scheme, no bare anchor)."""
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def schedule_blocks(text: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if not lang]


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    after = readme.split("Install and run the tests:", 1)[1]
    command = FENCE.search(after).group(2).strip()
    assert command == ci


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(page):
    missing = [t for t in relative_links(page.read_text())
               if not (page.parent / t.split("#", 1)[0]).exists()]
    assert missing == [], f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name == "docs" or p.name == "README.md"
                                  and p.parent == ROOT], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_schedule_example_parses(page):
    for block in schedule_blocks(page.read_text()):
        parse_text(block, f"{page.name} example")


def test_the_readers_see_links_and_blocks():
    text = "[a](docs/x.md) [b](https://x.org) [c](#top) [d](../y.md#part)\n```\nzero 3\n```\n```sh\nls\n```\n"
    assert relative_links(text) == ["docs/x.md", "../y.md#part"]
    assert schedule_blocks(text) == ["zero 3\n"]
    assert schedule_blocks((ROOT / "README.md").read_text()), "the README shows no schedule"
