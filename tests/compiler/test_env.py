"""Every environment variable zdsl reads is in zdsl/env.py's registry, read only through it, and shown."""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from zdsl import env
from zdsl.cli import main

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "zdsl" / "env.py"
ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
MENTIONED = re.compile(r"ZDSL_[A-Z0-9_]+\*?")
UNREGISTERED = "ZDSL_" + "NOT_A_VARIABLE"      # spelt in two so the literal scan below does not see it


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def environment_reads(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line`` of every use of os.environ, getenv and kin in the code (not in strings or comments)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return [f"{path.relative_to(root)}:{t.start[0]}" for t in tokens
            if t.type == tokenize.NAME and t.string in ENVIRONMENT_NAMES]


def test_only_the_registry_touches_the_environment():
    # No allow-list: the environments of child processes are built by env.child_environment too.
    reads = [r for p in sources("zdsl", "runtime") if p != REGISTRY for r in environment_reads(p)]
    assert reads == [], f"read these through zdsl/env.py: {reads}"


def test_the_scan_sees_a_read(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text('import os\n"os.environ in a string is no read"\nx = os.environ.get("HOME")\n'
                      'from os import getenv\n')
    assert environment_reads(sneaky, tmp_path) == ["sneaky.py:3", "sneaky.py:4"]


def test_every_zdsl_name_in_the_source_is_registered():
    unknown = []
    for path in sources("zdsl", "runtime", "tests", "benchmarks"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in MENTIONED.findall(line):
                known = any(v.startswith(name[:-1]) for v in env.VARIABLES) if name.endswith("*") \
                    else name in env.VARIABLES
                if not known:
                    unknown.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert unknown == [], "register these in zdsl/env.py (or remove them):\n" + "\n".join(unknown)


@pytest.mark.parametrize("read", [env.get, env.raw, env.flag, env.integer, env.variable,
                                  lambda name: env.child_environment(drop=(name,)),
                                  lambda name: env.child_environment(**{name: "1"})])
def test_an_unregistered_name_is_refused(read, monkeypatch):
    monkeypatch.setenv(UNREGISTERED, "1")
    with pytest.raises(env.UnregisteredVariable, match=f"{UNREGISTERED} is not in zdsl/env.py's registry"):
        read(UNREGISTERED)
    assert issubclass(env.UnregisteredVariable, KeyError)


def test_values_defaults_and_flags(monkeypatch):
    monkeypatch.delenv("ZDSL_BIND_CORES", raising=False)
    monkeypatch.delenv("ZDSL_DEBUG", raising=False)
    assert env.flag("ZDSL_BIND_CORES") and not env.flag("ZDSL_DEBUG")       # their defaults: 1 and none
    for value, on in (("0", False), ("1", True), ("", True)):             # empty: the default
        monkeypatch.setenv("ZDSL_BIND_CORES", value)
        assert env.flag("ZDSL_BIND_CORES") is on
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert env.raw("CUDA_VISIBLE_DEVICES") == "" and env.get("CUDA_VISIBLE_DEVICES") is None
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="WORLD_SIZE='four': not a whole number"):
        env.integer("WORLD_SIZE")
    monkeypatch.delenv("ZDSL_PARITY_STEPS", raising=False)
    assert env.integer("ZDSL_PARITY_STEPS") == 5


def test_a_child_environment_drops_and_sets_registered_names(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("ZDSL_LOG", "info")
    child = env.child_environment(drop=env.LAUNCHER_VARIABLES, ZDSL_FAULT="0:1")
    assert "RANK" not in child and child["ZDSL_LOG"] == "info" and child["ZDSL_FAULT"] == "0:1"
    assert set(env.LAUNCHER_VARIABLES) >= {"RANK", "WORLD_SIZE", "MASTER_ADDR", "ZDSL_ERROR_FILE"}


def test_export_sets_only_registered_names(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    env.export(LOCAL_RANK="1")
    monkeypatch.delenv("LOCAL_RANK")                       # undo it for the tests after this one
    with pytest.raises(env.UnregisteredVariable):
        env.export(**{UNREGISTERED: "1"})


def test_every_variable_says_what_it_is():
    for v in env.VARIABLES.values():
        assert v.kind in env.KINDS and v.set_by and v.meaning, v


def test_zdsl_env_prints_every_registered_name(monkeypatch, capsys):
    monkeypatch.setenv("ZDSL_FAULT", "1:7:hang")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    missing = [name for name in env.VARIABLES if not re.search(rf"\b{name}\b", out)]
    assert missing == []
    assert re.search(r"ZDSL_FAULT\b.*1:7:hang", out)          # the value set here
    assert re.search(r"ZDSL_GLOO_LOOP_POLICY\b.*\bbatch\b", out)  # a default
