"""A rank of ``zdsl launch``: the user's script run as ``__main__``, guarded as every zdsl rank is.

``python -m zdsl.runtime.run.script_rank SCRIPT ARGS...`` is what ``zdsl launch`` starts per rank
(``launch_script.py``): first the guard (:func:`zdsl.runtime.proc.guard.guard_rank`: SIGTERM,
SIGHUP, the launcher gone), then ``SCRIPT`` as ``python SCRIPT ARGS...`` runs it (``sys.argv``,
``sys.path[0]`` its folder, ``__name__ == "__main__"``). How it ends goes to the launcher through
the rank's error file: an exception of the script as ``rank R: Type: message`` (its traceback
on the rank's stderr, as Python prints it), an error of the engine as its message, a stop as
``zdsl run``'s ranks say it. The process then leaves without interpreter teardown, after the
script's exit functions (an engine not closed is closed there), as ``zdsl run``'s ranks leave.

The resource pre-flight (:func:`launch_preflight`) runs inside ``zdsl.initialize``, which alone
knows the schedule: the node's first rank judges, before any rank allocates, and every rank
stops on a refusal.
"""
from __future__ import annotations

import atexit
import os
import re
import runpy
import sys
import time
import traceback
from pathlib import Path

from zdsl import env
from zdsl.errors import ZdslApiError

VERDICT_POLL_S = 0.05
VERDICT_FILE = "preflight.verdict"       # beside the ranks' error files: "" to go on, else the refusal


class Refused(ZdslApiError):
    """The pre-flight refused the schedule on this machine (its text is zdsl run's)."""


def launched_by_zdsl() -> bool:
    """Whether this process is a rank of ``zdsl launch`` (which names its collective timeout)."""
    return env.raw("ZDSL_LAUNCH_TIMEOUT") is not None and env.raw("ZDSL_ERROR_FILE") is not None


def launch_timeout(given: float | None) -> float:
    """The collective timeout of ``initialize(timeout_s=given)``: the script's, else ``zdsl launch
    --timeout``, else ``zdsl run``'s default."""
    from zdsl.runtime.run.train import RunOptions
    if given is not None:
        return given
    text = env.get("ZDSL_LAUNCH_TIMEOUT")
    return float(text) if text else RunOptions.timeout_s


def launch_preflight(compiled, timeout_s: float) -> None:
    """Under ``zdsl launch``: the node's first rank checks the schedule fits this machine (as ``zdsl run``
    checks before starting ranks) and tells the others through a file beside their error files;
    on a refusal every rank raises :class:`Refused` (the first with the reason). Elsewhere nothing."""
    if not launched_by_zdsl():
        return
    rank = env.integer("RANK") or 0
    verdict = Path(env.get("ZDSL_ERROR_FILE") or "").parent / VERDICT_FILE
    if (env.integer("LOCAL_RANK") or 0) == 0:
        refusal = launch_refusal(compiled)
        tmp = verdict.with_name(f".{verdict.name}.{os.getpid()}")
        tmp.write_text(refusal or "")
        os.replace(tmp, verdict)                 # whole or absent, for the ranks polling it
        if refusal:
            raise Refused(refusal)
        return
    deadline = time.monotonic() + timeout_s
    while not verdict.exists():
        if time.monotonic() > deadline:
            raise ZdslApiError(f"rank {rank}: zdsl.initialize(): the node's first rank gave no verdict on the "
                               f"schedule's fit within {timeout_s:g} s")
        time.sleep(VERDICT_POLL_S)
    if verdict.read_text():
        raise Refused(f"rank {rank}: stopped: the pre-flight refused the schedule (the node's first rank says why)")


def launch_refusal(compiled) -> str | None:
    """Why the schedule's ranks cannot run on this machine (its CUDA devices, memory, cores, swap
    space), in ``zdsl run``'s words, with its fix said as ``zdsl launch`` takes it
    (:func:`in_launch_words`); warnings said on stderr. ``zdsl launch --ignore-limits`` makes a
    misfit a warning. The ranks are running (torch loaded), so no torch floor is added; how many
    would fit is counted at this count's memory per rank (fewer ranks hold larger ZeRO shards, so
    it is an upper bound, as "at most" says), not searched by compiling the schedule again."""
    from zdsl.planner.machine_fit import TorchFloor, schedule_fit
    from zdsl.runtime.run.preflight import missing_cuda
    ranks = compiled.graph.ranks
    if (env.integer("WORLD_SIZE") or ranks) != ranks:
        return None                              # initialize says the world differs, and how to fix it
    cuda = missing_cuda(compiled.schedule.device, ranks, ranks)
    if cuda is not None:
        return cuda
    fit = schedule_fit(compiled, floor=TorchFloor(0, 0, "already loaded by the running ranks"), local_ranks=ranks)
    for text in fit.warnings:
        print(f"zdsl: warning: {text}", file=sys.stderr)
    if not fit.refusals:
        return None
    if env.flag("ZDSL_IGNORE_LIMITS"):
        for text in fit.refusals:
            print(f"zdsl: warning: {text} (going on anyway: --ignore-limits)", file=sys.stderr)
        return None
    return (in_launch_words("; ".join(fit.refusals))
            + "; no rank went on to train (zdsl launch --ignore-limits trains anyway)")


SET_RANKS = re.compile(r"\(--set ranks=(\d+)\)")


def in_launch_words(refusal: str) -> str:
    """``zdsl run``'s refusal with its fix ``(--set ranks=K)`` as ``zdsl launch`` takes it: the ranks
    it starts (``--ranks``) and the schedule's ``ranks`` (launch has no ``--set``)."""
    return SET_RANKS.sub(lambda m: f"(zdsl launch --ranks {m[1]}, with `ranks {m[1]}` in the schedule or "
                                   f"initialize(overrides={{'ranks': '{m[1]}'}}))", refusal)


def run_script(script: str, rank: int) -> int:
    """Run ``script`` as ``__main__``; its exit status, its failure written for the launcher."""
    from zdsl.runtime.proc.guard import Stopped, report_stop, stop_requested
    from zdsl.runtime.run.cli import fail, name_lost_peer
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return exit_status(exc.code)
    except (Stopped, KeyboardInterrupt) as exc:
        return report_stop(exc)
    except Refused as exc:
        return fail(rank, str(exc))
    except BaseException as exc:  # noqa: BLE001 - every failure names the rank, for the launcher
        stopped = stop_requested()
        if stopped is not None:                   # what broke while stopping is no error of its own
            return report_stop(stopped)
        if isinstance(exc, ZdslApiError):
            text = str(exc) if str(exc).startswith(f"rank {rank}") else f"rank {rank}: {exc}"
        else:
            traceback.print_exc()                 # the script's own error: where, as Python shows it
            text = f"rank {rank}: {type(exc).__name__}: {exc}"
        return fail(rank, name_lost_peer(text, rank))


def exit_status(code) -> int:
    """``sys.exit(code)``'s status, as Python gives it (a message: printed, status 1)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    from zdsl.runtime.proc.guard import Stopped, guard_rank, report_stop
    from zdsl.runtime.run.cli import leave
    guard_rank()                          # first, before any thread starts
    if len(sys.argv) < 2:
        print("usage: python -m zdsl.runtime.run.script_rank SCRIPT [ARGS...] (started by zdsl launch)",
              file=sys.stderr)
        leave(2)
    script = sys.argv[1]
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = str(Path(script).resolve().parent)          # as `python SCRIPT` has it
    rank = env.integer("RANK") or 0
    code = run_script(script, rank)
    try:
        atexit._run_exitfuncs()           # the script's exit functions (an engine left open is closed)
    except (Stopped, KeyboardInterrupt) as exc:
        code = report_stop(exc)
    leave(code)


if __name__ == "__main__":
    # through the module's own name, so that the Refused initialize() raises is the class caught here
    from zdsl.runtime.run import script_rank
    script_rank.main()
