"""Capacity: a GPT whose model states exceed RAM, trained from NVMe, against the disk's and the compute's bounds.

    python benchmarks/capacity.py                          # programs/capacity.zs as written (2.55e9 params)
    python benchmarks/capacity.py --size auto              # the largest GPT whose NVMe states fit the free disk
    python benchmarks/capacity.py --set model.layers=10    # a medium size: where the time goes, in minutes
    python benchmarks/capacity.py --size auto --dry-run    # the sizes, the bounds' inputs and the disk check only

Runs ``programs/capacity.zs`` (ZeRO-3, one CPU rank, bf16 mixed precision,
parameters and optimizer state on NVMe) as the rank itself (``RANK=0``, so
the process measured is the one that trains, not a launcher), with
``--metrics`` and ``--trace``, and reports:

* **the bounds, measured in the same run, just before the training** (never
  beside it): the disk's with ``fio`` (``direct=1``, ``libaio``, the
  swapper's block size and queue depth, overwriting a laid-out file as the
  swapper rewrites its files, on the swap folder's file system):
  read, write, and a mixed job at the step's read share, which says whether
  reads and writes overlap on this device; disk bound = the step's NVMe
  bytes (the graph's) at the better of the two. The compute's with
  ``zdsl calibrate``'s own measurement (``runtime/calibrate/measure.py``,
  ``measure_compute``) at the schedule's block shape and dtype: forward and
  backward flops per step (the graph's) over that rate. The host AdamW is
  said apart, at the step rate measured in the run (the trace's
  ``compute.step`` ops). Then the step time (median of the steps after the
  first) and ``step / max(disk, compute)`` against the target 1.5;
* the swapper's own rates in the run: graph bytes over the nvme lane's busy
  time per direction, and the lane's idle gaps (what it waited for). They can
  beat fio's: fio reads and writes 4 KiB pages, the swapper huge pages
  (``runtime/io/aligned.py``; benchmarks/nvme_io.py sets the two side by side), so the
  step is also given against the disk time at the swapper's own rates;
* bytes per tier path per step against ZeRO-Infinity's minimum, the plan's
  own figures (``zdsl.planner.traffic``, as ``zdsl plan`` prints them), and
  what the kernel counted (``/proc/PID/io``);
* the plan's predicted step (``zdsl plan``'s ``sim.step_s``, on the cached
  calibrated profile) against the measured one, and each lane's busy time
  and each op kind's time, planned against measured, so a wrong rate shows;
* peak RSS of the rank (``VmHWM`` polled, ``ru_maxrss`` at exit) against the
  planner's host figure (its host peak plus torch's floor, as ``zdsl plan``'s
  machine fit prints it).

``--size auto`` picks the layer count at the schedule's width whose NVMe
states fit the swap folder's free space less ``--keep-free`` (measured on
the compiled graphs, not a formula), with ``memory host`` at RAM less
``--headroom``; it says how the size compares with 2.5x RAM. The rank gets
``MALLOC_MMAP_THRESHOLD_=65536`` (freed buffers go back to the OS at once,
so RSS measures what is held). A benchmark, not a test. Results:
benchmarks/README.md (capacity.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zdsl.runtime.dist.spawn import free_port, rank_env  # noqa: E402
from zdsl.schedule import nvme_placements  # noqa: E402

SCHEDULE = ROOT / "programs" / "capacity.zs"
GIB = 1 << 30
TARGET_RATIO = 1.5
SLACK_GB = 1.0          # --size auto: disk room kept for other processes' writes between the pick and the run
COMPUTE_KINDS = ("compute.forward", "compute.backward", "compute.recompute")


# ----------------------------------------------------------------------------
# the rank: sampled while it runs
# ----------------------------------------------------------------------------


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


class Sampler(threading.Thread):
    """Polls the rank: peak RSS, and /proc/PID/io whenever a new metrics line appears."""

    def __init__(self, pid: int, metrics: Path, period: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.metrics, self.period = pid, metrics, period
        self.hwm_kib = 0
        self.io_at_line: list[dict[str, int]] = []   # io counters when line i appeared
        self.io_start = read_io(pid)
        self.stop = threading.Event()

    def run(self) -> None:
        seen = 0
        while not self.stop.is_set():
            self.hwm_kib = max(self.hwm_kib, read_status_kib(self.pid, "VmHWM"))
            try:
                lines = sum(1 for line in self.metrics.read_text().splitlines() if line.strip())
            except OSError:
                lines = 0
            if lines > seen:
                io = read_io(self.pid)
                self.io_at_line.extend([io] * (lines - seen))
                seen = lines
            self.stop.wait(self.period)


# ----------------------------------------------------------------------------
# the schedule: compiled, sized, planned
# ----------------------------------------------------------------------------


def compile_schedule(schedule: Path, sets: list[str], simulate: bool = True):
    from zdsl.driver import compile_file
    overrides = dict(s.split("=", 1) for s in sets)
    compiled = compile_file(str(schedule), overrides, simulate=simulate)
    if not compiled.ok:
        raise SystemExit(f"{schedule}: does not compile with {sets}: "
                         + "; ".join(str(d) for d in compiled.diagnostics))
    return compiled


def nvme_bytes(graph) -> int:
    """Bytes of the persistent NVMe tier (the swap files' contents)."""
    return sum(b.bytes for b in graph.buffers.values() if b.tier == "nvme" and b.persistent)


def swap_place(graph) -> dict:
    """The schedule's one swap folder with its block size and queue depth; a schedule whose NVMe
    states use several folders, or several block sizes or depths, is refused: the bounds this
    benchmark measures (free space, one disk's rate) are one folder's."""
    places = {(p.paths, p.block_bytes, p.queue_depth) for p in nvme_placements(graph.config).values()}
    if not places:
        return {}
    (paths, block, depth), = places if len(places) == 1 and len(next(iter(places))[0]) == 1 else [((), 0, 0)]
    if not paths:
        folders = sorted({f for p in places for f in p[0]})
        raise SystemExit(f"capacity.py measures one swap folder at one block size and depth; this schedule's "
                         f"NVMe states use {', '.join(folders)}: give every state the same nvme(\"FOLDER\")")
    return {"path": paths[0], "block_bytes": block, "queue_depth": depth}


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def auto_size(schedule: Path, sets: list[str], keep_free: float, headroom: float) -> list[str]:
    """Overrides for the largest layer count (at the schedule's width) whose NVMe states fit the swap
    folder's free space less ``keep_free`` GB, with ``memory host`` at the memory available (RAM, or less
    where other processes hold some) less ``headroom`` GiB.

    The NVMe bytes are the compiled graph's at two layer counts (linear in layers), then checked on the
    graph of the size picked; a size that does not compile (e.g. its host peak over the budget) is
    stepped down."""
    from zdsl.planner.machine_fit import available_memory, free_bytes
    host = int((min(ram_bytes(), available_memory() or ram_bytes()) - headroom * GIB) // GIB)
    base = [s for s in sets if not s.startswith(("model.layers=", "memory.host="))] + [f"memory.host={host}GiB"]
    # probed at sizes past what host residency can keep (the budget keeps a fixed amount off the disk)
    low = int(dict(compile_schedule(schedule, base, simulate=False).schedule.model.args)["layers"])
    probes = {n: compile_schedule(schedule, base + [f"model.layers={n}"], simulate=False).graph
              for n in (low, 2 * low)}
    per_layer = (nvme_bytes(probes[2 * low]) - nvme_bytes(probes[low])) / low
    fixed = nvme_bytes(probes[low]) - low * per_layer
    probe = probes[low]
    if per_layer <= 0:
        raise SystemExit(f"--size auto: the NVMe tier does not grow with layers at {low} and {2 * low} layers "
                         f"(memory host {host} GiB keeps the states on the host?)")
    folder = swap_place(probe).get("path") or "/tmp"
    room = (free_bytes(folder) or 0) - (keep_free + SLACK_GB) * 1e9
    layers = int((room - fixed) // per_layer)
    print(f"--size auto: {(free_bytes(folder) or 0) / 1e9:.1f} GB free under {folder}, {keep_free:.0f} GB kept "
          f"free (+ {SLACK_GB:.0f} GB for others' writes until the check); NVMe states {per_layer / 1e9:.3f} GB "
          f"per layer + {fixed / 1e9:.3f} GB; memory host {host} GiB "
          f"(RAM {ram_bytes() / GIB:.1f} GiB, available "
          f"{(available_memory() or 0) / GIB:.1f} GiB, less {headroom:.0f} GiB)")
    from zdsl.driver import compile_file
    while layers >= 1:
        trial = compile_file(str(schedule), dict(s.split("=", 1) for s in base + [f"model.layers={layers}"]),
                             simulate=True)
        if trial.ok and nvme_bytes(trial.graph) <= room:
            return base + [f"model.layers={layers}"]
        why = "; ".join(str(d) for d in trial.diagnostics if d.severity == "error") or "NVMe states over the room"
        print(f"  {layers} layers: {why}; one fewer")
        layers -= 1
    raise SystemExit(f"--size auto: not even one layer fits {room / 1e9:.1f} GB under {folder}")


# ----------------------------------------------------------------------------
# the bounds: measured just before the training
# ----------------------------------------------------------------------------


def fio_job(fio: str, path: Path, rw: str, size: int, block: int, qd: int, read_share: int = 50) -> dict:
    """One fio job's read and write bytes per second (direct=1, libaio at queue depth ``qd``).

    Writes overwrite data already written (``overwrite=1``: fio lays the file out first), as the
    swapper rewrites its files every step: a first write into fallocated space also converts the
    file system's unwritten extents, at well under an overwrite's rate."""
    args = [fio, "--name=capacity", f"--filename={path}", f"--rw={rw}", f"--bs={block}", "--direct=1",
            "--ioengine=libaio", f"--iodepth={qd}", f"--size={size}", "--output-format=json",
            "--group_reporting", "--fallocate=native", "--overwrite=1"]
    if rw == "rw":
        args.append(f"--rwmixread={read_share}")
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fio {rw} failed: {done.stderr.strip()[-400:]}")
    job = json.loads(done.stdout)["jobs"][0]
    return {"read": float(job["read"]["bw_bytes"]), "write": float(job["write"]["bw_bytes"])}


def measure_disk(folder: str, block: int, qd: int, size: int, read: int, written: int) -> dict | None:
    """fio's read, write and mixed rates on ``folder``'s file system and the disk bound of a step that
    reads ``read`` and writes ``written`` bytes: at the serial rates (one direction at a time), or at the
    mixed job's, whichever is less; None where fio is missing."""
    fio = shutil.which("fio")
    if fio is None:
        print("fio not found (apt-get install fio): no disk bound", file=sys.stderr)
        return None
    path = Path(folder) / "capacity-fio.dat"
    share = max(1, min(99, round(100 * read / max(1, read + written))))
    try:
        w = fio_job(fio, path, "write", size, block, qd)["write"]
        r = fio_job(fio, path, "read", size, block, qd)["read"]
        mixed = fio_job(fio, path, "rw", size, block, qd, share)
    finally:
        path.unlink(missing_ok=True)
    serial = read / r + written / w
    mixed_total = mixed["read"] + mixed["write"]
    together = (read + written) / mixed_total if mixed_total else float("inf")
    return {"read": r, "write": w, "mixed_read": mixed["read"], "mixed_write": mixed["write"],
            "read_share": share, "serial_s": serial, "mixed_s": together,
            "overlap": together < 0.9 * serial, "bound_s": min(serial, together)}


COMPUTE_PROBE = """
import json, sys, torch
from zdsl.runtime.calibrate.measure import Settings, measure_compute
a = json.loads(sys.argv[1])
out = measure_compute(torch.device("cpu"), Settings(ranks=1, quick=False, width=a["width"], heads=a["heads"],
                      context=a["context"], batch=a["batch"]), getattr(torch, a["dtype"]))
print(json.dumps({"at_batch": out.get("flops_at_batch") or out["block_flops"], "slope": out["block_flops"],
                  "mm": out["mm_flops"], "fixed_s": out.get("fixed_s", 0.0), "measured": out.get("measured", "")}))
"""


def measure_compute_rate(schedule, graph) -> dict | None:
    """``zdsl calibrate``'s compute measurement (forward+backward of one GPT block) at the schedule's
    width, heads, context and batch, in its dtype, in a process of its own with the rank's thread
    count, at calibrate's full budget (its quick one swung 2x between runs on the loaded machine).
    The bound's rate is the block's flops over its time at the run's batch (what the compute
    lane runs), kernels' fixed costs included, and never above the matmul ceiling measured beside it
    (on the shared machine a timing now and then came out above it): calibrate's slope over batch
    sizes, which leaves the fixed costs to ``kernel_overhead``, can exceed the ceiling at these small
    batches, so it is only shown."""
    m = dict(schedule.model.args)
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(graph.precision, "float32")
    shape = {"width": m.get("width"), "heads": m.get("heads"), "context": m.get("context"),
             "batch": (graph.config.get("train") or {}).get("batch", 1), "dtype": dtype}
    done = subprocess.run([sys.executable, "-c", COMPUTE_PROBE, json.dumps(shape)], capture_output=True,
                          text=True, cwd=ROOT)
    if done.returncode != 0:
        print(f"compute measurement failed: {done.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    out = {**json.loads(done.stdout.strip().splitlines()[-1]), **shape}
    out["rate"] = min(out["at_batch"], out["mm"])
    return out


# ----------------------------------------------------------------------------
# the trace: lanes, op kinds and the nvme lane's gaps, per measured step
# ----------------------------------------------------------------------------


def union(intervals: list[tuple[float, float]]) -> float:
    from zdsl.sim.lanes import union_length
    return union_length(intervals)


def trace_steps(trace_path: Path) -> dict[int, list]:
    """Step -> its spans (``zdsl.observe.trace.TraceSpan``), from ``zdsl run --trace``."""
    from zdsl.observe.trace import read_trace
    spans, _ = read_trace(trace_path)
    steps: dict[int, list] = defaultdict(list)
    for s in spans:
        if s.rank == 0 and "step" in s.args:
            steps[int(s.args["step"])].append(s)
    return dict(steps)


def step_figures(spans: list) -> dict:
    """One measured step: lane busy (union), per op kind the summed op time and bytes, the nvme lane's
    idle gaps (start, length, the op after the gap), and the step's span."""
    t0, t1 = min(s.start_s for s in spans), max(s.end_s for s in spans)
    lanes: dict[str, list] = defaultdict(list)
    kind_s: dict[str, float] = defaultdict(float)
    kind_bytes: dict[str, int] = defaultdict(int)
    for s in spans:
        lanes[s.lane].append((s.start_s, s.end_s))
        kind_s[s.args.get("kind", "?")] += s.end_s - s.start_s
        kind_bytes[s.args.get("kind", "?")] += int(s.args.get("bytes") or 0)
    nvme = sorted((s for s in spans if s.lane == "nvme"), key=lambda s: s.start_s)
    gaps, edge = [], t0
    for s in nvme:
        if s.start_s - edge > 0:
            gaps.append((edge - t0, s.start_s - edge, s.name))
        edge = max(edge, s.end_s)
    if t1 > edge:
        gaps.append((edge - t0, t1 - edge, "(end of step)"))
    return {"span": t1 - t0, "lane_busy": {k: union(v) for k, v in lanes.items()}, "kind_s": dict(kind_s),
            "kind_bytes": dict(kind_bytes), "nvme_gaps": gaps}


def median_of(rows: list[dict], key: str) -> dict[str, float]:
    names = sorted({k for r in rows for k in r[key]})
    return {k: statistics.median(r[key].get(k, 0.0) for r in rows) for k in names}


def planned_kinds(graph, sim) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for i, op in enumerate(graph.ops):
        if op.kind != "mem.free":
            out[op.kind] += float(sim.duration[i])
    return dict(out)


# ----------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------


def run_rank(schedule: Path, sets: list[str], metrics: Path, trace: Path | None, timeout: float):
    env = dict(os.environ, **rank_env(0, 1, free_port()), MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-c", "import sys; from zdsl.cli import main; sys.exit(main())", "run",
           str(schedule), "--metrics", str(metrics), "--quiet"]
    if trace is not None:
        cmd += ["--trace", str(trace)]
    for s in sets:
        cmd += ["--set", s]
    metrics.unlink(missing_ok=True)
    print(f"running the rank in-process (RANK=0, MALLOC_MMAP_THRESHOLD_=65536): {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    sampler = Sampler(proc.pid, metrics)
    sampler.start()
    status, rusage = 0, None
    try:
        deadline = t0 + timeout
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                print(f"stopping the rank after {timeout:.0f} s", file=sys.stderr)
                proc.kill()
                pid, status, rusage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
    finally:
        sampler.stop.set()
        sampler.join()
    return os.waitstatus_to_exitcode(status), rusage, sampler, time.perf_counter() - t0


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", type=Path, default=SCHEDULE)
    p.add_argument("--set", dest="sets", action="append", default=[], help="overrides, as for zdsl run")
    p.add_argument("--size", choices=["schedule", "auto"], default="schedule",
                   help="auto: the most layers whose NVMe states fit the free disk (default: as the schedule says)")
    p.add_argument("--keep-free", type=float, default=10.0, help="GB of disk to leave free (default 10)")
    p.add_argument("--headroom", type=float, default=4.0, help="--size auto: GiB of RAM kept out of memory host")
    p.add_argument("--fio-size", type=float, default=2.0, help="GiB each fio job moves (default 2)")
    p.add_argument("--no-bounds", action="store_true", help="skip fio and the compute measurement")
    p.add_argument("--out", type=Path, default=Path("/tmp/zdsl-capacity-metrics.jsonl"))
    p.add_argument("--trace", type=Path, default=Path("/tmp/zdsl-capacity-trace.json"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the rank is stopped")
    p.add_argument("--dry-run", action="store_true", help="print the sizes, the plan and the disk check, do not run")
    args = p.parse_args(argv)

    from zdsl.sim import profile_cache
    from zdsl.planner import traffic
    from zdsl.sim import rates
    from zdsl.planner.machine_fit import schedule_fit
    from zdsl.model.units import gpt_parameter_count
    from zdsl.lang.sizes import human_bytes
    profile_cache.enable()      # plan as `zdsl plan` does: the cached calibrated profile
    sets = auto_size(args.schedule, args.sets, args.keep_free, args.headroom) if args.size == "auto" else args.sets
    compiled = compile_schedule(args.schedule, sets)
    graph, schedule, sim = compiled.graph, compiled.schedule, compiled.sim
    m = dict(schedule.model.args)
    params = gpt_parameter_count(**m) if schedule.model.kind == "gpt" else sum(u.numel for u in graph.units)
    ram = ram_bytes()
    states = 16 * params
    on_nvme = nvme_bytes(graph)
    moved, least = traffic.moved(graph), traffic.infinity_minimum(graph)
    g_read, g_written = moved["nvme.read"], moved["nvme.write"]
    place = swap_place(graph)
    folder, block, qd = place.get("path", ""), place.get("block_bytes", 1 << 20), place.get("queue_depth", 8)
    flops = sum(op.flops for op in graph.ops if op.kind in COMPUTE_KINDS)
    stepped = sum(u.shard_numel for u in graph.units if u.trains)
    print(f"model {m}: {params:,} parameters; model states 16 B/param = {states / GIB:.1f} GiB = "
          f"{states / ram:.2f}x RAM ({ram / GIB:.1f} GiB; target: at least 2.5x where the disk allows)")
    print(f"graph: {on_nvme / GIB:.1f} GiB on the NVMe tier under {folder} (block {block >> 10} KiB, depth {qd}); "
          f"forward+backward {flops:.3e} flops per step")
    fit = schedule_fit(compiled)
    planned_ram = fit.needs.ram(fit.floor)
    print(f"plan: predicted step {sim.step_s:.1f} s; {profile_cache.rates_line() or 'rates: the schedule'}")
    pm = rates.for_graph(schedule.machine, graph)       # the rates this schedule's ops get (its ranks, width)
    block_flops = (rates.device_flops(graph, pm) or [pm.compute.flops] * 2)[1]
    print(f"  profile, as this schedule is priced: a block's compute {block_flops / 1e9:.1f} G/s "
          f"({schedule.train.precision}, width {rates.unit_widths(graph)[1]:.0f}), disk read "
          f"{pm.disk.read / 1e9:.2f} GB/s, write {pm.disk.write / 1e9:.2f} GB/s ({graph.ranks} rank(s)), host step "
          f"{pm.compute.host_memory / 1e9:.1f} GB/s of optimizer bytes")
    for gap in rates.gaps(schedule.machine, graph):
        print(f"  {gap}")
    print(f"plan: host peak {human_bytes(fit.needs.ram_per_rank)} + torch floor {human_bytes(fit.floor.private)} "
          f"+ shared {human_bytes(fit.floor.shared)} = {human_bytes(planned_ram)} in RAM")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder).free
        need = on_nvme + args.keep_free * 1e9
        print(f"disk: {free / 1e9:.1f} GB free under {folder}; need {need / 1e9:.1f} GB "
              f"(tier + {args.keep_free:.0f} GB left free)")
        if free < need:
            print(f"not enough disk under {folder}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed; "
                  f"choose a smaller model (--set model.layers=N, or --size auto) or another folder", file=sys.stderr)
            return 2
    print("bytes per tier path per step (the plan's), against ZeRO-Infinity's minimum:")
    for kind, path in traffic.PATHS.items():
        if moved[kind] or least[kind]:
            ratio = f"{moved[kind] / least[kind]:.2f}" if least[kind] else "-"
            print(f"  {path:<15} {moved[kind] / GIB:8.2f} GiB  minimum {least[kind] / GIB:8.2f} GiB  ({ratio})")
    if args.dry_run:
        return 0

    disk = compute = None
    if not args.no_bounds:
        print("\nbounds, measured now (before the training, not beside it):", flush=True)
        disk = measure_disk(folder, block, qd, int(args.fio_size * GIB) // block * block, g_read, g_written) \
            if folder else None
        if disk:
            print(f"  fio (direct, libaio, {block >> 10} KiB, iodepth {qd}) on {folder}: read "
                  f"{disk['read'] / 1e9:.2f} GB/s, write {disk['write'] / 1e9:.2f} GB/s; mixed at "
                  f"{disk['read_share']}% reads: read {disk['mixed_read'] / 1e9:.2f} + write "
                  f"{disk['mixed_write'] / 1e9:.2f} GB/s")
            print(f"  disk: {g_read / GIB:.2f} GiB read + {g_written / GIB:.2f} GiB written per step: "
                  f"{disk['serial_s']:.1f} s one direction at a time, {disk['mixed_s']:.1f} s mixed; reads and "
                  f"writes {'overlap' if disk['overlap'] else 'do not overlap'} on this device -> disk bound "
                  f"{disk['bound_s']:.1f} s", flush=True)
        compute = measure_compute_rate(schedule, graph)
        if compute:
            compute["bound_s"] = flops / compute["rate"]
            print(f"  compute (zdsl calibrate's measurement, one block at width {compute['width']}, batch "
                  f"{compute['batch']}, {compute['dtype']}): {compute['at_batch'] / 1e9:.1f} GFLOP/s at that batch "
                  f"(slope over batches {compute['slope'] / 1e9:.1f}, matmul ceiling {compute['mm'] / 1e9:.1f}; "
                  f"cached profile {schedule.machine.compute.flops / 1e9:.1f}); at {compute['rate'] / 1e9:.1f} -> "
                  f"compute bound {compute['bound_s']:.1f} s", flush=True)

    code, rusage, sampler, wall = run_rank(args.schedule, sets, args.out, args.trace, args.timeout)
    if folder and Path(folder, "rank0").exists():   # the swap files of a rank that did not clean up
        shutil.rmtree(Path(folder, "rank0"), ignore_errors=True)
    rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()] if args.out.exists() else []
    if code != 0:
        print(f"the run failed (exit {code}) after {wall:.0f} s, {len(rows)} steps", file=sys.stderr)

    print(f"\n{'step':>4} {'loss':>8} {'step s':>8} {'nvme read GiB':>14} {'nvme written GiB':>17}")
    prev = sampler.io_start
    for i, r in enumerate(rows):
        io = sampler.io_at_line[i] if i < len(sampler.io_at_line) else {}
        rd = (io.get("read_bytes", 0) - prev.get("read_bytes", 0)) / GIB if io else float("nan")
        wr = (io.get("write_bytes", 0) - prev.get("write_bytes", 0)) / GIB if io else float("nan")
        print(f"{r['step']:>4} {r['loss']:>8.4f} {r['step_s']:>8.1f} {rd:>14.2f} {wr:>17.2f}  "
              f"{'(+ start-up)' if i == 0 else ''}")
        prev = io or prev
    later = [r["step_s"] for r in rows[1:]] or [r["step_s"] for r in rows]
    step = statistics.median(later) if later else None
    hwm = sampler.hwm_kib * 1024
    maxrss = rusage.ru_maxrss * 1024 if rusage is not None else 0
    print(f"\nparameters: {params:,} ({states / GIB:.1f} GiB of model states = {states / ram:.2f}x RAM)")
    print(f"peak RSS: VmHWM {hwm / GIB:.2f} GiB (polled), ru_maxrss {maxrss / GIB:.2f} GiB; planner's host figure "
          f"{planned_ram / GIB:.2f} GiB (RSS / plan {max(hwm, maxrss) / planned_ram:.2f})")
    if rows:
        falling = len(rows) >= 2 and all(b["loss"] < a["loss"] for a, b in zip(rows, rows[1:]))
        times = ", ".join(f"{r['step_s']:.1f}" for r in rows)
        losses = " -> ".join(f"{r['loss']:.4f}" for r in rows)
        print(f"step time: {times} s; median after step 0 {step:.1f} s; wall {wall:.0f} s; loss {losses} "
              f"({'falling' if falling else 'NOT falling'})")

    measured = [step_figures(s) for k, s in sorted(trace_steps(args.trace).items()) if k > 0] \
        if args.trace.exists() else []
    summary = {"params": params, "states_bytes": states, "ram_bytes": ram, "sets": sets, "exit": code,
               "vmhwm": hwm, "ru_maxrss": maxrss, "planned_ram": planned_ram, "wall_s": wall,
               "steps": [{k: r[k] for k in ("step", "loss", "step_s")} for r in rows], "step_s": step,
               "graph_nvme_read": g_read, "graph_nvme_written": g_written, "flops": flops,
               "predicted_step_s": sim.step_s, "disk": disk, "compute": compute}
    host_s = None
    if measured:
        busy, kinds = median_of(measured, "lane_busy"), median_of(measured, "kind_s")
        kbytes = median_of(measured, "kind_bytes")
        host_s = kinds.get("compute.step")
        rd_b, rd_s = kbytes.get("nvme.read", 0), kinds.get("nvme.read", 0)
        wr_b, wr_s = kbytes.get("nvme.write", 0), kinds.get("nvme.write", 0)
        print(f"\nthe swapper in the run (trace, median of steps 1..): read {rd_b / GIB:.2f} GiB in {rd_s:.1f} s = "
              f"{rd_b / max(1e-9, rd_s) / 1e9:.2f} GB/s; write {wr_b / GIB:.2f} GiB in {wr_s:.1f} s = "
              f"{wr_b / max(1e-9, wr_s) / 1e9:.2f} GB/s; nvme lane busy {busy.get('nvme', 0):.1f} s of "
              f"{statistics.median(f['span'] for f in measured):.1f} s")
        lane_s = sum(kinds.get(k, 0.0) for k in COMPUTE_KINDS)
        if lane_s:
            print(f"compute lane in the run: {flops / lane_s / 1e9:.1f} GFLOP/s (forward+backward flops over "
                  f"its ops' time, slowed by whatever shares the cores)")
        if host_s:
            print(f"host AdamW (compute.step ops): {host_s:.1f} s per step for {stepped:,} parameters = "
                  f"{stepped / host_s / 1e6:.0f} M parameters/s")
        last = measured[-1]
        big = sorted(last["nvme_gaps"], key=lambda g: -g[1])[:6]
        print(f"nvme lane idle in the last traced step: {sum(g[1] for g in last['nvme_gaps']):.1f} s in "
              f"{len(last['nvme_gaps'])} gaps; longest: " + ", ".join(f"{g[1]:.2f} s at {g[0]:.1f} s before {g[2]}"
                                                                      for g in big))
        plan_kinds = planned_kinds(graph, sim)
        print(f"\n{'lane':<10} {'planned s':>10} {'measured s':>11} {'meas/plan':>10}")
        for lane in sorted(set(sim.lane_busy) | set(busy), key=lambda k: -busy.get(k, 0)):
            pl, me = sim.lane_busy.get(lane, 0.0), busy.get(lane, 0.0)
            print(f"{lane:<10} {pl:>10.2f} {me:>11.2f} {me / pl if pl else float('nan'):>10.2f}")
        print(f"\n{'op kind':<20} {'planned s':>10} {'measured s':>11} {'meas/plan':>10}")
        for kind in sorted(set(plan_kinds) | set(kinds), key=lambda k: -kinds.get(k, 0)):
            pl, me = plan_kinds.get(kind, 0.0), kinds.get(kind, 0.0)
            print(f"{kind:<20} {pl:>10.2f} {me:>11.2f} {me / pl if pl else float('nan'):>10.2f}")
        summary.update(lane_busy=busy, kind_s=kinds, kind_bytes=kbytes, planned_lane_busy=sim.lane_busy,
                       planned_kind_s=plan_kinds, nvme_idle_s=sum(g[1] for g in last["nvme_gaps"]),
                       nvme_gaps_longest=big, host_step_s=host_s)

    print("\nagainst the bounds:")
    if step is not None:
        err = (sim.step_s - step) / step
        print(f"  plan: predicted {sim.step_s:.1f} s, measured {step:.1f} s: error {err:+.0%} "
              f"({'within' if abs(err) <= 0.15 else 'OUTSIDE'} 15%)")
    bounds = {k: v["bound_s"] for k, v in (("disk", disk), ("compute", compute)) if v}
    if step is not None and bounds:
        worst = max(bounds.values())
        ratio = step / worst
        print(f"  step {step:.1f} s; disk bound {fmt_s(bounds.get('disk'))}, compute bound "
              f"{fmt_s(bounds.get('compute'))}" + (f", host AdamW {host_s:.1f} s" if host_s else "")
              + f"; step / max(disk, compute) = {ratio:.2f} (target <= {TARGET_RATIO}: "
              f"{'met' if ratio <= TARGET_RATIO else 'NOT met'})")
        summary["ratio"] = ratio
    if step is not None and host_s is not None:
        own = summary["kind_s"].get("nvme.read", 0.0) + summary["kind_s"].get("nvme.write", 0.0)
        print(f"  at the swapper's own rates in the run (its reads' and writes' time, one at a time): {own:.1f} s; "
              f"step / that = {step / own:.2f} (how busy the schedule keeps the disk; the swapper can outrun fio: "
              f"its buffers are huge pages, fio's 4 KiB pages)" if own else "")
    print(json.dumps(summary, default=str))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
