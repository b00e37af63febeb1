"""The ``zdsl`` command: check, plan, and the runtime's subcommands.

``check`` and ``plan`` are the compiler (no torch, fast), ``env`` lists the
environment variables zdsl reads (``zdsl/env.py``); ``run``, ``export``,
``inspect``, ``calibrate`` and ``tune`` live in the runtime and are imported
only when asked for, so a machine without torch can still check and plan.

Exit status: 0 fine (warnings allowed), 1 invalid schedule, 2 usage error,
3 a bug in zdsl (reported as ``zdsl: internal error: ...``, never a
traceback unless ``ZDSL_DEBUG=1``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
from pathlib import Path

from zdsl import env
from zdsl.driver import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, compile_file, load, memo_units_for, report, status_of
from zdsl.lang.overrides import parse_sets
from zdsl.log import configure_logging
from zdsl.sim import profile_cache

DELEGATED = {                         # subcommand -> the module whose main(argv) runs it
    "run": "zdsl.runtime.run.cli",
    "launch": "zdsl.runtime.run.launch_script",
    "export": "zdsl.runtime.checkpoint.export_cli",
    "inspect": "zdsl.runtime.checkpoint.inspect",
    "calibrate": "zdsl.runtime.calibrate.cli",
    "tune": "zdsl.tune.cli",
}
DELEGATED_HELP = {
    "run": "train with a schedule (one process per rank)",
    "launch": "run your own training script (zdsl.initialize) as N ranks: zdsl launch --ranks N train.py ARGS",
    "export": "write a checkpoint as a plain state dict (safetensors) or a Hugging Face folder",
    "inspect": "show what a checkpoint holds",
    "calibrate": "measure this machine and write a `machine` profile",
    "tune": "try prefetch/bucket/... variants, predicted then measured",
}

# -- subcommands -------------------------------------------------------------------

def cmd_check(args, parser) -> int:
    overrides = parse_sets(args.set, parser)
    units_for = memo_units_for()
    worst = EXIT_OK
    for path in args.files:
        compiled = compile_file(path, overrides, units_for, simulate=False)
        report(compiled)
        status = status_of(compiled)
        if status == EXIT_OK:
            print(f"{path}: ok ({checked_line(compiled)})")
        worst = max(worst, status)
    return worst


def checked_line(compiled) -> str:
    """What ``zdsl check`` says of a schedule that checks: its graph's size, what the user's loop gives."""
    from zdsl.check.loop import PLAN_MODEL, from_loop
    warnings = sum(d.severity == "warning" for d in compiled.diagnostics)
    g = compiled.graph
    parts = [] if compiled.model_from_loop else \
        [f"{len(g.units)} units, {sum(u.numel for u in g.units):,} parameters, {len(g.ops):,} ops"]
    parts += [f"{warnings} warning(s)"] if warnings else []
    loop = from_loop(compiled.schedule)
    if loop:
        parts.append(f"{' and '.join(loop)} come from your own loop (zdsl.initialize)")
    if compiled.model_from_loop:
        parts.append(f"planned with {PLAN_MODEL}")
    return "; ".join(parts)


def model_option(args, overrides: dict[str, str], parser) -> dict[str, str]:
    """``--model FILE.py:FUNCTION``: the overrides as if the schedule said ``model "FILE.py:FUNCTION"()``
    (the file made absolute here: it is the command line's, relative to the working folder)."""
    if args.model is None:
        return overrides
    if "model" in overrides:
        parser.error("--model and --set model=... both give the model: give one")
    where, sep, function = args.model.rpartition(":")
    if not sep or not where or not function.isidentifier():
        parser.error(f"--model {args.model}: expected FILE.py:FUNCTION or package.module:FUNCTION")
    if where.endswith(".py"):
        where = str(Path(where).expanduser().resolve())
    from zdsl.check.printer import string_text
    return {**overrides, "model": f"{string_text(f'{where}:{function}')}()"}


def no_model_problem(compiled) -> int:
    """``zdsl plan`` of a schedule without a model and without ``--model``: say how to give one."""
    from zdsl.check.loop import PLAN_MODEL
    print(f"zdsl plan: {compiled.path}: the schedule has no model statement (the model comes from your own "
          f"loop); plan it with {PLAN_MODEL} (a function that returns the module), or add a model statement",
          file=sys.stderr)
    return EXIT_USAGE


def cmd_plan(args, parser) -> int:
    overrides = model_option(args, parse_sets(args.set, parser), parser)
    units_for = memo_units_for()
    if args.lowered:
        return print_lowered(args.file, overrides, units_for)
    profile_cache.enable(not args.no_calibrate)
    compiled = compile_file(args.file, overrides, units_for)
    report(compiled)
    if compiled.model_from_loop:
        return no_model_problem(compiled)
    graph, schedule = compiled.graph, compiled.schedule
    if compiled.sim is None or graph is None or schedule is None:     # not as far as a simulated step
        return status_of(compiled)
    from zdsl.planner.machine_fit import render_fit, schedule_fit
    from zdsl.planner.report import build_plan, render_plan
    plan = build_plan(graph, schedule, compiled.sim, units=compiled.units)
    fit = schedule_fit(compiled, overrides)          # what `zdsl run` compares before starting ranks
    evaluation = None
    if compiled.eval_sim is not None and compiled.eval_graph is not None:
        from zdsl.planner.eval_plan import eval_plan
        evaluation = eval_plan(graph, compiled.eval_graph, schedule, compiled.eval_sim)
    if args.json:
        extra = {"eval": evaluation.to_json()} if evaluation is not None else {}
        print(json.dumps({**plan.to_json(), **extra, "machine_fit": fit.to_json()}, indent=2))
    else:
        shown = render_plan(plan, color=sys.stdout.isatty())
        sys.stdout.write(shown + (evaluation.line() + "\n" if evaluation is not None else "") + render_fit(fit))
    if args.trace or args.timeline:
        from zdsl.observe.trace import predicted_trace, write_trace
        g = graph
        if args.trace_ranks is not None and args.trace_ranks < 1:
            parser.error("--trace-ranks must be at least 1")
        ranks = args.trace_ranks or traced_ranks(len(g.ops), g.ranks)
        trace = predicted_trace(g, compiled.sim, ranks=min(ranks, g.ranks))
        shown = "" if ranks >= g.ranks else \
            f"; it shows {ranks} of {g.ranks} ranks, which all run the same graph: --trace-ranks N for more"
        if args.trace:
            write_trace(args.trace, trace)
            print(f"wrote predicted trace {args.trace} (open it in https://ui.perfetto.dev{shown})",
                  file=sys.stderr)
        if args.timeline:
            from zdsl.observe.timeline import render_timeline
            render_timeline(trace, args.timeline, title=f"{g.schedule}: predicted step")
            print(f"wrote predicted timeline {args.timeline}", file=sys.stderr)
    return status_of(compiled)


def traced_ranks(ops: int, ranks: int, budget: int = 60_000) -> int:
    """How many ranks a predicted trace shows: all of them unless that makes a huge file."""
    return max(1, min(ranks, budget // max(ops, 1)))


def print_lowered(path: str, overrides, units_for) -> int:
    """The pipelines a policy file expands to, as valid .zs."""
    from zdsl.check.printer import print_schedule
    from zdsl.compile.lower import lower_policies
    from zdsl.sources import sizing_data
    compiled = load(path, overrides, units_for)
    schedule = compiled.schedule
    if compiled.ok and schedule is not None and schedule.model.kind == "loop":
        report(compiled)
        return no_model_problem(compiled)
    if compiled.ok and schedule is not None:
        units = units_for(schedule.model, **sizing_data(schedule.data))
        sys.stdout.write(print_schedule(schedule, lower_policies(schedule, units)))
    report(compiled)
    return status_of(compiled)


def cmd_env(args, parser) -> int:
    tty = sys.stdout.isatty()
    sys.stdout.write(env.render(color=tty, width=shutil.get_terminal_size().columns if tty else None))
    return EXIT_OK


def find_entry(name: str):
    """The ``main`` of the subcommand's module; an error line if it cannot be imported."""
    module_name = DELEGATED[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == "torch" or missing.startswith("torch."):
            return None, f"`zdsl {name}` needs PyTorch, which is not installed here (pip install torch)"
        if module_name == missing or module_name.startswith(missing + "."):
            return None, f"`zdsl {name}` cannot start: {module_name} is missing from this installation"
        return None, f"`zdsl {name}` cannot start: {module_name} needs {missing!r}, which is not installed"
    except ImportError as exc:
        return None, f"`zdsl {name}` cannot start: {module_name}: {exc}"
    entry = getattr(module, "main", None)
    if not callable(entry):
        return None, f"`zdsl {name}` cannot start: {module_name} has no main()"
    return entry, None


def cmd_delegated(name: str, argv: list[str]) -> int:
    entry, problem = find_entry(name)
    if entry is None:
        print(f"zdsl: {problem}", file=sys.stderr)
        return EXIT_USAGE
    result = entry(argv)
    return int(result or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zdsl", description="ZeRO sharding and offload driven by .zs schedules.",
        epilog="exit status: 0 ok, 1 invalid schedule, 2 usage error, 3 internal error")
    parser.add_argument("--log-level", default=env.get("ZDSL_LOG"),
                        choices=["debug", "info", "warning", "error"], help="structlog level (stderr)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    check = sub.add_parser("check", help="check schedules: positioned errors and warnings")
    check.add_argument("files", nargs="+", metavar="FILE")
    add_set(check)

    plan = sub.add_parser("plan", help="memory, communication and predicted step time of a schedule")
    plan.add_argument("file", metavar="FILE")
    plan.add_argument("--json", action="store_true", help="machine-readable plan on stdout")
    plan.add_argument("--trace", metavar="OUT.json", help="write the predicted step as a Chrome trace")
    plan.add_argument("--timeline", metavar="OUT.svg", help="draw the predicted step as an SVG timeline")
    plan.add_argument("--trace-ranks", type=int, metavar="N", default=None,
                      help="ranks in the predicted trace (default: all, fewer for very large graphs)")
    plan.add_argument("--lowered", action="store_true", help="print the pipelines the policies expand to (.zs)")
    plan.add_argument("--model", metavar="FILE.py:FUNCTION",
                      help="the model of a schedule without a model statement (trained from your own loop): "
                           "planned as `model \"FILE.py:FUNCTION\"()` in the schedule would be")
    plan.add_argument("--no-calibrate", action="store_true",
                      help="without a machine statement, plan with zdsl's default rates: neither calibrate "
                           "this machine nor use its cached profile")
    add_set(plan)

    sub.add_parser("env", help="the environment variables zdsl reads: default, value here, meaning")

    for name, module in DELEGATED.items():
        sub.add_parser(name, help=DELEGATED_HELP[name], add_help=False)
    return parser


def add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a train or policy value (repeatable), e.g. --set prefetch=2")


def split_delegated(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """Global options, a delegated subcommand and its own arguments (passed through untouched)."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--log-level":
            i += 2
            continue
        if tok.startswith("-"):
            i += 1
            continue
        if tok in DELEGATED:
            return argv[:i], tok, argv[i + 1:]
        break
    return argv, None, []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("zdsl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                  # `zdsl plan x.zs | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except SystemExit:
        raise
    except Exception as exc:                 # a bug in zdsl, never the user's fault
        if env.flag("ZDSL_DEBUG"):
            raise
        print(f"zdsl: internal error: {type(exc).__name__}: {exc}\n"
              f"(this is a bug in zdsl; ZDSL_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def _main(argv: list[str]) -> int:
    parser = build_parser()
    head, delegated, rest = split_delegated(argv)
    if delegated is not None:
        args = parser.parse_args(head + [delegated])
        configure_logging(level=args.log_level)
        return cmd_delegated(delegated, rest)
    args = parser.parse_args(argv)
    if args.log_level in ("debug", "info"):    # the compiler logs little; spare check/plan the import
        configure_logging(level=args.log_level)
    if args.command == "check":
        return cmd_check(args, parser)
    if args.command == "plan":
        return cmd_plan(args, parser)
    if args.command == "env":
        return cmd_env(args, parser)
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
