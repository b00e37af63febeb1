"""zdsl at stage 1, 2 or 3, run through its own CLI: ``zdsl run FILE --set zero=N --metrics OUT``.

The schedule is generated from the same :class:`BenchConfig` the torch
peers use (model, data, seed, AdamW settings, batch per rank, ranks on cpu),
so the only differences are the ones a user of the CLI gets. ``zdsl run``
launches and waits for its own rank processes; this wrapper reads the
per-step metrics zdsl writes (loss averaged over ranks, step seconds as the
slowest rank's) and takes peak RSS from ``getrusage(RUSAGE_CHILDREN)``: the
largest high-water mark of any process it waited for, which is the largest
rank (the launcher itself imports no torch and stays small). CPU seconds a step
are read from the ranks' ``/proc/PID/stat`` (user + system, every thread) each
time a metrics line appears: the step and the hand-over to the next one (batch,
metrics exchange), which the torch peers' ``process_time`` around the step
leaves out, so zdsl's figure is the larger by that.

With ``cfg.extra["timing"] == "loop"`` (``benchmarks/api_overhead.py``) a step's time is instead
the whole loop's wall time, from one step's metrics line appearing to the next's (batch made,
step, metrics gathered and written), as the harness then times a torchrun job's loop.

It writes ``DIR/rank0.json`` in the harness's format with ``world`` = 1
row that already holds the across-rank figures, plus zdsl's own accounted
peak bytes per tier and rank, and the cores and gloo loop policy its ranks were
given (``ZDSL_BIND_CORES``, ``ZDSL_GLOO_LOOP_POLICY``: zdsl applies both itself).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peers import BenchConfig, _descendants, data_statement, job_env, run_bounded, stop_tree


def model_statement(cfg: BenchConfig) -> str:
    """The ``model`` the torch peers train: the built-in GPT, or the saved HF folder they load."""
    if cfg.model == "hf:llama":
        from benchmarks.peers.hf_llama import ATTENTION
        return f'hf("{cfg.hf_dir}", attn_implementation="{ATTENTION}")'
    return (f"gpt(layers={cfg.layers}, width={cfg.width}, heads={cfg.heads}, "
            f"vocab={cfg.vocab}, context={cfg.context})")


def schedule_text(cfg: BenchConfig, stage: int = 3) -> str:
    """A .zs file training exactly what the torch peers train (fp32 AdamW, no clipping)."""
    b1, b2 = cfg.betas
    return "\n".join([
        f'schedule vs_peers "benchmarks/vs_peers.py: the peers\' {cfg.model} at 2 ranks on gloo"',
        f"model     {model_statement(cfg)}",
        f"data      {data_statement(cfg)}",
        f"train     steps={cfg.total_steps}, batch={cfg.batch}, accumulate=1, precision=fp32, seed={cfg.seed}",
        f"optimizer adamw(lr={cfg.lr!r}, betas=({b1!r}, {b2!r}), weight_decay={cfg.weight_decay!r}, "
        f"eps={cfg.eps!r})",
        "ranks     2 on cpu",
        f"zero      {stage}",
        "",
    ])


def zdsl_command() -> list[str]:
    """How to call the CLI: the console script of this Python's environment (a venv run by its
    own python need not be on PATH), else the one on PATH, else ``python -m zdsl.cli``."""
    beside = Path(sys.executable).parent / "zdsl"
    exe = str(beside) if beside.is_file() else shutil.which("zdsl")
    return [exe] if exe else [sys.executable, "-m", "zdsl.cli"]


def availability(cfg: BenchConfig, workdir: Path) -> str | None:
    """None when ``zdsl run`` accepts this benchmark's schedule; else why not.

    Checks the CLI has ``run`` with ``--metrics`` and that ``zdsl check``
    accepts the generated schedule, so a missing piece shows as one line
    ("unavailable: ...") instead of a failed job.
    """
    base = zdsl_command()
    try:
        helped = subprocess.run([*base, "run", "--help"], capture_output=True, text=True, timeout=120,
                                env=job_env(cfg))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`zdsl run --help` did not run: {exc}"
    if helped.returncode != 0 or "--metrics" not in helped.stdout:
        return "`zdsl run ... --metrics` is not available yet: " + _last_line(helped.stderr or helped.stdout)
    workdir.mkdir(parents=True, exist_ok=True)
    probe = workdir / "zdsl_probe.zs"
    probe.write_text(schedule_text(cfg))
    try:
        checked = subprocess.run([*base, "check", str(probe)], capture_output=True, text=True, timeout=120,
                                 env=job_env(cfg))
    except subprocess.TimeoutExpired:
        return "`zdsl check` did not finish in 120 s"
    if checked.returncode != 0:
        return "`zdsl check` rejects the benchmark schedule: " + _last_line(checked.stderr or checked.stdout)
    return _smoke_run(base, cfg, workdir)


def _smoke_run(base: list[str], cfg: BenchConfig, workdir: Path) -> str | None:
    """One step of a tiny copy of the schedule at stage 3: does ``zdsl run`` train at all?"""
    tiny = BenchConfig.from_json(cfg.to_json())
    tiny.context, tiny.steps, tiny.warmup = 16, 1, 0
    if cfg.model == "gpt":     # the HF folder's weights fix its sizes: only the context shrinks
        tiny.layers, tiny.width, tiny.heads = 1, 32, 2
    schedule = workdir / "zdsl_smoke.zs"
    schedule.write_text(schedule_text(tiny))
    metrics = workdir / "zdsl_smoke.jsonl"
    metrics.unlink(missing_ok=True)
    log = workdir / "zdsl_smoke.log"
    with open(log, "w") as sink:
        code = run_bounded([*base, "run", str(schedule), "--metrics", str(metrics), "--quiet"], 180,
                           env=job_env(cfg), stdout=sink, stderr=subprocess.STDOUT)
    if code is None:
        return "`zdsl run` did not finish a 1-step smoke run of a tiny model in 180 s"
    if code != 0:
        return "`zdsl run` failed a 1-step smoke run: " + _last_line(log.read_text(errors="replace"))
    if not metrics.exists() or not metrics.read_text().strip():
        return "`zdsl run --metrics` wrote no metrics in a 1-step smoke run"
    return None


def _last_line(text: str) -> str:
    """The line that says why: the last ``error:`` line, else the last line."""
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[-1]


def read_metrics(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda row: row["step"])


def run_job(cfg: BenchConfig, stage: int, out: Path, timeout_s: float) -> int:
    """Write the schedule, run ``zdsl run`` on it, convert its metrics; exit status."""
    out.mkdir(parents=True, exist_ok=True)
    schedule = out / "vs_peers.zs"
    schedule.write_text(schedule_text(cfg, stage=3))
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [*zdsl_command(), "run", str(schedule), "--set", f"zero={stage}",
               "--metrics", str(metrics), "--quiet"]
    print("$", " ".join(command), flush=True)
    code, cpu, seen_at = run_watching_cpu(command, timeout_s, job_env(cfg), metrics)
    if code is None:
        print(f"zdsl run did not finish in {timeout_s:.0f} s", file=sys.stderr)
        return 1
    if code != 0:
        print(f"zdsl run exited with {code}", file=sys.stderr)
        return code
    if not metrics.exists():
        print(f"zdsl run wrote no metrics to {metrics}", file=sys.stderr)
        return 1
    rows = read_metrics(metrics)
    told = ran_with(cfg)
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    step_s = [r["step_s"] for r in rows]
    if cfg.extra.get("timing") == "loop" and len(seen_at) == len(rows):
        # the whole loop: one metrics line to the next (the first step keeps its graph time: a warm-up)
        step_s[1:] = [b - a for a, b in zip(seen_at, seen_at[1:])]
    result = dict(peer=f"zdsl{stage}", rank=0, world=1, step_s=step_s,
                  loss=[r["loss"] for r in rows], warmup=cfg.warmup, peak_rss=peak_rss, base_rss=None,
                  ran_with=told, cpu_s=cpu if len(cpu) == len(rows) else None,
                  cuda_peak=None, zdsl_peak_bytes=rows[-1].get("peak_bytes") if rows else None,
                  info=dict(wrapper=f"zdsl run --set zero={stage}", optimizer="zdsl AdamW (sharded)",
                            rss="max over ranks (getrusage of the launcher's children)"))
    (out / "rank0.json").write_text(json.dumps(result))
    return 0


def _cpu_seconds(pid: int) -> float | None:
    """User + system seconds of every thread of ``pid`` so far (/proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_watching_cpu(command: list[str], timeout_s: float, env: dict, metrics: Path,
                     poll_s: float = 0.005) -> tuple[int | None, list[float | None], list[float]]:
    """Run ``zdsl run``; its exit status (None: timed out), per step the largest CPU seconds
    any rank spent from the previous metrics line to this one (None for the first step, which
    has no start, and where /proc is not there), and per step the time its metrics line was
    seen (``time.monotonic``, within ``poll_s``). Stopped like :func:`run_bounded`."""
    proc = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + timeout_s
    seen, last, cpu = 0, None, []
    seen_at: list[float] = []
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                stop_tree(proc)
                return None, cpu, seen_at
            time.sleep(poll_s)
            try:
                lines = metrics.read_bytes().count(b"\n")
            except OSError:
                continue
            if lines == seen:
                continue
            seen_at.extend([time.monotonic()] * (lines - seen))
            now = {pid: _cpu_seconds(pid) for pid in _descendants(proc.pid)}
            if last is None:
                cpu.extend([None] * (lines - seen))
            else:
                spent = [now[p] - last[p] for p in now if now[p] is not None and last.get(p) is not None]
                cpu.extend([max(spent) / (lines - seen) if spent else None] * (lines - seen))
            seen, last = lines, now
    except BaseException:
        stop_tree(proc)
        raise
    return proc.returncode, cpu, seen_at


def ran_with(cfg: BenchConfig, ranks: int = 2) -> dict:
    """The cores each rank is bound to and its gloo loop policy, as zdsl's own binding
    (``affinity.rank_cores`` over this launcher's cores) and ZDSL_GLOO_LOOP_POLICY give them."""
    from zdsl import env
    from zdsl.runtime.dist.affinity import rank_cores
    policy = cfg.loop_policy or env.get("ZDSL_GLOO_LOOP_POLICY")
    if not hasattr(os, "sched_getaffinity"):
        return dict(cores=None, bound=False, loop_policy={policy: ranks})
    given = sorted(os.sched_getaffinity(0))
    cores = [rank_cores(r, ranks, given) if cfg.bind == "cores" else given for r in range(ranks)]
    return dict(cores=cores, bound=any(c != given for c in cores), loop_policy={policy: ranks})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one zdsl job of benchmarks/vs_peers.py")
    parser.add_argument("--config", required=True)
    parser.add_argument("--stage", type=int, required=True, choices=(0, 1, 2, 3))
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=540.0)
    args = parser.parse_args(argv)
    cfg = BenchConfig.from_json(Path(args.config).read_text())
    return run_job(cfg, args.stage, Path(args.out), args.timeout)


if __name__ == "__main__":
    sys.exit(main())
