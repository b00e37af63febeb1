"""What the executor needs of a rank's state: exactly the calls it makes.

:class:`zdsl.runtime.state.rank.RankState` is the real one; a checking or simulated state can
stand in for it by providing these methods. The executor decides when an op runs (its lane's
order and its dependencies); the state decides what the op does to tensors.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from zdsl.ir import Op


@runtime_checkable
class CollectiveHandle(Protocol):
    """A collective in flight. Either call finishes the op exactly once; both are safe to call."""

    def is_completed(self) -> bool: ...

    def wait(self) -> bool: ...


@runtime_checkable
class OpState(Protocol):
    """One rank's state as the executor drives it, one op at a time.

    ``run_compute``, ``run_copy`` and ``run_nvme`` run synchronously in the op's lane's worker
    thread; ``start_collective`` issues the collective asynchronously and returns at once;
    ``free`` is bookkeeping. Each raises on an op it cannot run, naming the rank and the op.
    """

    def run_compute(self, op: Op) -> None: ...

    def start_collective(self, op: Op) -> CollectiveHandle: ...

    def run_copy(self, op: Op) -> None: ...

    def run_nvme(self, op: Op) -> None: ...

    def free(self, op: Op) -> None: ...
