"""The machine profile a schedule without a ``machine`` statement is planned with: calibrated on this machine.

``zdsl plan``, ``zdsl tune`` and ``zdsl run --trace`` call :func:`enable`; then the first schedule they
load that has no ``machine`` statement (or include of one) gets the profile cached in zdsl's cache folder
for this host, core count, torch version and device. Where none is cached, the runtime measures one now
(``zdsl calibrate --quick`` in a subprocess, about 30 s on 2 cores, once per machine) and caches it; a failure to
measure leaves zdsl's default profile and says why. Either way one line on stderr says what happened, once
per process. ``zdsl calibrate`` refreshes the cached profile. ``ZDSL_CALIBRATE=0`` (or ``--no-calibrate``)
plans with the default profile and neither measures nor reads the cache.

Torch-free: the cache is JSON, the measuring is the runtime's, in its own process.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from zdsl import env
from zdsl.cache import cache_dir
from zdsl.machine_profile import MachineProfile, given_links
from zdsl.sim.this_machine import device_in_ram, installed_torch, nvidia_gpus, usable_cores

QUICK_TIMEOUT = 120     # seconds a quick calibration may take before the default profile is used
# What a cached profile holds; one of an older format is measured again once. 2: compute rates by
# precision and width, disk rates alone and shared (zdsl.sim.rates); 3: the compute rates of one
# rank alone with every core too (flops_alone_*, compute_ranks); 4: the collectives of 2 ranks of one
# host through shared memory (zdsl.runtime.dist.shm: 2-3x gloo's TCP rates), and disk rates timed in
# interleaved rounds; 5: disk rates into huge-page buffers, where the runtime's transfers now land
# (zdsl.runtime.io.aligned: 2x the rates into 4 KiB pages); 6: the runtime's compute against the
# compute test's (compute_excess, from a wider reference step); 7: the event loop's CPU per op (loop),
# which the other fixed costs are fitted beside; 8: 2 ranks' collectives through shared memory at every
# size (not only from 1 MiB), one at a time.
PROFILE_FORMAT = 8
# What a profile of each older format lacks, as the line saying it was measured again words it.
LACKING = {1: "without rates by precision, width and ranks",
           2: "without the compute rates of one rank with every core",
           3: "with the collective rates of gloo's TCP, before shared memory",
           4: "with disk rates into 4 KiB pages, before huge-page buffers",
           5: "without the runtime's compute rate (compute_excess)",
           6: "without the event loop's cost per op (loop)",
           7: "with small collectives through gloo's TCP, before shared memory at every size"}
# The reference steps of this many of the machine's latest calibrations are kept beside its profile:
# what the host usually does, against which a calibration taken in one of its slow spells shows.
HISTORY = 8


@dataclass(frozen=True)
class Choice:
    """The profile chosen for schedules without a machine statement: None keeps zdsl's default."""
    profile: MachineProfile | None
    line: str               # what ``zdsl plan`` prints as its ``rates:`` line
    said: str | None        # the one line on stderr when it was chosen (None: nothing to say)


_enabled = False
_choice: Choice | None = None


def enable(on: bool = True) -> None:
    """Let this process plan schedules without a machine statement with the calibrated profile."""
    global _enabled, _choice
    _enabled, _choice = on and env.get("ZDSL_CALIBRATE") != "0", None


def profile_key(device: str) -> str:
    """What a cached profile is valid for: host name, usable cores, torch version and device kind."""
    raw = f"{socket.gethostname()}-{usable_cores()}cores-torch{installed_torch()}-{device}"
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in raw)


def machine_device() -> str:
    """The device kind this machine calibrates: ``cuda`` with a GPU, else ``cpu``."""
    return "cpu" if device_in_ram("auto") else "cuda"


def profile_path(device: str | None = None) -> Path:
    return cache_dir() / f"machine-{profile_key(device or machine_device())}.json"


def write_profile(fields: dict, statement: str, path: Path | None = None,
                  reference: tuple[int, float] | None = None) -> Path:
    """Cache a measured profile (called by the runtime's ``zdsl calibrate``); ``reference``: the
    ranks and reference step it was measured with, kept beside it (``reference_s``) and added to
    the machine's history (:func:`usual_reference`)."""
    path, when = path or profile_path(), _now()
    cached = {"format": PROFILE_FORMAT, "profile": fields, "statement": statement, "when": when}
    if reference is not None:
        cached["reference_s"] = reference[1]
    return _write(path, cached, reference, when)


def add_reference(reference: tuple[int, float], path: Path | None = None) -> Path:
    """Add a calibration's (ranks, reference step) to the machine's history and keep the cached
    profile (one measured off the machine's usual, slower or faster, does not replace it)."""
    path = path or profile_path()
    return _write(path, json.loads(path.read_text()), reference, _now())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _write(path: Path, cached: dict, reference: tuple[int, float] | None, when: str) -> Path:
    """``cached`` with the history of reference steps, ``reference`` (measured ``when``) added,
    written atomically."""
    history = reference_history(path)
    if reference is not None:
        history.append({"when": when, "ranks": reference[0], "step_s": reference[1], "format": PROFILE_FORMAT})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**cached, "references": history[-HISTORY:]}, indent=1))
    tmp.replace(path)
    return path


def reference_history(path: Path) -> list[dict]:
    """The reference steps of the latest calibrations cached at ``path`` by a runtime of this
    profile format (an older one ran the same reference another way, e.g. format 8's collectives):
    ``{"when", "ranks", "step_s", "format"}`` each, oldest first."""
    try:
        found = json.loads(path.read_text()).get("references", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in found if isinstance(r, dict) and isinstance(r.get("ranks"), int)
            and isinstance(r.get("step_s"), (int, float)) and r["step_s"] > 0
            and r.get("format") == PROFILE_FORMAT] if isinstance(found, list) else []


def usual_reference(ranks: int, path: Path | None = None) -> tuple[float, int] | None:
    """(the median reference step of this machine's latest calibrations at ``ranks`` ranks, how
    many there were); None where none is cached."""
    steps = [r["step_s"] for r in reference_history(path or profile_path()) if r["ranks"] == ranks]
    return (statistics.median(steps), len(steps)) if steps else None


def read_profile(path: Path) -> tuple[MachineProfile, str] | None:
    """The cached profile and when it was measured; None where absent, unreadable or of an older
    format (:data:`PROFILE_FORMAT`)."""
    try:
        cached = json.loads(path.read_text())
        if cached.get("format", 1) < PROFILE_FORMAT:
            return None
        return MachineProfile.of_fields(cached["profile"]), str(cached["when"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def cached_format(path: Path) -> int | None:
    """The format of the profile cached at ``path``; None where absent or unreadable."""
    try:
        found = json.loads(path.read_text()).get("format", 1)
        return found if isinstance(found, int) else None
    except (OSError, ValueError, AttributeError):
        return None


def calibrate_in_runtime(timeout: float = QUICK_TIMEOUT) -> str | None:
    """``zdsl calibrate --quick`` in a subprocess, which caches its profile; None on success, else why not."""
    ranks = ["--ranks", "1"] if machine_device() == "cuda" and len(nvidia_gpus()) == 1 else []   # nccl: a GPU a rank
    try:
        done = subprocess.run([sys.executable, "-m", "zdsl.runtime.calibrate.cli", "--quick", "--no-progress",
                               *ranks], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"it took over {timeout:.0f} s"
    except OSError as e:
        return str(e)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return lines[-1].removeprefix("error: ")
    for line in done.stderr.splitlines():        # a calibration taken while the host's speed moved, say
        if line.startswith("warning: "):
            print(f"zdsl: calibrating: {line}", file=sys.stderr)
    return None


def choose(device: str) -> Choice:
    """The cached profile for ``device``; measured now where none is cached (on this machine's device)."""
    path = profile_path(device)
    cached = read_profile(path)
    if cached is not None:
        return Choice(cached[0], f"rates: calibrated on this machine (cached {cached[1]}, {path})", None)
    fallback = (f"rates: zdsl's uncalibrated default {'cuda' if device == 'cuda' else 'cpu'!r} profile; "
                f"calibrate: zdsl calibrate")
    if device != machine_device():
        return Choice(None, fallback, None)          # a CUDA schedule planned on a CPU box: nothing to measure
    older = path.exists()                             # there but unreadable: of an older format
    found = cached_format(path)
    lacking = LACKING.get(found, "") if found is not None else ""
    why = calibrate_in_runtime()
    cached = read_profile(path) if why is None else None
    if cached is None:
        why = why or f"it wrote no profile to {path}"
        return Choice(None, fallback, f"zdsl: could not calibrate this machine ({why}); planning with "
                                      f"zdsl's default profile")
    said = (f"zdsl: calibrated this machine again (zdsl calibrate --quick): its cached profile was of an older "
            f"format{', ' + lacking if lacking else ''}; cached in {path}" if older else
            f"zdsl: calibrated this machine once (zdsl calibrate --quick), cached in {path}")
    return Choice(cached[0], f"rates: calibrated on this machine (cached {cached[1]}, {path})", said)


def calibrated_for(schedule) -> MachineProfile | None:
    """The profile to plan ``schedule`` with where it has no machine statement; None: keep its own."""
    global _choice
    if not _enabled or "machine" in schedule.spans:
        return None
    device = "cpu" if device_in_ram(schedule.device) else "cuda"
    if _choice is None:
        _choice = choose(device)
        if _choice.said:
            print(_choice.said, file=sys.stderr)
    profile = _choice.profile      # with what a ``link`` statement gave (calibrate measures one machine)
    return None if profile is None else profile.with_fields(**given_links(schedule))


def rates_line() -> str | None:
    """The ``rates:`` line for a schedule planned with :func:`calibrated_for`'s choice; None when off."""
    return _choice.line if _enabled and _choice is not None else None


def calibrated_source() -> str:
    """The plan JSON's machine source where the schedule has no machine statement."""
    choice = _choice if _enabled else None
    return f"calibrated: {profile_path(machine_device())}" if choice is not None and choice.profile else "default"
