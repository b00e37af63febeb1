"""How a failing op is named, on the rank (``OpError``) and by the launcher (``describe_op``)."""
from __future__ import annotations

from zdsl.ir import Op


def describe_op(op: Op) -> str:
    """``#54 comm.all_reduce (backward, unit 1, micro-batch 0)``: how errors name an op."""
    where = f"unit {op.unit}" if op.unit is not None else "all units"
    part = f" part {op.part}/{op.parts}" if op.parts > 1 else ""
    return f"#{op.id} {op.kind}{part} ({op.phase}, {where}, micro-batch {op.micro})"


class OpError(RuntimeError):
    """An op failed on a rank: names the rank, the op and the unit."""

    def __init__(self, rank: int, op: Op, cause: BaseException):
        super().__init__(f"rank {rank}: op {describe_op(op)} failed: {type(cause).__name__}: {cause}")
        self.rank, self.op, self.cause = rank, op, cause
