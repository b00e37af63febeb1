"""Start one process per rank on this machine and watch them.

``zdsl run FILE`` (without RANK in the environment) re-runs itself once per
rank with the variables torchrun would set, and ``ZDSL_ERROR_FILE``: where
the rank leaves its error. Beside it lies the rank's progress board, a few
integers the rank writes as it runs (its step, the last op it finished, the
collectives it issued) and the launcher reads. The launcher never lets a
rank hang or outlive it:

* when one rank fails, the others get a few seconds to fail on their own (a
  dead peer breaks their collectives at once), then are stopped; the first
  failure, which names its rank and op, is what the user sees;
* a rank that stops making progress (stopped by SIGSTOP, or hung) is found
  when a peer's collective times out waiting for it, or when it has been
  stopped for ``--timeout`` seconds: the launcher names it and the op it
  stopped before, and stops it;
* SIGTERM, SIGHUP or SIGINT to the launcher stops every rank; the launcher
  says so and exits 128 + the signal.

``zdsl launch SCRIPT`` (``launch_script.py``) starts a user's own script as the ranks through
:func:`launch_ranks`; there a rank's board also says which call of the engine it is in, so a rank
that hangs is named with its call, or as in its own code after one.

In a rank, :func:`zdsl.runtime.proc.guard.guard_rank` stops the rank cleanly
on SIGTERM or SIGHUP (torchrun's agent forwards them) and when its launcher
is gone, even by SIGKILL: whatever the rank's main thread is doing, it is gone
a few seconds later.
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from zdsl import env
from zdsl.runtime.dist.spawn import STOP_WAIT_S, describe_exit, free_port, rank_env
from zdsl.runtime.exec.errors import describe_op
from zdsl.runtime.proc.board import (
    BOARD_SLOTS,
    CALL,
    CALL_MICRO,
    CALL_STEP,
    CALLS_MADE,
    ENGINE_CALLS,
    ISSUED,
    LAST_CALL,
    LAST_DONE,
    STEP,
    STEP_DONE,
    TIMEOUT_MS,
    new_board,
    running_ops,
)
from zdsl.runtime.proc.guard import STOP_SIGNALS

# Ctrl-C handled as the others, as torchrun's agent does: a launcher started where SIGINT is
# inherited ignored (a job a non-interactive shell put in the background) must still stop on it
LAUNCHER_SIGNALS = (*STOP_SIGNALS, signal.SIGINT)

GRACE_S = 3.0            # after a rank failed: for the others to fail on their own
POLL_S = 0.05

# What a rank reports when it failed only because another one did (gloo's wording; the last, zdsl's).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker", "Broken pipe",
             "Timed out", "timed out", "Connection refused", "pair closure", "left or stopped answering",
             "through shared memory: peer rank")      # runtime/dist/shm.py: gone, or silent past the timeout
# A rank's error that already says in zdsl's words that a peer is gone or silent (calls.py's too).
PEER_LOST_SAID = ("left or stopped answering", "made no call of the engine")
GLOO_SOURCE = re.compile(r"\[[^\]]*gloo[^\]]*\]\s*")


class LauncherStopped(Exception):
    """SIGTERM or SIGHUP reached the launcher."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Watch:
    """What the launcher knows of each rank while they run."""
    procs: list[subprocess.Popen]
    boards: list[memoryview]
    timeout_s: float
    seen: list[tuple] = field(default_factory=list)          # each rank's board, as last read
    changed: list[float] = field(default_factory=list)       # when each rank's board last changed
    stopped_since: dict[int, float] = field(default_factory=dict)   # ranks in state T, since
    first_failure: tuple[float, int] | None = None
    culprits: dict[int, str] = field(default_factory=dict)   # rank -> why zdsl stopped it
    stopped: set[int] = field(default_factory=set)            # ranks zdsl stopped after a failure
    waited_by: int | None = None                             # the rank whose collective waited for them

    def __post_init__(self):
        now = time.monotonic()
        self.seen = [tuple(b[:BOARD_SLOTS]) for b in self.boards]
        self.changed = [now] * len(self.procs)

    def run(self) -> list[int]:
        """Until every rank has exited; returns their exit codes."""
        while True:
            codes = [p.poll() for p in self.procs]
            ended = [c for c in codes if c is not None]
            if len(ended) == len(codes):
                return ended
            now = time.monotonic()
            self.read_boards(now, codes)
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed and self.first_failure is None:
                self.first_failure = (now, failed[0])
                self.find_culprits(now, codes, failed[0])
            for r, since in list(self.stopped_since.items()):
                if now - since > self.timeout_s and r not in self.culprits:
                    self.blame(r, now)                   # stopped longer than a collective may wait
            if self.first_failure and now - self.first_failure[0] > GRACE_S:
                self.stopped = {r for r, c in enumerate(codes) if c is None}
                stop(self.procs)
            time.sleep(POLL_S)

    def read_boards(self, now: float, codes: list[int | None]) -> None:
        for r, board in enumerate(self.boards):
            snap = tuple(board[:BOARD_SLOTS])
            if snap != self.seen[r]:
                self.seen[r], self.changed[r] = snap, now
            if codes[r] is None and process_state(self.procs[r].pid) in ("T", "t"):
                self.stopped_since.setdefault(r, now)
            else:
                self.stopped_since.pop(r, None)

    def find_culprits(self, now: float, codes: list[int | None], failed: int) -> None:
        """A rank failed: if others still run because they stopped answering, stop them now."""
        for r in range(len(self.procs)):
            if codes[r] is None and (r in self.stopped_since or self.behind(r, failed, now)):
                self.blame(r, now, waited_by=failed)

    def behind(self, r: int, waiter: int, now: float) -> bool:
        """Rank r never issued a collective, or began a call of the engine, that the waiter did, and has
        made no progress for a while (half the waiter's collective timeout, as its board says, else
        the launcher's)."""
        mine, theirs = self.seen[r], self.seen[waiter]
        waited = theirs[TIMEOUT_MS] / 1000 if theirs[TIMEOUT_MS] > 0 else self.timeout_s
        return ((mine[ISSUED] < theirs[ISSUED] or mine[CALLS_MADE] < theirs[CALLS_MADE])
                and now - self.changed[r] >= waited / 2)

    def blame(self, r: int, now: float, waited_by: int | None = None) -> None:
        p = self.procs[r]
        if r in self.stopped_since:
            why = f"it was stopped (SIGSTOP or a debugger) for {now - self.stopped_since[r]:.0f} s"
            p.kill()                             # a stopped process takes no SIGTERM until continued
        else:
            why = f"it made no progress for {now - self.changed[r]:.0f} s"
            stop([p])
        self.culprits[r] = why
        if waited_by is not None and self.waited_by is None:
            self.waited_by = waited_by
        if self.first_failure is None:
            self.first_failure = (now, r)


def nodes_problem(schedule) -> str | None:
    """Why the hosts a launcher gave the ranks are not the schedule's nodes, or None.

    ``zdsl run``'s own launcher starts every rank on this machine, so a schedule's nodes
    (``ranks N, P per node``) are simulated there: any P goes. Under another launcher (torchrun)
    each host is a node: the ranks it puts on this one (``LOCAL_WORLD_SIZE``) must be the
    schedule's P, and a schedule that shards over a node with every rank on one must not run
    on several hosts, where its "node" would span them."""
    local = env.integer("LOCAL_WORLD_SIZE")
    if env.get("ZDSL_ERROR_FILE") or local is None:
        return None
    ranks, per_node = schedule.ranks, schedule.per_node
    if per_node is not None and local != per_node:
        return (f"the schedule puts {per_node} ranks on each node, but the launcher started {local} on this "
                f"host (LOCAL_WORLD_SIZE): start {per_node} per host (torchrun --nproc-per-node {per_node}), "
                f"or write `ranks {ranks}, {local} per node`")
    if per_node is None and local < ranks and "node" in schedule.shard_over.values() and schedule.stage:
        return (f"the schedule shards over a node and puts all {ranks} ranks on one, but the launcher started "
                f"{local} on this host (LOCAL_WORLD_SIZE): write `ranks {ranks}, {local} per node`")
    return None


def launch_local(child_argv: list[str], ranks: int, timeout_s: float = 120.0, graph=None) -> int:
    """Run ``zdsl <child_argv>`` as ``ranks`` processes; returns the exit code for the user."""
    return launch_ranks([sys.executable, "-m", "zdsl.cli", *child_argv], ranks, timeout_s, graph)


def launch_ranks(command: list[str], ranks: int, timeout_s: float = 120.0, graph=None,
                 extra_env: dict[str, str] | None = None, first_status: bool = False) -> int:
    """Run ``command`` as ``ranks`` processes, each with its rank's variables, its error file and
    progress board, and ``extra_env``; watch them as the module says. The exit code for the user:
    0, or after a failure 1 (``first_status``: the status of the first rank that failed)."""
    port = free_port()
    errors = Path(tempfile.mkdtemp(prefix="zdsl-run-"))
    procs: list[subprocess.Popen] = []
    previous = {s: signal.signal(s, raise_launcher_stopped) for s in LAUNCHER_SIGNALS}
    try:
        boards = [new_board(errors / f"rank{rank}.progress") for rank in range(ranks)]
        for rank in range(ranks):
            values = {**rank_env(rank, ranks, port), **(extra_env or {}),
                      "ZDSL_ERROR_FILE": str(errors / f"rank{rank}.err")}
            child_env = env.child_environment((), **values)
            # each rank in a session of its own, as torchrun starts them: where the kernel shares
            # CPU time between sessions first (autogroup), ranks in one session split one share
            procs.append(subprocess.Popen(command, env=child_env, start_new_session=True))
        watch = Watch(procs, boards, timeout_s)
        codes = watch.run()
        if all(c == 0 for c in codes):
            return 0
        report_failure(errors, codes, watch, graph)
        return failed_status(codes, watch) if first_status else 1
    except (KeyboardInterrupt, LauncherStopped) as exc:
        for s in LAUNCHER_SIGNALS:           # a second signal must not cut the stopping short
            signal.signal(s, signal.SIG_IGN)
        stop(procs)
        signum = exc.signum if isinstance(exc, LauncherStopped) else signal.SIGINT
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"zdsl: {what}; all ranks stopped", file=sys.stderr)
        return 128 + signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(errors, ignore_errors=True)


def failed_status(codes: list[int], watch: Watch) -> int:
    """The exit status of the first rank that failed (a shell's 128 + N for signal N)."""
    first = watch.first_failure[1] if watch.first_failure else next(r for r, c in enumerate(codes) if c != 0)
    code = codes[first] or 1
    return 128 - code if code < 0 else code


def raise_launcher_stopped(signum, frame):
    raise LauncherStopped(signum)


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, T for stopped, Z...); '' when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def report_failure(errors: Path, codes: list[int], watch: Watch, graph=None) -> None:
    """Name the rank to blame and why; list how the others ended."""
    messages = {}
    for r in range(len(codes)):
        f = errors / f"rank{r}.err"
        if f.exists():
            messages[r] = f.read_text().strip()
    for r in watch.stopped | set(watch.culprits):        # "stopped by SIGTERM": zdsl's own doing
        if messages.get(r, "").startswith(f"rank {r}: stopped by"):
            del messages[r]
    waiter = None
    if watch.culprits:
        lead = min(watch.culprits)
        print(f"zdsl: error: {describe_culprit(lead, watch, graph)}", file=sys.stderr)
        lost = [r for r in messages if r not in watch.culprits and any(s in messages[r] for s in PEER_LOST)]
        waiter = watch.waited_by if watch.waited_by in messages else min(lost, default=None)
        if waiter is not None:        # the rank that waited for it, in the op it waited in
            print(f"zdsl: {peer_lost_text(messages[waiter], f'rank {lead}')}", file=sys.stderr)
    else:
        lead = root_cause(codes, messages, watch.first_failure[1] if watch.first_failure else None)
        text = messages.get(lead) or describe_exit(lead, codes[lead])
        print(f"zdsl: error: {peer_lost_text(text, 'a peer')}", file=sys.stderr)
    def ended(r: int) -> str:
        if r in watch.culprits:
            return f"stopped by zdsl: {watch.culprits[r]}"
        if r in messages:
            return "failed after it"
        return "stopped by zdsl" if r in watch.stopped else describe_exit(r, codes[r])

    others = [r for r in range(len(codes)) if r not in (lead, waiter) and codes[r] != 0]
    if others:
        print("zdsl: the other ranks stopped too: " + ", ".join(f"rank {r} ({ended(r)})" for r in others),
              file=sys.stderr)


def describe_culprit(r: int, watch: Watch, graph) -> str:
    board = watch.seen[r]
    how = "killed it" if "stopped (SIGSTOP" in watch.culprits[r] else "stopped it"
    if any(seen[CALLS_MADE] > 0 for seen in watch.seen):   # a user's own loop: its call, or its own code
        return f"rank {r} stopped making progress {where_in_calls(board, graph)}: {watch.culprits[r]}; zdsl {how}"
    running = running_ops(board)
    upcoming = next_collective(graph, board[ISSUED])
    if board[STEP] < 0:
        where = "before its first step"
    elif board[STEP_DONE] == board[STEP]:                                 # steps counted from 1, as shown
        where = f"after step {board[STEP] + 1}" + (
            f", before op {describe_op_id(graph, upcoming)} of step {board[STEP] + 2}" if upcoming is not None else "")
    elif running:
        where = f"in step {board[STEP] + 1}, in op " + " and op ".join(describe_op_id(graph, op) for op in running)
    else:
        before = f", before op {describe_op_id(graph, upcoming)}" if upcoming is not None else ""
        where = f"in step {board[STEP] + 1}" + before
    last = f" (the last op it finished: {describe_op_id(graph, board[LAST_DONE])})" if board[LAST_DONE] >= 0 else ""
    return f"rank {r} stopped making progress {where}{last}: {watch.culprits[r]}; zdsl {how}"


def where_in_calls(board, graph) -> str:
    """Where a rank of a user's loop (``zdsl.initialize``) is: in a call of the engine (and the ops
    it runs), or in its own code after its last call, or before its first."""
    if board[CALLS_MADE] <= 0:
        return "in its own code, before its first call of the engine (zdsl.initialize())"
    call = f"{ENGINE_CALLS[board[LAST_CALL]]}"
    if board[CALL_STEP] >= 0 and board[LAST_CALL] != ENGINE_CALLS.index("zdsl.initialize()"):
        call += f" (step {board[CALL_STEP]}, micro-batch {board[CALL_MICRO]})"
    if board[CALL] < 0:
        return f"in its own code, after its call {call} returned"
    running = running_ops(board)
    ops = (", in op " + " and op ".join(describe_op_id(graph, op) for op in running)) if running else ""
    return f"in its call {call}{ops}"


def next_collective(graph, issued: int) -> int | None:
    """The op id of the collective a rank issues after ``issued`` of them (every step issues the
    graph's collectives in graph order, where one lane issues them all)."""
    if graph is None:
        return None
    comms = [op for op in graph.ops if op.kind.startswith("comm.")]
    if not comms or len({op.lane for op in comms}) != 1:
        return None
    return comms[issued % len(comms)].id


def describe_op_id(graph, op_id: int) -> str:
    if graph is None or not 0 <= op_id < len(graph.ops) or graph.ops[op_id].id != op_id:
        return f"#{op_id}"
    return describe_op(graph.ops[op_id])


def peer_lost_text(text: str, who: str) -> str:
    """A rank's error caused by a peer, in zdsl's words instead of gloo's."""
    if not any(s in text for s in PEER_LOST) or any(s in text for s in PEER_LOST_SAID):
        return text
    head, failed, _ = text.partition(" failed: ")
    if failed:                                   # an op's error: gloo's text is the cause
        return f"{head} failed: the collective failed because {who} left or stopped answering"
    rank, _, detail = text.partition(": ")       # joining the group, or a collective outside the ops
    detail = GLOO_SOURCE.sub("", detail)         # gloo's file and line say nothing to a user
    return f"{rank}: {who} left or stopped answering ({detail})"


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


