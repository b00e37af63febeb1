"""``zdsl run FILE --variants V.json``: several short runs of one schedule in one launch (``zdsl tune``'s rounds).

``V.json`` is a list of ``{"overrides": ["key=value", ...], "metrics": "OUT.jsonl"}``. Each variant
is a complete run as ``zdsl run FILE --set ... --metrics OUT.jsonl`` would do it: compiled from the
file with the command's ``--set`` overrides and then its own, a fresh model, state and optimizer
from the seed, its own metrics file; then the next variant, in the file's order. The launcher and
the ranks' start-up (torch's import) are paid once for all of them.

The launcher checks every variant as ``zdsl run`` checks its schedule (it compiles, passes the
checks before any rank starts, and all need the same number of ranks), then starts the ranks with
a copy of the file that gives each variant its own rendezvous port: a rank done with one variant
joins the next group while its peer may still be leaving the last one, and on a reused port it
would meet the old group's store. A rank runs the variants in turn; the first that fails ends it,
its error naming the variant. Of a single run's options only ``--timeout``, ``--quiet`` and
``--ignore-limits`` go with ``--variants``.
"""
from __future__ import annotations

import argparse
import copy
import json
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from zdsl import env
from zdsl.check.loop import refuse_for_run
from zdsl.driver import compile_file, report, status_of
from zdsl.ir import TaskGraph
from zdsl.lang.overrides import parse_sets
from zdsl.runtime.dist.spawn import MASTER_ADDR
from zdsl.runtime.run.launch import launch_local
from zdsl.runtime.run.preflight import preflight

EXIT_INVALID, EXIT_USAGE = 1, 2     # zdsl/cli.py's
# options of a single run that have no meaning per variant (each writes only its metrics)
SINGLE_RUN_ONLY = ("metrics", "tensorboard", "trace", "timeline", "export", "checkpoint_every", "checkpoint_dir",
                   "keep", "resume", "fresh_optimizer")


RunOne = Callable[[object, argparse.Namespace], int]     # (compiled, args) -> a rank's exit status
Fail = Callable[[int, str], int]                         # (rank, text) -> exit status, the error reported


class VariantsError(Exception):
    """A variants file that cannot be run; the message says why."""


@dataclass
class Variant:
    overrides: list[str]           # "key=value", after the command's own --set
    metrics: str
    port: int | None = None        # its group's rendezvous port (the launcher's copy sets it)

    def label(self, index: int, count: int) -> str:
        return f"variant {index + 1} of {count} ({' '.join(self.overrides) or 'no overrides'})"


def read_variants(path: str) -> list[Variant]:
    """The variants of ``path``; VariantsError when it is not a non-empty list of them."""
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise VariantsError(f"cannot read the variants file {path}: {exc}") from None
    if not isinstance(items, list) or not items:
        raise VariantsError(f"{path}: expected a non-empty JSON list of {{\"overrides\": [...], \"metrics\": path}}")
    out = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise VariantsError(f"{path}: variant {i} is not a JSON object")
        overrides, metrics, port = item.get("overrides", []), item.get("metrics"), item.get("port")
        if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
            raise VariantsError(f"{path}: variant {i}: \"overrides\" must be a list of \"key=value\" strings")
        if not isinstance(metrics, str) or not metrics:
            raise VariantsError(f"{path}: variant {i}: \"metrics\" must be the path of its metrics file")
        if port is not None and not isinstance(port, int):
            raise VariantsError(f"{path}: variant {i}: \"port\" must be an integer")
        out.append(Variant(list(overrides), metrics, port))
    return out


def run_variants(args, base: dict[str, str], parser: argparse.ArgumentParser, run_one: RunOne, fail: Fail) -> int:
    """``zdsl run FILE --variants V.json`` in this process's role: the launcher, or one rank. A rank
    trains each variant with ``run_one(compiled, args)`` (``zdsl run``'s rank: its exit status) and
    reports its own errors with ``fail(rank, text)``."""
    given = [f"--{name.replace('_', '-')}" for name in SINGLE_RUN_ONLY if getattr(args, name)]
    if given:
        parser.error(f"{given[0]} is not taken with --variants: each variant writes only its own metrics")
    try:
        variants = read_variants(args.variants)
    except VariantsError as exc:
        print(f"zdsl run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    rank = env.raw("RANK")
    if rank is None:
        return launch_variants(args, base, variants, parser)
    return run_rank_variants(int(rank), args, base, variants, parser, run_one, fail)


def compile_variant(args, base: dict[str, str], variant: Variant, parser):
    compiled = compile_file(args.file, {**base, **parse_sets(variant.overrides, parser)}, simulate=False)
    refuse_for_run(compiled)
    return compiled


def launch_variants(args, base: dict[str, str], variants: list[Variant], parser) -> int:
    """Check every variant before any rank starts, then launch the ranks once for all of them."""
    ranks = None
    graphs: dict[str, TaskGraph] = {}
    for i, variant in enumerate(variants):
        name = variant.label(i, len(variants))
        compiled = compile_variant(args, base, variant, parser)
        if not compiled.ok:
            report(compiled)
            print(f"zdsl run: error: {name} does not check (above)", file=sys.stderr)
            return status_of(compiled)
        if ranks is not None and compiled.graph.ranks != ranks:
            print(f"zdsl run: error: {name} runs on {compiled.graph.ranks} ranks, the first variant on {ranks}: "
                  f"the variants of one launch share its ranks", file=sys.stderr)
            return EXIT_INVALID
        ranks = compiled.graph.ranks
        graphs.setdefault(compiled.graph.digest(), compiled.graph)
        one = copy.copy(args)
        one.metrics = variant.metrics
        refused = preflight(compiled, one, {**base, **parse_sets(variant.overrides, parser)})
        if refused is not None:
            print(f"zdsl run: error: {name} cannot run here (above)", file=sys.stderr)
            return refused
        try:
            Path(variant.metrics).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"zdsl run: error: {name}: cannot make the folder of {variant.metrics}: {exc.strerror or exc}",
                  file=sys.stderr)
            return EXIT_USAGE
    with tempfile.TemporaryDirectory(prefix="zdsl-variants-") as tmp:
        ported = Path(tmp) / "variants.json"
        ports = free_ports(len(variants))
        ported.write_text(json.dumps([{"overrides": v.overrides, "metrics": v.metrics, "port": p}
                                      for v, p in zip(variants, ports)]), encoding="utf-8")
        child = ["run", args.file, "--variants", str(ported), "--timeout", str(args.timeout)]
        child += ["--quiet"] if args.quiet else []
        for key, value in base.items():
            child += ["--set", f"{key}={value}"]
        assert ranks is not None        # set by the first variant's check (a run has one at least)
        # the launcher names a stuck rank's op from the graph: only when every variant has the same one
        return launch_local(child, ranks, timeout_s=args.timeout,
                            graph=next(iter(graphs.values())) if len(graphs) == 1 else None)


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports nothing listens on now (held open together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((MASTER_ADDR, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_rank_variants(rank: int, args, base: dict[str, str], variants: list[Variant], parser, run_one: RunOne,
                      fail: Fail) -> int:
    """One rank: each variant compiled and trained in turn, each in a process group of its own."""
    if any(v.port is None for v in variants):
        return fail(rank, f"rank {rank}: --variants needs zdsl run's launcher (it gives each variant its own "
                          f"rendezvous port); start it without RANK set")
    for i, variant in enumerate(variants):
        name = variant.label(i, len(variants))
        compiled = compile_variant(args, base, variant, parser)
        if not compiled.ok:                   # the launcher checked it: only a file changed since
            if rank == 0:
                report(compiled)
            return fail(rank, f"rank {rank}: {name} does not check")
        env.export(MASTER_PORT=str(variant.port))
        one = copy.copy(args)
        one.metrics = variant.metrics
        code = run_one(compiled, one)
        if code != 0:
            name_in_error(name)
            return code
    return 0


def name_in_error(name: str) -> None:
    """Add which variant failed to the error the rank left for its launcher."""
    path = env.get("ZDSL_ERROR_FILE")
    if not path or not Path(path).is_file():
        return
    text = Path(path).read_text().rstrip()
    Path(path).write_text(f"{text} (in {name})")
