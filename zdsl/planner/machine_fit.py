"""Whether a schedule's ranks fit this machine: memory, cores and swap space, before any rank starts.

``zdsl run`` starts one process per rank; ``ranks 1000 on cpu`` checks fine and
then fills the machine's memory until the kernel's OOM killer stops it. So the
launcher compares what the ranks need with what the machine has and refuses
what cannot fit; ``zdsl plan`` shows the same comparison.

What a rank needs in RAM: the planner's peak per rank on the host tier (and
on the device tier where the device is the CPU), plus torch's own floor per
process (libraries, allocator, gloo's threads: measured once per torch and Python
version by ``zdsl.runtime.run.preflight``, which caches it for this module to read),
whose shared-library pages count once. What the
machine has: ``MemAvailable``, or less where a cgroup limits this process;
the cores it may run on (``sched_getaffinity``).

The rules: memory that cannot hold every rank is refused (the OOM killer would
end the run, and often other processes with it). More ranks than cores is only
slower, as under torchrun: a warning up to ``OVERSUBSCRIBE`` ranks per core,
refused above, where each rank gets so little of a core that the run, and
starting its ranks (seconds of CPU each to load torch), takes many times as long.
Swap files of every local rank share their folders' filesystems: per filesystem, the
sum of what every folder on it holds (each state's placement's share, striped over its
folders) must fit its free space; a folder that cannot be made or written is named.

Torch-free, and the runtime is never imported: the floor is read from the runtime's cache
file, or measured by the runtime in a subprocess.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from zdsl.cache import cache_dir
from zdsl.ir import BUFFER_KINDS, TaskGraph
from zdsl.lang.sizes import human_bytes
from zdsl.schedule import SHARED_MEMORY_OUTBOX, nvme_placements
from zdsl.sim.this_machine import (
    NVIDIA_GPUS,
    ROCM_DRIVER,
    device_in_ram,
    installed_torch,
    usable_cores,
    visible_nvidia_gpus,
)
from zdsl.swap_folders import device_of, folder_problem, nearest_existing, stripe_bytes

OVERSUBSCRIBE = 8      # ranks per core above which a run is refused (a warning from 1 up to this)


@dataclass(frozen=True)
class Machine:
    """What this machine offers the ranks: bytes of memory available now, cores this process may use."""
    available: int | None       # None: unknown (no /proc/meminfo)
    cores: int
    cuda_devices: int | None = None     # NVIDIA GPUs the ranks may use; None: not counted (ROCm)

    @classmethod
    def this(cls) -> "Machine":
        return cls(available_memory(), usable_cores(), visible_cuda_devices())


@dataclass(frozen=True)
class TorchFloor:
    """Memory a rank holds before its model: ``private`` per process, ``shared`` (library pages) once."""
    private: int
    shared: int
    source: str                 # how it was obtained, for the report ("measured, torch 2.13.0 ...")


@dataclass(frozen=True)
class SwapNeed:
    """What each rank puts in one swap folder."""
    folder: str
    per_rank: int               # bytes of swap files each rank keeps there
    states: tuple[str, ...]     # the states whose placements name it


@dataclass(frozen=True)
class FolderRoom:
    """What this machine offers in one swap folder."""
    free: int | None            # bytes free on its filesystem; None: unknown
    device: int | None = None   # its filesystem's st_dev: folders on one share ``free``
    problem: str | None = None  # why swap files cannot go there (zdsl.swap_folders.folder_problem)


UNKNOWN_ROOM = FolderRoom(None)


@dataclass(frozen=True)
class Needs:
    """What one schedule's ranks need, from its plan."""
    ranks: int
    ram_per_rank: int           # planned peak bytes in RAM per rank
    nvme_per_rank: int          # bytes of swap files per rank, all folders
    swap: tuple[SwapNeed, ...] = ()     # per swap folder, in the order the placements name them
    device: str = "auto"        # the schedule's `ranks N on DEVICE`: cuda needs a device per rank

    def ram(self, floor: TorchFloor, ranks: int | None = None, ram_per_rank: int | None = None) -> int:
        n = self.ranks if ranks is None else ranks
        per = self.ram_per_rank if ram_per_rank is None else ram_per_rank
        return n * (floor.private + per) + floor.shared


def swap_needs(graph: TaskGraph) -> tuple[SwapNeed, ...]:
    """Bytes per rank each swap folder holds: every NVMe buffer in its state's placement's folders,
    as the runtime's swapper stripes it (zdsl.swap_folders.stripe_bytes)."""
    places = nvme_placements(graph.config)
    held: dict[str, int] = {}
    for buf in graph.buffers.values():
        state = BUFFER_KINDS.get(buf.kind) if buf.tier == "nvme" else None
        place = places.get(state) if state is not None else None
        if place is None:
            continue
        for folder, size in zip(place.paths, stripe_bytes(buf.bytes, place.block_bytes, len(place.paths))):
            held[folder] = held.get(folder, 0) + size
    states: dict[str, list[str]] = {}
    for state, place in places.items():
        for folder in place.paths:
            states.setdefault(folder, []).append(state)
    return tuple(SwapNeed(f, held[f], tuple(states[f])) for f in states if f in held)


def needs_of(graph: TaskGraph, memory: dict) -> Needs:
    """``memory``: the plan's per-tier JSON (``Simulation.memory.to_json()``); plus the outbox of
    shared memory a rank writes where its collectives go through one (runtime/dist/shm.py)."""
    from zdsl.sim.simulate import through_shared_memory
    in_ram = device_in_ram(graph.config.get("device", "auto"))
    ram = memory["host"]["peak"] + (memory["device"]["peak"] if in_ram else 0)
    if any(through_shared_memory(graph, op, in_ram) for op in graph.ops):
        ram += SHARED_MEMORY_OUTBOX
    swap = swap_needs(graph)
    return Needs(graph.ranks, ram, sum(n.per_rank for n in swap), swap, graph.config.get("device", "auto"))


def folder_room(folder: str, statvfs: Callable = os.statvfs) -> FolderRoom:
    """What ``folder`` offers on this machine now."""
    return FolderRoom(free_bytes(folder, statvfs), device_of(folder), folder_problem(folder))


@dataclass
class Fit:
    """The comparison and its verdict: ``refusals`` stop ``zdsl run`` (unless overridden)."""
    needs: Needs
    machine: Machine
    floor: TorchFloor
    swap_room: dict[str, FolderRoom] = field(default_factory=dict)   # per swap folder
    ranks_fitting: int | None = None      # most ranks whose memory fits, when all of them do not
    refusals: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.refusals

    def summary(self) -> list[str]:
        """What was compared, one line per resource."""
        n, floor = self.needs, self.floor
        have = "unknown" if self.machine.available is None else human_bytes(self.machine.available)
        lines = [f"memory: {n.ranks} ranks need {human_bytes(n.ram(floor))} "
                 f"({n.ranks} x ({human_bytes(floor.private)} torch + {human_bytes(n.ram_per_rank)} planned) "
                 f"+ {human_bytes(floor.shared)} shared libraries), {have} available",
                 f"cores: {n.ranks} ranks on {self.machine.cores} cores",
                 f"torch floor: {floor.source}"]
        for k, need in enumerate(n.swap):
            lines.insert(2 + k, self.swap_line(need))
        return lines

    def swap_line(self, need: SwapNeed) -> str:
        n, room = self.needs, self.swap_room.get(need.folder, UNKNOWN_ROOM)
        free = "unknown" if room.free is None else human_bytes(room.free)
        shared = [o.folder for o in n.swap if o is not need and room.device is not None
                  and self.swap_room.get(o.folder, UNKNOWN_ROOM).device == room.device]
        return (f"swap: {n.ranks} x {human_bytes(need.per_rank)} = {human_bytes(n.ranks * need.per_rank)} of "
                f"{', '.join(need.states)} in {need.folder}, {free} free there"
                + (f" (one disk with {', '.join(shared)})" if shared else ""))

    def to_json(self) -> dict:
        n = self.needs
        return {"fits": self.fits, "ranks": n.ranks, "ram_per_rank": n.ram_per_rank,
                "torch_floor": {"private": self.floor.private, "shared": self.floor.shared,
                                "source": self.floor.source},
                "ram_needed": n.ram(self.floor), "ram_available": self.machine.available,
                "cores": self.machine.cores, "ranks_fitting": self.ranks_fitting,
                "swap": [{"folder": need.folder, "states": list(need.states), "needed": n.ranks * need.per_rank,
                          "free": self.swap_room.get(need.folder, UNKNOWN_ROOM).free} for need in n.swap],
                "refusals": list(self.refusals), "warnings": list(self.warnings)}


def judge(needs: Needs, machine: Machine, floor: TorchFloor, swap_room: dict[str, FolderRoom] | None = None,
          ram_at: Callable[[int], int] | None = None) -> Fit:
    """Compare ``needs`` with ``machine``. ``swap_room``: what each swap folder offers (unknown where
    left out). ``ram_at(k)``: planned RAM per rank at ``k`` ranks (ZeRO's shards grow as ranks shrink),
    to say how many ranks would fit; the same figure at every count if not given."""
    fit = Fit(needs, machine, floor, dict(swap_room or {}))
    n, cores, available = needs.ranks, machine.cores, machine.available
    if available is not None and needs.ram(floor) > available:
        at = ram_at or (lambda k: needs.ram_per_rank)
        fit.ranks_fitting = most_ranks(lambda k: needs.ram(floor, k, at(k)) <= available, n - 1)
        fit.refusals.append(
            f"{n} ranks do not fit this machine's memory: they need {human_bytes(needs.ram(floor))} "
            f"({n} x ({human_bytes(floor.private)} torch + {human_bytes(needs.ram_per_rank)} planned per rank) + "
            f"{human_bytes(floor.shared)} shared), {human_bytes(available)} is available; "
            + (f"at most {fit.ranks_fitting} ranks fit (--set ranks={fit.ranks_fitting})" if fit.ranks_fitting
               else "not even one rank fits: offload state to cpu or nvme, or a smaller model"))
    if n > OVERSUBSCRIBE * cores:
        fit.refusals.append(
            f"{n} ranks on {cores} cores is more than {OVERSUBSCRIBE} ranks per core: each rank would get "
            f"less than 1/{OVERSUBSCRIBE} of a core, so the run (and starting it) would take over "
            f"{OVERSUBSCRIBE} times as long as on enough cores; at most {OVERSUBSCRIBE * cores} ranks "
            f"(--set ranks={min(OVERSUBSCRIBE * cores, fit.ranks_fitting or n)})")
    elif n > cores:
        fit.warnings.append(f"{n} ranks share {cores} cores: each rank gets {cores / n:.2g} of a core, "
                            f"so the run is slower than with at most {cores} ranks")
    fit.refusals += swap_refusals(needs, fit.swap_room)
    if needs.device == "cuda" and machine.cuda_devices is not None and machine.cuda_devices < n:
        fit.refusals.append(
            f"`ranks {n} on cuda` needs a CUDA device per rank on this machine, which has "
            f"{machine.cuda_devices}: write `ranks {n} on cpu` (--set 'ranks={n} on cpu'), or run where each "
            f"rank has a GPU")
    return fit


def swap_refusals(needs: Needs, rooms: dict[str, FolderRoom]) -> list[str]:
    """A swap folder that cannot be used, and each filesystem whose folders' swap files do not fit
    its free space (folders on one device share it)."""
    out, n = [], needs.ranks
    by_device: dict[object, list[SwapNeed]] = {}
    for need in needs.swap:
        room = rooms.get(need.folder, UNKNOWN_ROOM)
        if room.problem is not None:
            out.append(f"the swap folder {need.folder} ({', '.join(need.states)}) cannot be used: {room.problem}; "
                       f"make it a writable folder or point nvme(\"...\") elsewhere")
            continue
        by_device.setdefault(need.folder if room.device is None else room.device, []).append(need)
    for group in by_device.values():
        frees = [f for need in group if (f := rooms.get(need.folder, UNKNOWN_ROOM).free) is not None]
        free, per_rank = min(frees, default=None), sum(need.per_rank for need in group)
        if free is None or n * per_rank <= free:
            continue
        named = " and ".join(need.folder for need in group)
        where = f"the swap folder {named} has" if len(group) == 1 else \
            f"the swap folders {named} are on one disk, which has"
        out.append(f"{where} {human_bytes(free)} ({free} bytes) free, but {n} ranks need "
                   f"{human_bytes(n * per_rank)} ({n * per_rank} bytes: {per_rank} each); free space there or "
                   f"point nvme(\"...\") at a larger disk")
    return out


def most_ranks(fits: Callable[[int], bool], upper: int) -> int:
    """The largest k in 1..upper with ``fits(k)`` (which holds for every smaller k), 0 if none."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def visible_cuda_devices(gpus: str = NVIDIA_GPUS, kfd: str = ROCM_DRIVER) -> int | None:
    """The NVIDIA GPUs this machine's ranks may use, without torch: the driver's count, narrowed by
    CUDA_VISIBLE_DEVICES; None where an AMD GPU's driver is present (torch calls ROCm cuda too)."""
    return None if os.path.exists(kfd) else visible_nvidia_gpus(gpus)


def free_bytes(folder: str | os.PathLike, statvfs: Callable = os.statvfs) -> int | None:
    """Bytes free to this user on the filesystem ``folder`` is (or will be created) on."""
    try:
        st = statvfs(nearest_existing(folder))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def available_memory(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """``MemAvailable``, or this cgroup's headroom where that is smaller (a container's limit)."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    headroom = cgroup_headroom(Path(cgroup_root))
    return available if headroom is None else min(available, headroom)


def cgroup_headroom(root: Path, own: str = "/proc/self/cgroup") -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, else v1, as mounted in a container);
    reclaimable file cache is not usage (the kernel drops it before it kills). None where no limit
    is set or readable."""
    try:
        v2 = next((line.split("::", 1)[1].strip() for line in Path(own).read_text().splitlines()
                   if line.startswith("0::")), "/")
    except OSError:
        v2 = "/"
    for folder, limit_file, usage_file, inactive in (
            (root / v2.lstrip("/"), "memory.max", "memory.current", "inactive_file"),
            (root, "memory.max", "memory.current", "inactive_file"),
            (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        try:
            limit_text = (folder / limit_file).read_text().strip()
            usage = int((folder / usage_file).read_text())
            stat = (folder / "memory.stat").read_text() if (folder / "memory.stat").exists() else ""
            if limit_text == "max" or int(limit_text) >= 1 << 60:
                continue
        except (OSError, ValueError):
            continue
        stats = dict(line.split() for line in stat.splitlines() if len(line.split()) == 2)
        return int(limit_text) - max(0, usage - int(stats.get(inactive, 0)))
    return None


def schedule_fit(compiled, overrides: dict[str, str] | None = None, floor: TorchFloor | None = None,
                 machine: Machine | None = None, statvfs: Callable = os.statvfs,
                 local_ranks: int | None = None) -> Fit:
    """The fit of a compiled schedule (``zdsl.driver.Compiled``, with a graph) on this machine, for
    ``zdsl plan`` and ``zdsl run`` alike. ``floor``: torch's per-process floor, :func:`default_floor`
    when not given. ``local_ranks``: the ranks on this host, where
    another launcher spreads them over several (then how many would fit is not searched)."""
    from zdsl.driver import compile_file
    from zdsl.sim.simulate import simulate

    graph = compiled.graph
    if graph is None:
        raise ValueError(f"schedule_fit needs a schedule that compiled to a graph; {compiled.path} did not")
    sim = compiled.sim or simulate(graph, compiled.schedule.machine)
    needs = needs_of(graph, sim.memory.to_json())
    device = graph.config.get("device", "auto")

    def ram_at(ranks: int) -> int:        # the same schedule at another rank count; its model as sized
        other = compile_file(compiled.path, {**(overrides or {}), "ranks": f"{ranks} on {device}"},
                             lambda spec: compiled.units, simulate=True)
        if other.graph is None or other.sim is None:
            return needs.ram_per_rank
        return needs_of(other.graph, other.sim.memory.to_json()).ram_per_rank

    # how many ranks would fit: not searched where another launcher spreads them
    search: Callable[[int], int] | None = ram_at
    if local_ranks is not None:
        needs, search = dataclasses.replace(needs, ranks=local_ranks), None
    rooms = {need.folder: folder_room(need.folder, statvfs) for need in needs.swap}
    return judge(needs, machine or Machine.this(), floor or default_floor(floor_kind(compiled.schedule)),
                 rooms, search)


NO_TORCH = TorchFloor(0, 0, "not counted: torch is not installed")


# What a rank imports before its model beyond torch and zdsl, by the kind of model: a Hugging Face
# model's rank also holds transformers and its family's modules (about 250 MiB more on CPU).
FLOOR_KINDS = ("", "hf")


def floor_kind(schedule) -> str:
    """The floor a schedule's ranks have (a key of FLOOR_KINDS)."""
    return "hf" if schedule.model.kind == "hf" else ""


def floor_cache(torch_version: str, python: str, kind: str = "") -> Path:
    """The file holding torch's floor measured for this torch and Python (and CPU architecture),
    written by the runtime (``zdsl.runtime.run.preflight``) and read here."""
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in f"{torch_version}-py{python}")
    return cache_dir() / f"torch-floor-{safe}-{platform.machine()}{'-' + kind if kind else ''}.json"


def cached_floor(torch_version: str, python: str, kind: str = "") -> TorchFloor | None:
    """torch's floor as the runtime measured and cached it; None where it has not (or the file is unreadable)."""
    path = floor_cache(torch_version, python, kind)
    try:
        cached = json.loads(path.read_text())
        return TorchFloor(int(cached["private"]), int(cached["shared"]),
                          f"measured for torch {torch_version}, python {python}{' with transformers' if kind else ''} "
                          f"({path})")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def default_floor(kind: str = "") -> TorchFloor:
    """torch's floor where the caller has none (``zdsl plan``): from the runtime's cache; where it was
    never measured here, measured now by the runtime in a subprocess (a few seconds, once)."""
    version = installed_torch()
    if version is None:
        return NO_TORCH
    return cached_floor(version, platform.python_version(), kind) or floor_from_runtime(kind)


def floor_from_runtime(kind: str = "") -> TorchFloor:
    """``python -m zdsl.runtime.run.preflight [KIND]``: the runtime measures the floor, caches it and prints it."""
    done = subprocess.run([sys.executable, "-m", "zdsl.runtime.run.preflight", *([kind] if kind else [])],
                          capture_output=True, text=True)
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
        return TorchFloor(int(out["private"]), int(out["shared"]), str(out["source"]))
    except (IndexError, ValueError, KeyError, TypeError):
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return TorchFloor(0, 0, f"not counted: the runtime could not measure it ({lines[-1]})")


def render_fit(fit: Fit) -> str:
    """The ``zdsl plan`` section."""
    head = "fits this machine" if fit.fits else "does NOT fit this machine (zdsl run refuses it)"
    lines = [head] + [f"  {line}" for line in fit.summary()]
    lines += [f"  warning: {w}" for w in fit.warnings] + [f"  refused: {r}" for r in fit.refusals]
    return "\n".join(lines) + "\n"
