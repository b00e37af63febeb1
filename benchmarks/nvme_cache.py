"""Host residency of NVMe state: NVMe bytes and step time against the cache's room.

    python benchmarks/nvme_cache.py --set model.layers=4 --set model.width=1024   # a few minutes
    python benchmarks/nvme_cache.py                                                # capacity.zs as written

Runs ``programs/capacity.zs`` (or ``--schedule``) once per cache room: 0 (no ``memory host``
statement: the graph without a host cache, every use read from NVMe) and 25% and 50% of the model states on top
of the host peak that graph reaches (``--rooms``). For each it reports the host budget, the copies
the compiler keeps (Belady's rule, zdsl/compile/residency.py), the NVMe bytes per step the graph
reads and writes, what the kernel counted for the rank (``/proc/PID/io``, steps after the first,
which also carries start-up), what an LRU cache of the same room would read (simulated by the
compiler on the same access sequence), and the step time. The rank runs as in
benchmarks/capacity.py (its sampler and disk check).

Residency: state held on the host through the whole step (neither read nor written), chosen in
Belady's order at the step boundary from the room free at every moment, then parameter shards
kept between their forward and backward reads in the room left between the peaks. With clipping
(capacity.zs) the backward reads the step's optimizer state ahead first (read_optimizer_ahead),
and those states are not held: at large rooms only parameters are held.

Measured results: benchmarks/README.md (nvme_cache.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from capacity import SCHEDULE, Sampler  # noqa: E402
from zdsl.runtime.dist.spawn import free_port, rank_env  # noqa: E402
from zdsl.schedule import nvme_placements  # noqa: E402

GIB = 1 << 30


def nvme_summary(graph) -> tuple[int, int, int, str]:
    """(bytes on the NVMe tier, graph bytes read per step, written per step, swap folder)."""
    on_nvme = sum(b.bytes for b in graph.buffers.values() if b.tier == "nvme" and b.persistent)
    read = sum(op.bytes for op in graph.ops if op.kind == "nvme.read")
    written = sum(op.bytes for op in graph.ops if op.kind == "nvme.write")
    folders = sorted({f for p in nvme_placements(graph.config).values() for f in p.paths})
    if len(folders) > 1:
        raise SystemExit(f"nvme_cache.py checks one swap folder's free space; this schedule uses "
                         f"{', '.join(folders)}: give every state the same nvme(\"FOLDER\") for this benchmark")
    return on_nvme, read, written, folders[0] if folders else ""
MEMORY_LINE = re.compile(r"^\s*memory\s+host\b.*$", re.MULTILINE)


def with_host_budget(source: str, budget: int | None) -> str:
    """The program's text with its ``memory host`` line replaced (None: removed)."""
    text = MEMORY_LINE.sub("", source)
    return text if budget is None else text.rstrip() + f"\nmemory    host {budget}B\n"


def compile_text(text: str, folder: Path, name: str, sets: list[str]):
    from zdsl.driver import compile_file
    path = folder / f"{name}.zs"
    path.write_text(text)
    compiled = compile_file(str(path), dict(s.split("=", 1) for s in sets), simulate=True)
    if not compiled.ok:
        raise SystemExit(f"{name}: does not compile: " + "; ".join(str(d) for d in compiled.diagnostics))
    return path, compiled


def run_rank(path: Path, sets: list[str], metrics: Path, timeout: float) -> tuple[list[dict], Sampler, int]:
    env = dict(os.environ, **rank_env(0, 1, free_port()), MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-c", "import sys; from zdsl.cli import main; sys.exit(main())", "run",
           str(path), "--metrics", str(metrics), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    metrics.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    sampler = Sampler(proc.pid, metrics)
    sampler.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    finally:
        sampler.stop.set()
        sampler.join()
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return rows, sampler, code


def per_step_io(rows: list[dict], sampler: Sampler) -> tuple[float, float]:
    """Median bytes read and written per step after the first (which also carries start-up)."""
    reads, writes = [], []
    for i in range(1, min(len(rows), len(sampler.io_at_line))):
        a, b = sampler.io_at_line[i - 1], sampler.io_at_line[i]
        reads.append(b.get("read_bytes", 0) - a.get("read_bytes", 0))
        writes.append(b.get("write_bytes", 0) - a.get("write_bytes", 0))
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return median(reads), median(writes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", type=Path, default=SCHEDULE)
    p.add_argument("--set", dest="sets", action="append", default=[], help="overrides, as for zdsl run")
    p.add_argument("--rooms", default="0,0.05,0.25,0.5", help="cache rooms, as shares of the model states")
    p.add_argument("--keep-free", type=float, default=10.0, help="GB of disk to leave free (default 10)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per run before the rank is stopped")
    p.add_argument("--dry-run", action="store_true", help="compile and print the plan's numbers, do not train")
    args = p.parse_args(argv)

    source = args.schedule.read_text()
    work = Path(tempfile.mkdtemp(prefix="zdsl-nvme-cache-"))
    _, base = compile_text(with_host_budget(source, None), work, "room0", args.sets)
    states = sum(b.bytes for b in base.graph.buffers.values() if b.persistent and b.state)
    peak = base.sim.memory.peak("host")
    on_nvme, _, _, folder = nvme_summary(base.graph)
    print(f"{args.schedule.name} {' '.join(args.sets)}: model states {states / GIB:.2f} GiB, "
          f"{on_nvme / GIB:.2f} GiB on NVMe; host peak without a budget {peak / GIB:.2f} GiB")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        free, need = shutil.disk_usage(folder).free, on_nvme + args.keep_free * 1e9
        if free < need:
            print(f"not enough disk under {folder}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed",
                  file=sys.stderr)
            return 2
    results = []
    for room in (float(r) for r in args.rooms.split(",")):
        budget = None if room == 0 else int(peak + room * states)
        path, compiled = compile_text(with_host_budget(source, budget), work, f"room{room:g}", args.sets)
        graph = compiled.graph
        _, g_read, g_written, _ = nvme_summary(graph)
        r = graph.config.get("residency") or {}
        no_cache = g_read + r.get("saved_bytes", 0) + r.get("held_read_bytes", 0)
        lru_read = no_cache - r.get("lru_saved_bytes", 0)
        row = {"room": room, "host_budget": budget, "kept": r.get("kept", 0), "candidates": r.get("candidates", 0),
               "held": len(r.get("held", [])),
               "graph_read": g_read, "graph_written": g_written, "lru_read": lru_read, "no_cache_read": no_cache,
               "planned_host_peak": compiled.sim.memory.peak("host"), "predicted_step_s": compiled.sim.step_s}
        if not args.dry_run:
            t0 = time.perf_counter()
            rows, sampler, code = run_rank(path, args.sets, work / f"room{room:g}.jsonl", args.timeout)
            proc_read, proc_written = per_step_io(rows, sampler)
            later = [x["step_s"] for x in rows[1:]] or [x["step_s"] for x in rows]
            row.update(exit=code, wall_s=time.perf_counter() - t0, steps=[x["step_s"] for x in rows],
                       losses=[x["loss"] for x in rows], proc_read=proc_read, proc_written=proc_written,
                       step_s=sorted(later)[len(later) // 2] if later else float("nan"),
                       vmhwm_gib=sampler.hwm_kib / (1 << 20))
        results.append(row)
        print(json.dumps(row), flush=True)
    shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"{'room':>5} {'host budget':>12} {'kept':>7} {'read (graph)':>13} {'read (/proc)':>13} "
          f"{'LRU read':>10} {'no cache':>10} {'written':>10} {'step s':>8} {'peak RSS':>9} {'planned':>9}")
    for row in results:
        budget = "-" if row["host_budget"] is None else f"{row['host_budget'] / GIB:.2f} GiB"
        print(f"{row['room']:>5.0%} {budget:>12} {row['kept']:>3}/{row['candidates']:<3} "
              f"{row['graph_read'] / GIB:>9.2f} GiB {row.get('proc_read', float('nan')) / GIB:>9.2f} GiB "
              f"{row['lru_read'] / GIB:>6.2f} GiB {row['no_cache_read'] / GIB:>6.2f} GiB "
              f"{row['graph_written'] / GIB:>6.2f} GiB {row.get('step_s', float('nan')):>8.1f} "
              f"{row.get('vmhwm_gib', float('nan')):>5.2f} GiB {row['planned_host_peak'] / GIB:>5.2f} GiB")
    return 0 if all(row.get("exit", 0) == 0 for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
