"""Start one process per rank on this machine and watch them.

``zdsl run FILE`` (without RANK in the environment) re-runs itself once per
rank with the variables torchrun would set. The launcher never lets a rank
hang: when one rank fails, the others get a grace period to fail on their
own (a dead peer breaks their collectives), then are terminated; the first
failure, which names its rank and op, is what the user sees.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRACE_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(child_argv: list[str], ranks: int, grace_s: float = GRACE_S) -> int:
    """Run ``zdsl <child_argv>`` as ``ranks`` processes; returns the exit code for the user."""
    port = free_port()
    errors = Path(tempfile.mkdtemp(prefix="zdsl-run-"))
    procs: list[subprocess.Popen] = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   ZDSL_ERROR_FILE=str(errors / f"rank{rank}.err"))
        procs.append(subprocess.Popen([sys.executable, "-m", "zdsl.cli", *child_argv], env=env))
    first_failure: tuple[float, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed and first_failure is None:
                first_failure = (time.monotonic(), failed[0])
            if first_failure and time.monotonic() - first_failure[0] > grace_s:
                stop(procs)
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        stop(procs)
        print("zdsl: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    codes = [p.wait() for p in procs]
    try:
        if all(c == 0 for c in codes):
            return 0
        report_failure(errors, codes, first_failure[1] if first_failure else None)
        return 1
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def report_failure(errors: Path, codes: list[int], first: int | None) -> None:
    """Name the first rank that failed and why; list how the others ended."""
    messages = {}
    for r in range(len(codes)):
        f = errors / f"rank{r}.err"
        if f.exists():
            messages[r] = f.read_text().strip()
    lead = root_cause(codes, messages, first)
    text = messages.get(lead) or describe_exit(lead, codes[lead])
    if any(s in text for s in PEER_LOST):
        text = text.split("RuntimeError:")[0] + "the collective failed because a peer left or stopped answering"
    print(f"zdsl: error: {text}", file=sys.stderr)
    others = [r for r in range(len(codes)) if r != lead and codes[r] != 0]
    if others:
        print("zdsl: the other ranks stopped too: " + ", ".join(
            f"rank {r} ({describe_exit(r, codes[r]) if r not in messages else 'failed after it'})" for r in others),
            file=sys.stderr)


# What a rank reports when it failed only because another one did (gloo's wording).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker", "Broken pipe",
             "Timed out", "timed out", "Connection refused")


def root_cause(codes: list[int], messages: dict[int, str], first: int | None) -> int:
    """The rank to blame: one with an error of its own, else one killed by a signal, else the first
    to fail (the others mostly report that a peer went away)."""
    failed = [r for r, c in enumerate(codes) if c != 0]
    own = [r for r in failed if r in messages and not any(s in messages[r] for s in PEER_LOST)]
    if own:
        return own[0]
    killed = [r for r in failed if codes[r] < 0 and r not in messages]
    if killed:
        return killed[0]
    return first if first is not None else (failed[0] if failed else 0)


def describe_exit(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} was killed by signal {signal.Signals(-code).name}"
    return f"rank {rank} exited with status {code}"
