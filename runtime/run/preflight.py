"""``zdsl run``'s checks before any rank starts: what would otherwise fail later, or take the machine down.

- ``ranks N on cuda`` needs a CUDA device per rank on this node, as torch counts them; torch is
  imported for this only when the schedule asks for CUDA.
- The ranks must fit this machine's memory, cores and swap space
  (:mod:`zdsl.planner.machine_fit`); ``--ignore-limits`` starts them anyway.
- ``--checkpoint-every`` needs a folder, and the folder must be writable: found
  here, not at the first save after minutes of training.
- A ``data tokens(...)`` file must hold only ids below the vocab: scanned once, its verdict
  cached beside the file (:mod:`zdsl.runtime.data.tokens`), so the ranks start at once.
- ``data text(...)`` is tokenised here, once, into its cached token file
  (:mod:`zdsl.runtime.data.text`), then checked as a token file: no rank tokenises.
- ``data jsonl(...)`` is tokenised here, once (:mod:`zdsl.runtime.data.jsonl`), and the records
  longer than the context are counted: one warning here, not one per rank or step.
- ``data python(...)``'s function is called as rank 0 (twice: the same tensors?) and as the
  last rank (the same shapes?) at step 0, and for the built-in GPT or an ``hf`` model what it
  returns must be token ids within the vocab and context (:mod:`zdsl.runtime.data.python`).
- An ``eval`` source is prepared and checked in the same way, after the training data.

Under another launcher (torchrun: RANK set, not by ``zdsl run``) the ranks already
exist: the fit is only a warning, on rank 0, which also checks the checkpoint folder; every rank
refuses a node with fewer CUDA devices than its ranks there (said once, by the node's first rank).

The per-process floor of torch is measured once per torch and Python version in a
subprocess that imports what a rank imports and joins a gloo group of one, and
cached under ``~/.cache/zdsl`` (``$ZDSL_CACHE``), where ``zdsl plan`` reads it
(:func:`zdsl.planner.machine_fit.cached_floor`); ``python -m zdsl.runtime.run.preflight``
measures it for a plan that finds none.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Callable

from zdsl import env
from zdsl.planner.machine_fit import (
    NO_TORCH,
    Fit,
    TorchFloor,
    cached_floor,
    floor_cache,
    floor_kind,
    installed_torch,
    schedule_fit,
)
from zdsl.runtime.data import prepare  # torch only for a source that needs it

EXIT_INVALID, EXIT_USAGE = 1, 2     # zdsl/cli.py's: the schedule cannot run here / the command is wrong

# Used where the measurement fails: what it gave with torch 2.13 (CPU) and Python 3.11 on x86-64.
FLOOR_ESTIMATE = TorchFloor(150 << 20, 80 << 20, "estimated")

FLOOR_CODE = r"""
import json, os, shutil, sys, tempfile
import zdsl.runtime.run.train                          # what a rank imports: torch, trio, the compiler
EXTRA
import torch, torch.distributed as dist
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "store"), rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    kb = lambda key: int(status.get(key, "0 kB").split()[0]) * 1024
    print(json.dumps({"private": kb("RssAnon"), "shared": kb("RssFile") + kb("RssShmem")}), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)         # os._exit skips the with's clean-up
    os._exit(0)                                    # no teardown: gloo's threads can abort it
"""

def preflight(compiled, args, overrides: dict[str, str]) -> int | None:
    """Run the checks for this process's role; None to go on, else the exit status (already explained)."""
    rank = env.raw("RANK")
    problem = checkpoint_folder_missing(args, compiled.schedule)
    if problem:
        if rank in (None, "0"):
            print(f"zdsl: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if env.get("ZDSL_ERROR_FILE") and rank is not None:
        return None                  # a rank of `zdsl run`, whose launcher checked all of this
    code = refuse_missing_cuda(compiled, rank)
    if code is not None:
        return code
    if rank is None:
        code = refuse_unfit(schedule_fit(compiled, overrides, floor=torch_floor(floor_kind(compiled.schedule))),
                            args.ignore_limits)
        if code is not None:
            return code
    elif (env.raw("LOCAL_RANK") or rank) == "0":
        warn_unfit(compiled, overrides)
    for data in (compiled.schedule.data, *([compiled.schedule.eval.data] if compiled.schedule.eval else [])):
        code = data_problem(data, compiled.schedule, rank)     # the training data, then eval's
        if code is not None:
            return code
    if rank in (None, "0"):
        problem = checkpoint_folder_unwritable(args, compiled.schedule)
        if problem:
            print(f"zdsl: error: {problem}", file=sys.stderr)
            return EXIT_USAGE
    return None


def data_problem(data, schedule, rank: str | None) -> int | None:
    """Prepare and check one data source (the training's, or ``eval``'s) before the ranks start;
    None to go on, else the exit status (already explained on rank 0 or the launcher)."""
    problem, note = prepare(data, schedule, progress=rank in (None, "0"))
    if rank in (None, "0") and (problem or note):
        print(f"zdsl: {'error' if problem else 'warning'}: {problem or note}", file=sys.stderr)
    return EXIT_INVALID if problem else None


def refuse_unfit(fit: Fit, ignore_limits: bool) -> int | None:
    for text in fit.warnings:
        print(f"zdsl: warning: {text}", file=sys.stderr)
    if not fit.refusals:
        return None
    if ignore_limits:
        for text in fit.refusals:
            print(f"zdsl: warning: {text} (starting anyway: --ignore-limits)", file=sys.stderr)
        return None
    for text in fit.refusals:
        print(f"zdsl: error: {text}", file=sys.stderr)
    print("zdsl: no rank was started (--ignore-limits starts them anyway)", file=sys.stderr)
    return EXIT_INVALID


def warn_unfit(compiled, overrides) -> None:
    """Under another launcher, on each host's first rank: that host's ranks are running already, torch
    loaded (its floor is in use, not still needed); say what will not fit, without stopping."""
    fit = schedule_fit(compiled, overrides, floor=TorchFloor(0, 0, "already loaded by the running ranks"),
                       local_ranks=ranks_here(compiled, env.raw("RANK")))
    for text in fit.refusals + fit.warnings:
        print(f"zdsl: warning: {text}", file=sys.stderr)


def ranks_here(compiled, rank: str | None) -> int:
    """The ranks on this node: all of them under `zdsl run` (``rank`` None), this host's share under
    another launcher."""
    if rank is None:
        return compiled.graph.ranks
    return env.integer("LOCAL_WORLD_SIZE") or env.integer("WORLD_SIZE") or compiled.graph.ranks


# -- CUDA devices ---------------------------------------------------------------------

def visible_cuda_devices() -> int:
    """The CUDA devices torch sees on this node (CUDA_VISIBLE_DEVICES applied), without initialising CUDA."""
    import torch  # only for a `ranks N on cuda` schedule: a CPU run's launcher stays light
    return torch.cuda.device_count()


def missing_cuda(device: str, here: int, total: int, count: Callable[[], int] = visible_cuda_devices) -> str | None:
    """Why ``ranks {total} on cuda`` cannot run ``here`` of its ranks on this node, each on a device of
    its own (as ``train.pick_device`` places them): fewer devices visible than ranks; None where it
    can, or where the schedule's device is not ``cuda`` (``auto`` falls back to the CPU)."""
    if device != "cuda":
        return None
    seen = count()
    if seen >= here:
        return None
    visible = env.raw("CUDA_VISIBLE_DEVICES")
    given = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    fit = f"`ranks {seen} on cuda` to use the {seen} here, or " if seen and here == total else ""
    return (f"`ranks {total} on cuda` puts {here} ranks on this node, a CUDA device each, but torch sees "
            f"{seen} CUDA device{'' if seen == 1 else 's'} here{given}: write {fit}`ranks {total} on cpu` "
            f"(--set 'ranks={total} on cpu'), or run where each rank has a GPU")


def refuse_missing_cuda(compiled, rank: str | None, count: Callable[[], int] = visible_cuda_devices) -> int | None:
    """Refuse (EXIT_INVALID) a node without a CUDA device per rank: said by the launcher (``rank``
    None), or under another launcher by the node's first rank, while every rank stops."""
    problem = missing_cuda(compiled.schedule.device, ranks_here(compiled, rank), compiled.graph.ranks, count)
    if problem is None:
        return None
    if rank is None:
        print(f"zdsl: error: {problem}", file=sys.stderr)
        print("zdsl: no rank was started", file=sys.stderr)
    elif (env.raw("LOCAL_RANK") or rank) == "0":
        print(f"zdsl: error: {problem}", file=sys.stderr)
    return EXIT_INVALID


# -- checkpoints ----------------------------------------------------------------------

def checkpoint_target(args, schedule) -> tuple[str | None, str]:
    """The checkpoint folder the run will use, and where it was given."""
    if args.checkpoint_dir:
        return args.checkpoint_dir, "--checkpoint-dir"
    spec = schedule.checkpoint
    return (spec.dir, "the schedule's `checkpoint` statement") if spec else (None, "")


def checkpoint_every(args, schedule) -> int:
    spec = schedule.checkpoint
    return args.checkpoint_every or (spec.every if spec else 0)


def checkpoint_folder_missing(args, schedule) -> str | None:
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        return f"--checkpoint-every must be at least 1, got {args.checkpoint_every}"
    if args.checkpoint_every and checkpoint_target(args, schedule)[0] is None:
        return (f"--checkpoint-every {args.checkpoint_every} needs a folder to save into: add "
                f"--checkpoint-dir DIR, or the statement `checkpoint every {args.checkpoint_every} steps -> "
                f"\"DIR\"` to the schedule")
    return None


def checkpoint_folder_unwritable(args, schedule) -> str | None:
    """Create the folder (as the first save would) and a probe file in it; the reason if that fails."""
    folder, given = checkpoint_target(args, schedule)
    if folder is None or not checkpoint_every(args, schedule):
        return None
    path = Path(folder).expanduser()
    probe = path / f".zdsl-write-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"zdsl")
        probe.unlink()
    except OSError as exc:
        return (f"cannot write checkpoints to {path} (from {given}): {exc.strerror or exc}; "
                f"give a writable folder with --checkpoint-dir DIR")
    return None


# -- torch's floor per process --------------------------------------------------------

# FLOOR_CODE's EXTRA line by floor kind (zdsl.planner.machine_fit.FLOOR_KINDS): what such a rank imports
FLOOR_IMPORTS = {"": "", "hf": "from transformers.models.llama import modeling_llama   # a family's layers"}


def torch_floor(kind: str = "", measure: bool = True) -> TorchFloor:
    """Memory each rank holds before its model, from the cache or measured now (a few seconds, once);
    ``kind`` "hf": a rank of a Hugging Face model, which also imports transformers."""
    version = installed_torch()
    if version is None:
        return NO_TORCH
    python = platform.python_version()
    cached = cached_floor(version, python, kind)
    if cached is not None:
        return cached
    path = floor_cache(version, python, kind)
    where = f"torch {version}, python {python}" + (" with transformers" if kind else "")
    if not measure:
        return dataclasses.replace(FLOOR_ESTIMATE, source=f"estimated (not measured yet for {where})")
    try:
        floor = measure_floor(kind)
    except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
        return dataclasses.replace(FLOOR_ESTIMATE, source=f"estimated (measuring it failed: {exc})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(floor))
        os.replace(tmp, path)             # atomic: launchers measuring at once leave one good file
    except OSError:
        pass                              # no cache: measured again next time
    return TorchFloor(floor["private"], floor["shared"], f"measured for {where} ({path})")


def measure_floor(kind: str = "", timeout_s: float = 300.0) -> dict[str, int]:
    no_rank = env.child_environment(drop=env.LAUNCHER_VARIABLES)      # the measuring process is no rank
    code = FLOOR_CODE.replace("EXTRA", FLOOR_IMPORTS[kind])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=no_rank,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise subprocess.SubprocessError(f"exit status {done.returncode}: {done.stderr.strip()[-300:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"private": int(out["private"]), "shared": int(out["shared"])}


def main() -> None:
    """Measure (or read back) torch's floor and print it as JSON: how ``zdsl plan``, which never
    imports the runtime, gets a floor not measured yet (zdsl.planner.machine_fit.floor_from_runtime)."""
    kind = sys.argv[1] if len(sys.argv) > 1 else ""
    print(json.dumps(dataclasses.asdict(torch_floor(kind if kind in FLOOR_IMPORTS else ""))), flush=True)


if __name__ == "__main__":
    main()
