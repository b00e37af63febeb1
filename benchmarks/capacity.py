"""Capacity: train a GPT whose model states exceed 1.5x this machine's RAM, from NVMe (issue 4).

    python benchmarks/capacity.py                          # programs/capacity.zs as written (2.55e9 params)
    python benchmarks/capacity.py --set model.layers=4     # a smaller one first: estimate the step time
    python benchmarks/capacity.py --set steps=1 --nvme /scratch/zs

Runs ``programs/capacity.zs`` (ZeRO-3, one CPU rank, bf16 mixed precision,
parameters and optimizer state on NVMe) as the rank itself (``RANK=0``, so
the process measured is the one that trains, not a launcher) and reports:

* the parameter count (``zdsl.compile.units.gpt_parameter_count``) and the model
  states at 16 bytes per parameter, against 1.5x this machine's RAM;
* peak resident memory of the rank: ``VmHWM`` from ``/proc/PID/status``
  (polled) and ``ru_maxrss`` from ``wait4`` (exact, at exit);
* start-up time (model construction, unit by unit, and writing the initial
  state to the swap files) and each step's time and loss (``--metrics``);
* NVMe bytes per step: what the graph's ``nvme.read``/``nvme.write`` ops
  move (``Op.bytes``) and what the kernel counted for the process
  (``/proc/PID/io`` ``read_bytes``/``write_bytes``, sampled when each
  metrics line appears).

Before starting it checks the free space of the swap folder's file system:
the NVMe tier's bytes (from the compiled graph) plus ``--keep-free`` (10 GB)
must fit. The rank gets ``MALLOC_MMAP_THRESHOLD_=65536`` (freed buffers go
back to the OS at once, so RSS measures what is held). A benchmark, not a
test: the full model needs tens of GB of disk and minutes per step.

Measured 2026-11-21 (2 shared cores, 24 GiB RAM, ext4 on virtio): 2,549,979,648
parameters (38.0 GiB of model states, 1.61x RAM); peak RSS 7.03 GiB (4.75 GiB
of it the bf16 gradient shards); steps 143.6, 130.2, 111.4 s; loss 5.961 ->
5.432 -> 4.919; NVMe per step 37.9 GiB read, 33.25 GiB written (/proc, equal
to the graph's 38.0 / 33.2 GiB); start-up about 80 s (33 GiB of initial state
written).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zdsl.runtime.dist.spawn import free_port, rank_env  # noqa: E402

SCHEDULE = ROOT / "programs" / "capacity.zs"
GIB = 1 << 30


def read_status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def read_io(pid: int) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())}
    except OSError:
        return {}


def compile_graph(schedule: Path, sets: list[str]):
    from zdsl.driver import compile_file
    overrides = dict(s.split("=", 1) for s in sets)
    compiled = compile_file(str(schedule), overrides, simulate=False)
    if not compiled.ok:
        raise SystemExit(f"{schedule}: does not compile with {sets}: "
                         + "; ".join(str(d) for d in compiled.diagnostics))
    return compiled


def nvme_summary(graph) -> tuple[int, int, int, str]:
    """(bytes on the NVMe tier, graph bytes read per step, written per step, swap folder)."""
    on_nvme = sum(b.bytes for b in graph.buffers.values() if b.tier == "nvme" and b.persistent)
    read = sum(op.bytes for op in graph.ops if op.kind == "nvme.read")
    written = sum(op.bytes for op in graph.ops if op.kind == "nvme.write")
    places = [p for p in (graph.config.get("placement") or {}).values() if p.get("tier") == "nvme"]
    return on_nvme, read, written, places[0]["path"] if places else ""


class Sampler(threading.Thread):
    """Polls the rank: peak RSS, and /proc/PID/io whenever a new metrics line appears."""

    def __init__(self, pid: int, metrics: Path, period: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.metrics, self.period = pid, metrics, period
        self.hwm_kib = 0
        self.rss_series: list[tuple[float, int]] = []
        self.io_at_line: list[dict[str, int]] = []   # io counters when line i appeared
        self.io_start = read_io(pid)
        self.t0 = time.perf_counter()
        self.stop = threading.Event()

    def run(self) -> None:
        seen = 0
        while not self.stop.is_set():
            hwm = read_status_kib(self.pid, "VmHWM")
            if hwm:
                self.hwm_kib = max(self.hwm_kib, hwm)
                self.rss_series.append((time.perf_counter() - self.t0, read_status_kib(self.pid, "VmRSS")))
            try:
                lines = sum(1 for line in self.metrics.read_text().splitlines() if line.strip())
            except OSError:
                lines = 0
            if lines > seen:
                io = read_io(self.pid)
                self.io_at_line.extend([io] * (lines - seen))
                seen = lines
            self.stop.wait(self.period)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", type=Path, default=SCHEDULE)
    p.add_argument("--set", dest="sets", action="append", default=[], help="overrides, as for zdsl run")
    p.add_argument("--keep-free", type=float, default=10.0, help="GB of disk to leave free (default 10)")
    p.add_argument("--out", type=Path, default=Path("/tmp/zdsl-capacity-metrics.jsonl"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the rank is stopped")
    p.add_argument("--dry-run", action="store_true", help="print the sizes and the disk check, do not train")
    args = p.parse_args(argv)

    compiled = compile_graph(args.schedule, args.sets)
    graph, schedule = compiled.graph, compiled.schedule
    from zdsl.compile.units import gpt_parameter_count
    m = dict(schedule.model.args)
    params = gpt_parameter_count(**m) if schedule.model.kind == "gpt" else sum(u.numel for u in graph.units)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    states = 16 * params
    on_nvme, g_read, g_written, folder = nvme_summary(graph)
    print(f"model {m}: {params:,} parameters; model states 16 B/param = {states / GIB:.1f} GiB = "
          f"{states / ram:.2f}x RAM ({ram / GIB:.1f} GiB; target > 1.5x)")
    print(f"graph: {on_nvme / GIB:.1f} GiB on the NVMe tier under {folder}; per step it reads "
          f"{g_read / GIB:.1f} GiB and writes {g_written / GIB:.1f} GiB")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder).free
        need = on_nvme + args.keep_free * 1e9
        print(f"disk: {free / 1e9:.1f} GB free under {folder}; need {need / 1e9:.1f} GB "
              f"(tier + {args.keep_free:.0f} GB left free)")
        if free < need:
            print(f"not enough disk under {folder}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed; "
                  f"choose a smaller model (--set model.layers=N) or another folder", file=sys.stderr)
            return 2

    if args.dry_run:
        return 0
    env = dict(os.environ, **rank_env(0, 1, free_port()), MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-c", "import sys; from zdsl.cli import main; sys.exit(main())", "run",
           str(args.schedule), "--metrics", str(args.out), "--quiet"]
    for s in args.sets:
        cmd += ["--set", s]
    args.out.unlink(missing_ok=True)
    print(f"running the rank in-process (RANK=0, MALLOC_MMAP_THRESHOLD_=65536): {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    sampler = Sampler(proc.pid, args.out)
    sampler.start()
    status, rusage = 0, None
    try:
        deadline = t0 + args.timeout
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                print(f"stopping the rank after {args.timeout:.0f} s", file=sys.stderr)
                proc.kill()
                pid, status, rusage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
    finally:
        sampler.stop.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if folder and Path(folder, "rank0").exists():   # the swap files of a rank that did not clean up
        shutil.rmtree(Path(folder, "rank0"), ignore_errors=True)
    rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()] if args.out.exists() else []
    if proc.returncode != 0:
        print(f"the run failed (exit {proc.returncode}) after {wall:.0f} s, {len(rows)} steps", file=sys.stderr)

    print()
    print(f"{'step':>4} {'loss':>8} {'step s':>8} {'nvme read GiB':>14} {'nvme written GiB':>17}")
    prev = sampler.io_start
    for i, r in enumerate(rows):
        io = sampler.io_at_line[i] if i < len(sampler.io_at_line) else {}
        rd = (io.get("read_bytes", 0) - prev.get("read_bytes", 0)) / GIB if io else float("nan")
        wr = (io.get("write_bytes", 0) - prev.get("write_bytes", 0)) / GIB if io else float("nan")
        label = "(+ start-up)" if i == 0 else ""
        print(f"{r['step']:>4} {r['loss']:>8.4f} {r['step_s']:>8.1f} {rd:>14.2f} {wr:>17.2f}  {label}")
        prev = io or prev
    startup = None
    if rows and sampler.io_at_line:
        # the first metrics line appeared after start-up and step 0
        startup = max(0.0, wall - sum(r["step_s"] for r in rows)) if proc.returncode == 0 else None
    hwm_gib = sampler.hwm_kib / (1 << 20)
    maxrss_gib = rusage.ru_maxrss / (1 << 20) if rusage is not None else float("nan")
    falling = len(rows) >= 2 and all(b["loss"] < a["loss"] for a, b in zip(rows, rows[1:]))
    print()
    print(f"parameters: {params:,} ({states / GIB:.1f} GiB of model states = {states / ram:.2f}x RAM)")
    print(f"peak RSS of the rank: VmHWM {hwm_gib:.2f} GiB (polled), ru_maxrss {maxrss_gib:.2f} GiB "
          f"(target < 20 GiB)")
    if rows:
        later = [r["step_s"] for r in rows[1:]] or [rows[0]["step_s"]]
        times = ", ".join(f"{r['step_s']:.1f}" for r in rows)
        print(f"step time: {times} s (median after step 0: "
              f"{sorted(later)[len(later) // 2]:.1f} s); wall {wall:.0f} s"
              + (f", of which start-up and exit about {startup:.0f} s" if startup is not None else ""))
        losses = " -> ".join(f"{r['loss']:.4f}" for r in rows)
        print(f"loss: {losses} ({'falling' if falling else 'NOT falling'})")
    print(f"NVMe per step (graph): read {g_read / GIB:.1f} GiB, written {g_written / GIB:.1f} GiB")
    print(json.dumps({"params": params, "states_bytes": states, "ram_bytes": ram, "vmhwm_kib": sampler.hwm_kib,
                      "ru_maxrss_kib": rusage.ru_maxrss if rusage is not None else None, "wall_s": wall,
                      "steps": [{"step": r["step"], "loss": r["loss"], "step_s": r["step_s"]} for r in rows],
                      "graph_nvme_read": g_read, "graph_nvme_written": g_written,
                      "io_at_line": sampler.io_at_line, "io_start": sampler.io_start,
                      "exit": proc.returncode}))
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
