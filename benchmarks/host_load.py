"""How busy the host was with work that is not the benchmark's: other processes and the hypervisor.

A load average cannot say: it counts the benchmark's own ranks, so a benchmark that runs two
ranks on two cores reads "load 2.6 on 2 cores" on an otherwise idle host. This compares the
CPU time the whole host spent (``/proc/stat``) with the CPU time of this process and every child
it has waited for (``os.times``), over the same wall time. Linux only; elsewhere nothing is measured.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

# Above this share of the cores, other work moved the figures: a benchmark says so.
BUSY_SHARE = 0.10


def _host_seconds() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole host since boot, or None where /proc/stat is missing."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class OutsideLoad:
    """The share of the host's cores (0..1) that other processes kept busy, and that the
    hypervisor took (``steal``), between :meth:`start` and :meth:`stop`."""
    others: float = 0.0
    steal: float = 0.0
    measured: bool = False

    @classmethod
    def start(cls) -> "_Window":
        return _Window(time.monotonic(), _host_seconds(), _own_seconds())

    def line(self) -> str:
        if not self.measured:
            return "outside load: not measured here (no /proc/stat)"
        return (f"outside load: other processes {self.others:.0%} of the {os.cpu_count()} cores, "
                f"the hypervisor {self.steal:.0%} (steal)")

    @property
    def busy(self) -> bool:
        return self.measured and self.others + self.steal > BUSY_SHARE


@dataclass
class _Window:
    wall: float
    host: tuple[float, float] | None
    own: float

    def stop(self) -> OutsideLoad:
        """Call after every child has been waited for: a child's CPU counts once it has."""
        host = _host_seconds()
        if self.host is None or host is None:
            return OutsideLoad()
        room = (time.monotonic() - self.wall) * (os.cpu_count() or 1)
        if room <= 0:
            return OutsideLoad()
        busy = host[0] - self.host[0] - (_own_seconds() - self.own)
        return OutsideLoad(others=max(0.0, busy) / room, steal=(host[1] - self.host[1]) / room, measured=True)
