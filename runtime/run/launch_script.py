"""``zdsl launch --ranks N [--timeout S] SCRIPT ARGS...``: a user's own training script as N ranks.

The script drives a schedule through ``zdsl.initialize`` (``runtime/api/``); this starts it as
``zdsl run`` starts its ranks (``launch.py``'s :func:`~zdsl.runtime.run.launch.launch_ranks`):
each with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, a free
MASTER_PORT), its error file and progress board, its output relayed, a guard that ends it when the
launcher is gone (``script_rank.py`` runs the script inside it); SIGTERM, SIGHUP or SIGINT stop every
rank, and a rank that hangs is named with the call of the engine it is in, or as in its own code.
The launcher knows no schedule: ``initialize`` runs the resource pre-flight in the ranks
(``script_rank.launch_preflight``), told so by ``ZDSL_LAUNCH_TIMEOUT``, which also carries
``--timeout`` as the collective timeout of a script that gives initialize() none.

Exit status: 0 when every rank ended 0, else the status of the first rank that failed (128 + the
signal for one killed by a signal, as a shell says it); 2 for a usage error.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_TIMEOUT_S = 120.0        # zdsl run's --timeout, and initialize()'s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zdsl launch", description="Run a training script that calls zdsl.initialize "
                                "as N ranks on this machine (as torchrun --nproc-per-node N would), watched as "
                                "zdsl run watches its ranks.")
    p.add_argument("--ranks", type=int, required=True, metavar="N", help="how many ranks (the schedule's `ranks N`)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="seconds a collective or call of the engine waits for a peer before the run fails, where "
                        f"the script gives initialize() no timeout_s (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--ignore-limits", action="store_true",
                   help="train even where the ranks do not fit this machine's memory, cores or swap space")
    p.add_argument("script", help="the Python script, run as `python SCRIPT ARGS...` in every rank")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    from zdsl.runtime.run.launch import launch_ranks
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be more than 0 seconds, got {args.timeout:g}")
    if not Path(args.script).is_file():
        parser.error(f"no script at {args.script}")
    extra = {"ZDSL_LAUNCH_TIMEOUT": f"{args.timeout:g}", "ZDSL_IGNORE_LIMITS": "1" if args.ignore_limits else "0"}
    command = [sys.executable, "-m", "zdsl.runtime.run.script_rank", args.script, *args.args]
    return launch_ranks(command, args.ranks, timeout_s=args.timeout, extra_env=extra, first_status=True)
