"""Fault injection, for the tests that prove no rank ever hangs.

``ZDSL_FAULT="RANK:OP[:MODE[:STEP]]"`` makes rank RANK fail at op id OP (at
step STEP, default 0). MODE: ``raise`` (an exception in the op), ``kill``
(the process dies at once, as from SIGKILL or an OOM kill) or ``hang`` (the
op never returns: the others must time out).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from zdsl import env


@dataclass(frozen=True)
class Fault:
    rank: int
    op: int
    mode: str = "raise"
    step: int = 0

    def fire(self) -> None:
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "hang":
            while True:
                time.sleep(3600)
        raise RuntimeError(f"injected fault (ZDSL_FAULT={env.get('ZDSL_FAULT')})")


def fault_for(rank: int) -> Fault | None:
    spec = env.get("ZDSL_FAULT")
    if not spec:
        return None
    parts = spec.split(":")
    try:
        fault = Fault(int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else "raise",
                      int(parts[3]) if len(parts) > 3 else 0)
    except (ValueError, IndexError):
        raise ValueError(f"ZDSL_FAULT={spec!r}: expected RANK:OP[:raise|kill|hang[:STEP]]") from None
    return fault if fault.rank == rank else None
