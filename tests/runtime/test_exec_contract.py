"""The executor's contract with the rank state is the OpState protocol, and nothing more."""
import ast
from pathlib import Path

from zdsl.runtime.exec import executor
from zdsl.runtime.exec.contract import CollectiveHandle
from zdsl.runtime.exec.contract import OpState
from zdsl.runtime.state.comm import Collective
from zdsl.runtime.state.rank import RankState


def protocol_members(proto) -> set[str]:
    return {name for name in vars(proto) if not name.startswith("_")}


def state_calls(source: str) -> set[str]:
    """Names the executor calls on its state: ``state.x(...)`` and ``self.state.x(...)``."""
    calls = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if (isinstance(owner, ast.Name) and owner.id == "state") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "state"):
                calls.add(node.func.attr)
    return calls


def test_the_executor_calls_exactly_what_the_protocol_lists():
    calls = state_calls(Path(executor.__file__).read_text())
    assert calls == protocol_members(OpState)


def test_the_rank_state_satisfies_the_protocol():
    assert issubclass(RankState, OpState)
    assert issubclass(Collective, CollectiveHandle)


def test_a_state_missing_a_call_does_not():
    class NoFree:
        def run_compute(self, op): ...
        def start_collective(self, op): ...
        def run_copy(self, op): ...
        def run_nvme(self, op): ...
    assert not issubclass(NoFree, OpState)
