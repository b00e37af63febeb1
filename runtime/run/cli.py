"""``zdsl run FILE``: compile, then launch the ranks (or be one of them).

Without ``RANK`` in the environment this process is the launcher: it
compiles the schedule once to reject a bad one before any rank starts, then
starts one process per rank (``runtime/run/launch.py``). With ``RANK`` set (by
that launcher, torchrun, or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) it runs one rank.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import NamedTuple, NoReturn

from zdsl import env
from zdsl.check.loop import refuse_for_run
from zdsl.driver import compile_file, report, status_of
from zdsl.lang.overrides import parse_sets
from zdsl.log import configure_logging
from zdsl.runtime.proc.guard import Stopped, guard_rank, report_stop, stop_requested
from zdsl.runtime.run.launch import launch_local, nodes_problem, peer_lost_text
from zdsl.runtime.run.preflight import preflight
from zdsl.runtime.run.tensorboard import missing_tensorboard
from zdsl.runtime.run.variants import run_variants
from zdsl.sim import profile_cache


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zdsl run", description="Train with a schedule.")
    p.add_argument("file", help="the .zs schedule")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a train or policy value (repeatable)")
    p.add_argument("--metrics", metavar="OUT.jsonl", help="one JSON line per step")
    p.add_argument("--tensorboard", metavar="DIR", help="TensorBoard scalars per step, in a new run folder "
                   "under DIR (needs the extra: pip install 'zdsl[tensorboard]')")
    p.add_argument("--trace", metavar="OUT.json", help="Chrome trace of the measured ops (Perfetto)")
    p.add_argument("--trace-steps", type=int, default=3, metavar="N",
                   help="steps the trace keeps, the last N (default 3)")
    p.add_argument("--timeline", metavar="OUT.svg", help="picture of one measured step")
    p.add_argument("--export", metavar="OUT.safetensors", help="final full fp32 state dict "
                   "(with --format hf: a Hugging Face model folder)")
    p.add_argument("--format", choices=("plain", "hf"), default="plain",
                   help="--export as the model's state dict (plain, default) or a folder from_pretrained "
                        "loads (hf: `model hf(...)` models)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="--format hf: split the weights into files of at most SIZE (default 5GB)")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="save a checkpoint every N steps")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints go (default: the schedule's)")
    p.add_argument("--keep", type=int, metavar="K", help="keep the last K complete checkpoints")
    p.add_argument("--resume", metavar="DIR", help="resume from the newest complete checkpoint under DIR "
                   "(or from DIR itself, a step-N folder)")
    p.add_argument("--fresh-optimizer", action="store_true", help="with --resume: take the checkpoint's weights "
                   "and start the optimizer's state from zero (to resume with another optimizer)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds a collective may wait for a peer before the run fails (default 120)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--ignore-limits", action="store_true",
                   help="start the ranks even where they do not fit this machine's memory, cores or swap space")
    # zdsl tune's rounds: several short runs in one launch (runtime/run/variants.py)
    p.add_argument("--variants", metavar="V.json", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    if env.raw("RANK") is None:
        return run_command(argv)
    guard_rank()                  # first, before any thread starts: SIGTERM, SIGHUP, a launcher gone
    try:
        return run_command(argv)
    except (Stopped, KeyboardInterrupt) as exc:      # told to stop before or after training
        leave(report_stop(exc))


def run_command(argv: list[str] | None) -> int:

    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = parse_sets(args.overrides, parser)
    if args.trace_steps < 1:
        parser.error("--trace-steps must be at least 1")
    if args.fresh_optimizer and not args.resume:
        parser.error("--fresh-optimizer starts a resumed run's optimizer afresh: give --resume CHECKPOINT")
    if args.format == "hf":
        check_hf_export(args, parser)
    if args.tensorboard:
        missing = missing_tensorboard()
        if missing is not None:
            print(f"zdsl run: error: {missing}", file=sys.stderr)
            return 2
    unwritable = output_problem(args)
    if unwritable is not None:
        print(f"zdsl run: error: {unwritable}", file=sys.stderr)
        return 2
    rank = env.raw("RANK")
    if args.variants:
        code = run_variants(args, overrides, parser, run_one_rank, fail)
        if rank is None:
            return code
        leave(code)
    if args.trace and rank is None:               # the launcher: the traced run beside calibrated rates
        profile_cache.enable()
    compiled = compile_file(args.file, overrides, simulate=False)
    refuse_for_run(compiled)                       # a model or batches only the user's loop gives
    if rank in (None, "0") or not compiled.ok:
        report(compiled)          # errors and warnings once, not once per rank
    if not compiled.ok:
        return status_of(compiled)
    schedule, graph = compiled.schedule, compiled.graph
    assert schedule is not None and graph is not None, "a compile zdsl run may train has both"
    if args.format == "hf" and schedule.model.kind != "hf":
        from zdsl.runtime.checkpoint.export_hf import not_hf_error
        print(f"zdsl run: error: {not_hf_error(schedule.model.kind)}", file=sys.stderr)
        return 2
    clash = checkpoint_clash(compiled, args)
    if clash is not None:
        print(f"zdsl run: error: {clash}", file=sys.stderr)
        return 2
    refused = preflight(compiled, args, overrides)   # before any rank starts (or, in a rank, before step 1)
    if refused is not None:
        return refused
    if rank is None:
        child = ["run", *(argv if argv is not None else sys.argv[2:])]
        return launch_local(child, graph.ranks, timeout_s=args.timeout, graph=graph)
    nodes = nodes_problem(schedule)
    if nodes is not None:
        leave(fail(int(rank), f"rank {rank}: {nodes}"))
    leave(run_one_rank(compiled, args))


def checkpoint_clash(compiled, args) -> str | None:
    """A fresh run whose checkpoint folder already holds a complete checkpoint at a step it would
    save: said before any rank starts, not after training up to that step (the save refuses to
    overwrite it). A resumed run continues after the checkpoint it resumes from."""
    folder, every, _ = checkpointing(compiled, args)
    if args.resume or not folder or every <= 0:
        return None
    from zdsl.runtime.checkpoint.index import INDEX_NAME
    from zdsl.runtime.checkpoint.reader import list_checkpoints
    steps = compiled.graph.config["train"]["steps"]
    taken = [step for step, path in list_checkpoints(folder)
             if step % every == 0 and step <= steps and (path / INDEX_NAME).exists()]
    if not taken:
        return None
    return (f"{folder} already holds a complete checkpoint at step {taken[0]}, which this run would save "
            f"again (every {every} steps): continue it with --resume {folder}, or give another "
            f"--checkpoint-dir, or remove the old one")


class Checkpointing(NamedTuple):
    folder: str | None      # where checkpoints go (None: no checkpoints)
    every: int              # save every this many steps (0: never)
    keep: int               # the last this many complete ones are kept (0: all)


def checkpointing(compiled, args) -> Checkpointing:
    """Where, how often and how many checkpoints a run saves: ``--checkpoint-dir``,
    ``--checkpoint-every`` and ``--keep`` over the schedule's ``checkpoint`` statement."""
    spec = compiled.schedule.checkpoint
    return Checkpointing(folder=args.checkpoint_dir or (spec.dir if spec else None),
                         every=args.checkpoint_every or (spec.every if spec else 0),
                         keep=args.keep if args.keep is not None else (spec.keep if spec else 0))


def output_problem(args) -> str | None:
    """Make the folders the run's output files go in, before any rank starts (as torchtitan and
    TensorBoard do), so a run does not train and then fail writing; the reason when one cannot be."""
    outputs = [("--metrics", args.metrics), ("--trace", args.trace), ("--timeline", args.timeline)]
    if args.format != "hf":
        outputs.append(("--export", args.export))
    for flag, path in outputs:
        if not path:
            continue
        target = Path(path)
        if target.is_dir():
            return f"{flag} {path} is a folder; give a file name"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"{flag} {path}: cannot make its folder {target.parent}: {exc.strerror or exc}"
    return None


def leave(code: int) -> NoReturn:
    """End a rank without interpreter teardown: torch's C++ statics (gloo's threads) can abort the
    process while being destroyed after a clean run, turning success into SIGABRT."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:              # the launcher, and the pipes it read, are gone
        pass
    os._exit(code)


def run_one_rank(compiled, args) -> int:
    from zdsl.runtime.run.progress import Reporter
    from zdsl.runtime.run.train import LaunchError, RunOptions, train_rank

    rank_text = env.raw("RANK")
    assert rank_text is not None, "only a rank trains: its launcher (or torchrun) set RANK"
    rank = int(rank_text)
    configure_rank_logging(rank)
    saving = checkpointing(compiled, args)
    export = hf_staging(args.export, rank) if args.format == "hf" else args.export
    options = RunOptions(metrics=args.metrics, trace=args.trace, timeline=args.timeline, export=export,
                         tensorboard=args.tensorboard,
                         progress=not args.quiet, timeout_s=args.timeout, resume=args.resume,
                         fresh_optimizer=args.fresh_optimizer,
                         trace_steps=args.trace_steps,
                         checkpoint_dir=saving.folder, checkpoint_every=saving.every, checkpoint_keep=saving.keep)
    steps = compiled.schedule.train.steps
    reporter = Reporter(compiled.schedule.name, steps, args.metrics, show=not args.quiet) if rank == 0 else None
    finished = False
    try:
        train_rank(compiled.graph, compiled.schedule, compiled.units, options, reporter, eval_graph=compiled.eval_graph)
        finished = True
    except (Stopped, KeyboardInterrupt) as exc:
        return report_stop(exc)
    except LaunchError as exc:
        return fail(rank, str(exc))
    except Exception as exc:  # every failure names the rank; the op when an op failed
        stopped = stop_requested()
        if stopped is not None:                    # what broke while stopping is no error of its own
            return report_stop(stopped)
        text = str(exc) if str(exc).startswith(f"rank {rank}") else f"rank {rank}: {type(exc).__name__}: {exc}"
        if env.flag("ZDSL_DEBUG"):
            traceback.print_exc()
        return fail(rank, name_lost_peer(text, rank))
    finally:
        if reporter is not None:
            reporter.close(finished=finished)      # a summary only for a run that finished
    if args.format == "hf" and rank == 0:
        return export_hf_folder(compiled, args, export)
    return 0


def check_hf_export(args, parser) -> None:
    """``--format hf``'s arguments, before anything trains."""
    from zdsl.runtime.checkpoint.errors import CheckpointError
    from zdsl.runtime.checkpoint.export_hf import parse_size
    if not args.export:
        parser.error("--format hf says how --export writes: give --export DIR")
    try:
        parse_size(args.max_shard_size)
    except CheckpointError as exc:
        parser.error(str(exc))


def hf_staging(folder: str, rank: int) -> str:
    """Where the run's plain state dict goes before ``--format hf`` converts it (in the folder)."""
    if rank == 0:
        Path(folder).mkdir(parents=True, exist_ok=True)
    return str(Path(folder) / ".zdsl-state.safetensors")


def export_hf_folder(compiled, args, staged: str) -> int:
    """Rank 0, after training: the plain state dict ``staged`` becomes the HF folder ``--export``."""
    from zdsl.runtime.checkpoint.errors import CheckpointError
    from zdsl.runtime.checkpoint.export_hf import convert_state_dict
    try:
        convert_state_dict(staged, compiled.graph.config["model"], args.export,
                           max_shard_size=args.max_shard_size)
    except CheckpointError as exc:
        return fail(0, f"rank 0: export --format hf: {exc}")
    finally:
        Path(staged).unlink(missing_ok=True)
    return 0


def name_lost_peer(text: str, rank: int) -> str:
    """Gloo's words for a peer gone (closed connection, timeout) in zdsl's, naming the peer where
    there is only one (two ranks); the zdsl launcher names it from how each rank ended."""
    world = env.integer("WORLD_SIZE") or 0
    return peer_lost_text(text, f"rank {1 - rank}" if world == 2 else "a peer")


def fail(rank: int, text: str) -> int:
    path = env.get("ZDSL_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            f.write(text)
    else:
        print(f"zdsl: error: {text}", file=sys.stderr)
    return 1


def configure_rank_logging(rank: int) -> None:
    configure_logging(rank=rank)
