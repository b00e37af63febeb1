"""Two ranks that do not keep to the loop: each case an error on every rank, and no hang.

Guards: ranks making different calls are named with their calls; one rank's misuse is every
rank's error (named with the rank); a rank that stops, a rank whose op fails and ranks compiling
different schedules end the others' calls at once (a peer gone, or the agreement), and a rank
stuck in its own code ends them after the timeout. The timeout is long where it is not what the
case is about, so a loaded machine cannot turn a slow rank into a wrong error.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.nn.functional as F
from api_models import batches, mlp, schedule
from ddp_reference import spawn

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

TIMEOUT_S = 60.0
STUCK_TIMEOUT_S = 8.0       # the stuck case's, which it waits out
GAVE_UP = "gave-up"         # written by a rank whose call raised: the stuck rank stays stuck until then


def train_step(engine, rank: int, step: int = 0, micro: int = 0):
    x, y = batches(0, step, micro, rank, 2, 4)
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()


def misbehave(rank: int, world: int, folder, case: str) -> tuple[str, float]:
    """Rank 1 breaks the loop as ``case`` says; each rank's error message and how long it took."""
    import zdsl
    from zdsl.runtime.api import ZdslApiError
    overrides = {"lr": "0.5"} if case == "different schedules" and rank == 1 else None
    if case == "an op fails" and rank == 1:
        os.environ["ZDSL_FAULT"] = "1:3"      # rank 1, op 3 of step 0
    t0 = time.perf_counter()
    timeout_s = STUCK_TIMEOUT_S if case == "a rank is stuck" else TIMEOUT_S
    try:
        with zdsl.initialize(schedule(folder, ranks=2, accumulate=2), model=mlp(), overrides=overrides,
                             timeout_s=timeout_s) as engine:
            t0 = time.perf_counter()       # the calls' time: setting up on a loaded machine is no wait
            x, y = batches(0, 0, 0, rank, 2, 4)
            out = engine(x)
            loss = F.cross_entropy(out, y, reduction="none" if case == "a loss not a scalar" and rank == 1 else "mean")
            engine.backward(loss)
            if case == "different calls" and rank == 1:
                engine(x)                  # rank 0 calls step() (a no-op before the boundary) here
            elif case == "a rank stops calling" and rank == 1:
                return "stopped", 0.0
            elif case == "a rank is stuck" and rank == 1:
                stuck_until(Path(folder) / GAVE_UP, 6 * STUCK_TIMEOUT_S)
                return "stuck", 0.0
            else:
                engine.step()
                train_step(engine, rank, micro=1)
                train_step(engine, rank, step=1)
    except ZdslApiError as exc:
        seconds = time.perf_counter() - t0
        (Path(folder) / GAVE_UP).write_text(str(rank))       # a stuck peer may end now
        return str(exc), seconds
    return "no error", time.perf_counter() - t0


def stuck_until(gave_up: Path, longest_s: float) -> None:
    """In the rank's own code, making no call, until a peer has given up on it (its error raised)."""
    deadline = time.monotonic() + longest_s
    while not gave_up.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


CASES = {
    "different calls": [r"the ranks made different calls of the engine: rank 0 called engine\.step\(\) \(step 0, "
                        r"micro-batch 0\); rank 1 called engine\(x\) \(step 0, micro-batch 1\)"] * 2,
    "a loss not a scalar": [r"rank 1: engine\.backward\(loss\): the loss must be a scalar tensor"] * 2,
    "a rank stops calling": [r"rank 0: engine\.step\(\) \(step 0, micro-batch 0\): another rank made no call",
                             "stopped"],
    "a rank is stuck": [r"rank 0: engine\.step\(\) \(step 0, micro-batch 0\): another rank made no call of the "
                        r"engine within 8 s", "stuck"],
    "an op fails": [r"rank 0: .*(another rank made no call|peer rank 1 .* is gone)",
                    r"step 0 failed: rank 1: op #3 .* RuntimeError: injected fault"],
    "different schedules": [r"the ranks compiled different task graphs"] * 2,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_loop_is_an_error_on_every_rank_without_a_hang(tmp_path, case):
    import re
    results = spawn(misbehave, 2, tmp_path, case)
    for rank, ((message, seconds), expected) in enumerate(zip(results, CASES[case])):
        assert re.search(expected, message), f"rank {rank}: {message}"
        assert seconds < TIMEOUT_S, f"rank {rank} took {seconds:.0f} s: it waited for a timeout"
