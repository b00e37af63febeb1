"""Chaos: runs of a small schedule, each with one fault at a random moment; does zdsl end them well?

    python benchmarks/chaos.py [--runs 30] [--seed 0] [--timeout 10] [--kinds kill_rank,stop_rank,...]

Each run gets ONE fault, its kind and moment drawn from ``--seed``:

  kill_rank      kill -9 of a random rank after a random number of steps
  stop_rank      kill -STOP of a random rank (the run has ``--timeout``)
  launcher_term  SIGTERM to ``zdsl run``      launcher_hup   SIGHUP
  launcher_int   SIGINT                       launcher_kill  SIGKILL (nobody left to stop the ranks)
  damaged_ckpt   a run checkpointing every 4 steps loses a rank (ZDSL_FAULT kill) at a random op and
                 step; bytes of a shard of its newest complete checkpoint are flipped; the resume must
                 fall back to an older one and continue with exactly the losses of an uninterrupted
                 run, or refuse clearly
  full_swap      the NVMe program with its swap folder on a 2 MiB tmpfs (half the runs with
                 --ignore-limits, so the ranks meet the full disk); needs root to mount
  wrong_swap     the NVMe program with each state in its own folder; after `zdsl check` passed, one
                 folder is removed: the drive folder its link named, or the folder itself with a file
                 left in its place (half the runs with --ignore-limits, so the ranks meet it); the
                 run must end naming that folder and leave nothing in the other

Every process of a run has the run's own temp folder in its command line; the benchmark
records the seconds from the fault until no such process was left (a process still
there after timeout + 40 s counts as left behind, and is killed), whether the first
error line named the right rank and cause, whether any output held a Python traceback,
and for resumes whether the losses continued exactly. It prints one line per kind and a
total; targets: 0 left behind, 0 wrong rank or cause, 0 tracebacks, every exit within
timeout + 10 s of the fault (the kinds whose fault is there from the start, damaged_ckpt,
full_swap and wrong_swap, have no such moment and are not timed).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
QUICK = ROOT / "programs" / "quickstart.zs"
NVME = ROOT / "programs" / "nvme.zs"
KINDS = ("kill_rank", "stop_rank", "launcher_term", "launcher_hup", "launcher_int", "launcher_kill",
         "damaged_ckpt", "full_swap", "wrong_swap")
LAUNCHER_SIGNALS = {"launcher_term": (signal.SIGTERM, 143, "stopped by SIGTERM"),
                    "launcher_hup": (signal.SIGHUP, 129, "stopped by SIGHUP"),
                    "launcher_int": (signal.SIGINT, 130, "interrupted")}
TRACEBACK = "Traceback (most recent call last)"
CKPT_STEPS, CKPT_EVERY = 16, 4


@dataclass
class Outcome:
    kind: str
    seconds: float | None = None           # fault -> every process gone (None: not timed)
    left_behind: int = 0
    right_message: bool = True
    traceback: bool = False
    exact: bool | None = None              # resumes: the losses continued exactly
    note: str = ""
    skipped: bool = False


@dataclass
class Run:
    """One ``zdsl run`` in its own folder (the marker every one of its processes carries)."""
    folder: Path
    args: list[str]
    env: dict = field(default_factory=dict)

    def start(self, program: Path) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "ZDSL_FAULT")}
        env.update(self.env)
        return subprocess.Popen([sys.executable, "-m", "zdsl.cli", "run", str(program), *self.args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def marked(marker: str) -> list[int]:
    """Pids of live processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
        except (OSError, IndexError):
            continue
        found.append(int(entry))
    return found


def rank_pids(marker: str) -> dict[int, int]:
    ranks = {}
    for pid in marked(marker):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = pid
    return ranks


def gone_after(marker: str, t0: float, cap_s: float) -> tuple[float | None, int]:
    """Seconds from t0 until no marked process is left, and how many were left at the cap."""
    while True:
        left = marked(marker)
        if not left:
            return time.monotonic() - t0, 0
        if time.monotonic() - t0 > cap_s:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return None, len(left)
        time.sleep(0.05)


def lines_of(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def losses(path: Path) -> dict[int, float]:
    try:
        return {m["step"]: m["loss"] for m in map(json.loads, path.read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def first_error(err: str) -> str:
    return next((line for line in err.splitlines() if line.startswith("zdsl: error:")), "")


def signal_fault(kind: str, rnd: random.Random, folder: Path, timeout: float, startup_s: float) -> Outcome:
    """A fault that strikes a running run: a rank killed or stopped, or the launcher signalled."""
    program = folder / "quick.zs"
    metrics = folder / "m.jsonl"
    shutil.copy(QUICK, program)
    run = Run(folder, ["--set", "steps=400", "--timeout", str(timeout), "--quiet", "--metrics", str(metrics)])
    proc = run.start(program)
    at_step = rnd.randint(1, 30)
    deadline = time.monotonic() + startup_s
    while lines_of(metrics) < at_step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    out = Outcome(kind)
    ranks = rank_pids(str(folder))
    if proc.poll() is not None or len(ranks) < 2:
        proc.kill()
        gone_after(str(folder), time.monotonic(), 10)
        return Outcome(kind, skipped=True, note=f"the run ended or never trained (exit {proc.poll()})")
    victim = rnd.choice(sorted(ranks))
    t0 = time.monotonic()
    if kind == "kill_rank":
        os.kill(ranks[victim], signal.SIGKILL)
    elif kind == "stop_rank":
        os.kill(ranks[victim], signal.SIGSTOP)
    elif kind == "launcher_kill":
        proc.kill()
    else:
        proc.send_signal(LAUNCHER_SIGNALS[kind][0])
    cap = timeout + 40
    try:
        stdout, stderr = proc.communicate(timeout=cap)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        out.note = "the launcher did not exit"
    out.seconds, out.left_behind = gone_after(str(folder), t0, cap)
    out.traceback = TRACEBACK in stdout + stderr
    lead = first_error(stderr)
    if kind == "kill_rank":
        out.right_message = (proc.returncode == 1 and f"rank {victim} was killed by signal SIGKILL" in lead)
    elif kind == "stop_rank":
        stopped = f"zdsl: error: rank {victim} stopped making progress"
        out.right_message = proc.returncode == 1 and lead.startswith(stopped) and "SIGSTOP" in lead and "op #" in lead
    elif kind == "launcher_kill":
        said = [line for line in stderr.splitlines() if line.startswith("zdsl:")]
        out.right_message = bool(said) and all("its launcher" in line and "is gone" in line for line in said)
    else:
        _, code, words = LAUNCHER_SIGNALS[kind]
        out.right_message = proc.returncode == code and stderr.strip() == f"zdsl: {words}; all ranks stopped"
    if not out.right_message:
        out.note = f"exit {proc.returncode}, victim rank {victim}: {(lead or stderr.strip())[:300]}"
    return out


def reference_losses(work: Path) -> dict[int, float]:
    folder = work / "reference"
    folder.mkdir(exist_ok=True)
    metrics = folder / "m.jsonl"
    if not metrics.exists():
        program = folder / "quick.zs"
        shutil.copy(QUICK, program)
        proc = Run(folder, ["--set", f"steps={CKPT_STEPS}", "--quiet", "--metrics", str(metrics)]).start(program)
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"the uninterrupted reference run failed: {err}")
    return losses(metrics)


def damaged_checkpoint(rnd: random.Random, folder: Path, work: Path, ops: int) -> Outcome:
    from zdsl.runtime.checkpoint.reader import latest_complete, list_checkpoints

    out = Outcome("damaged_ckpt")
    reference = reference_losses(work)
    program = folder / "quick.zs"
    shutil.copy(QUICK, program)
    ck = folder / "ck"
    fault = f"{rnd.randint(0, 1)}:{rnd.randrange(ops)}:kill:{rnd.randint(CKPT_EVERY + 1, CKPT_STEPS - 1)}"
    first = Run(folder, ["--set", f"steps={CKPT_STEPS}", "--quiet", "--checkpoint-every", str(CKPT_EVERY),
                         "--checkpoint-dir", str(ck)], env={"ZDSL_FAULT": fault}).start(program)
    o1, e1 = first.communicate(timeout=600)
    gone_after(str(folder), time.monotonic(), 30)
    newest = latest_complete(ck, verify=False, report=lambda text: None) if ck.exists() else None
    if first.returncode != 1 or newest is None:
        return Outcome("damaged_ckpt", skipped=True,
                       note=f"ZDSL_FAULT={fault}: exit {first.returncode}, no complete checkpoint to damage")
    shards = sorted(newest.glob("*.safetensors"))
    shard = rnd.choice(shards)
    data = bytearray(shard.read_bytes())
    flips = [rnd.randrange(len(data)) for _ in range(rnd.randint(1, 4))]
    for at in flips:
        data[at] ^= 0xFF
    shard.write_bytes(bytes(data))
    older = [step for step, path in list_checkpoints(ck) if path != newest and step < int(newest.name.split("-")[1])]
    metrics = folder / "r.jsonl"
    proc = Run(folder, ["--set", f"steps={CKPT_STEPS}", "--quiet", "--resume", str(ck),
                        "--metrics", str(metrics)]).start(program)
    stdout, stderr = proc.communicate(timeout=600)
    _, out.left_behind = gone_after(str(folder), time.monotonic(), 30)
    out.traceback = TRACEBACK in o1 + e1 + stdout + stderr
    said = stdout + stderr
    where = f"{newest.name}/{shard.name} bytes {flips}"
    if proc.returncode == 0:
        resumed = losses(metrics)
        out.exact = bool(resumed) and all(reference.get(s) == v for s, v in resumed.items())
        out.right_message = shard.name in said and "refused" in said     # the damaged file named
        if not out.exact or not out.right_message:
            out.note = f"{where}: resumed, but " + ("losses differ" if not out.exact else "the damage was not named")
    else:
        # no older checkpoint to fall back to: a clear refusal, naming the file
        out.right_message = not older and shard.name in said and "zdsl: error:" in stderr
        if not out.right_message:
            out.note = f"{where}: exit {proc.returncode}: {first_error(stderr)[:300]}"
    return out


def full_swap(rnd: random.Random, folder: Path) -> Outcome:
    swap = folder / "swap"
    swap.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(swap)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        return Outcome("full_swap", skipped=True, note=f"cannot mount a tmpfs: {mount.stderr.strip()}")
    try:
        program = folder / "nvme.zs"
        program.write_text(NVME.read_text().replace("/tmp/zdsl_nvme", str(swap)))
        return refused_run("full_swap", folder, program, [], rnd.random() < 0.5,
                           lambda lead: bool(re.search(r"disk full|free|space", lead)))
    finally:
        subprocess.run(["umount", "-l", str(swap)], capture_output=True)


def wrong_swap(rnd: random.Random, folder: Path) -> Outcome:
    """A swap folder removed between ``zdsl check`` and ``zdsl run``."""
    good, drive, link = folder / "params", folder / "drive", folder / "optim"
    good.mkdir()
    drive.mkdir()
    os.symlink(drive, link)                         # the optimizer's folder: a link to a drive's folder
    program = folder / "nvme.zs"
    shutil.copy(NVME, program)
    sets = ["--set", f'offload.parameters=nvme("{good}")', "--set", f'offload.optimizer=nvme("{link}")']
    checked = subprocess.run([sys.executable, "-m", "zdsl.cli", "check", str(program), *sets],
                             capture_output=True, text=True)
    if checked.returncode != 0:
        return Outcome("wrong_swap", skipped=True, note=f"zdsl check failed: {checked.stderr.strip()[:300]}")
    how = rnd.choice(["drive gone", "file in its place"])
    if how == "drive gone":
        drive.rmdir()                               # the link now names nothing
        gone = link
    else:
        good.rmdir()
        good.write_text("not a folder")
        gone = good
    other = link if gone == good else good
    return refused_run("wrong_swap", folder, program, sets, rnd.random() < 0.5, lambda lead: str(gone) in lead,
                       how, lambda: [str(p) for p in other.rglob("*")] if other.is_dir() else [])


def refused_run(kind: str, folder: Path, program: Path, sets: list[str], forced: bool, right: Callable[[str], bool],
                how: str = "", leftovers: Callable[[], list[str]] = list) -> Outcome:
    """Run ``program`` 3 steps (``forced``: with --ignore-limits, so the ranks meet the fault) and judge its
    end: it must fail with a first error line ``right`` accepts, leave no process, no traceback and none of
    ``leftovers()``; ``how`` names the fault's variant in the note."""
    proc = Run(folder, ["--set", "steps=3", "--quiet", *sets] + (["--ignore-limits"] if forced else [])).start(program)
    t0 = time.monotonic()
    stdout, stderr = proc.communicate(timeout=600)
    out = Outcome(kind)
    _, out.left_behind = gone_after(str(folder), t0, 30)
    out.traceback = TRACEBACK in stdout + stderr
    lead, left = first_error(stderr), leftovers()
    out.right_message = proc.returncode != 0 and right(lead) and not left
    if not out.right_message:
        variant = ", ".join(v for v in (how, "--ignore-limits" if forced else "") if v)
        out.note = (f"{variant + ': ' if variant else ''}exit {proc.returncode}: {(lead or stderr)[:300]}"
                    + (f"; left {left[:3]}" if left else ""))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0, help="the runs' --timeout (s)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ", ".join(KINDS))
    p.add_argument("--startup", type=float, default=300.0, help="seconds a run may take to reach its fault step")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    rnd = random.Random(args.seed)
    from zdsl.driver import compile_file
    quick = compile_file(str(QUICK), {}, simulate=False).graph
    if quick is None:
        sys.exit(f"chaos: {QUICK} does not compile: zdsl check {QUICK}")
    ops = len(quick.ops)
    work = Path(tempfile.mkdtemp(prefix="zdsl-chaos-"))
    outcomes: list[Outcome] = []
    try:
        for i in range(args.runs):
            kind = rnd.choice(kinds)
            folder = work / f"run{i:03d}"
            folder.mkdir()
            if kind == "damaged_ckpt":
                o = damaged_checkpoint(rnd, folder, work, ops)
            elif kind == "full_swap":
                o = full_swap(rnd, folder)
            elif kind == "wrong_swap":
                o = wrong_swap(rnd, folder)
            else:
                o = signal_fault(kind, rnd, folder, args.timeout, args.startup)
            outcomes.append(o)
            took = "-" if o.seconds is None else f"{o.seconds:.1f} s"
            print(f"run {i + 1:2d}/{args.runs}  {kind:<14} exit after {took:>7}  "
                  f"{'skipped: ' + o.note if o.skipped else ('ok' if ok(o, args.timeout) else 'FAULTY: ' + o.note)}",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(outcomes, args.timeout)


def ok(o: Outcome, timeout: float) -> bool:
    return (not o.left_behind and o.right_message and not o.traceback and o.exact is not False
            and (o.seconds is None or o.seconds <= timeout + 10))


def report(outcomes: list[Outcome], timeout: float) -> None:
    print(f"\n{'kind':<14} {'runs':>4} {'skipped':>7} {'max exit s':>10} {'median s':>8} {'left':>4} "
          f"{'wrong msg':>9} {'traceback':>9} {'inexact':>7} {'> T+10 s':>8}")
    rows = [(k, [o for o in outcomes if o.kind == k]) for k in KINDS] + [("total", outcomes)]
    for kind, group in rows:
        if not group:
            continue
        done = [o for o in group if not o.skipped]
        timed = sorted(o.seconds for o in done if o.seconds is not None)
        print(f"{kind:<14} {len(group):>4} {len(group) - len(done):>7} "
              f"{(f'{timed[-1]:.1f}' if timed else '-'):>10} {(f'{timed[len(timed) // 2]:.1f}' if timed else '-'):>8} "
              f"{sum(o.left_behind for o in done):>4} {sum(not o.right_message for o in done):>9} "
              f"{sum(o.traceback for o in done):>9} {sum(o.exact is False for o in done):>7} "
              f"{sum(o.seconds is not None and o.seconds > timeout + 10 for o in done):>8}")
    print(f"targets: 0 left behind, 0 wrong messages, 0 tracebacks, 0 inexact resumes, every timed exit "
          f"within timeout + 10 s = {timeout + 10:.0f} s of its fault")


if __name__ == "__main__":
    main()
