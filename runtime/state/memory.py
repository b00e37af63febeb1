"""Byte accounting per tier: every buffer the runtime holds, model states apart.

The planner predicts, per rank and tier, the peak of model states
(parameters, gradients, optimizer: what ZeRO's 2+2+12 bytes per parameter
describe) and the peak of working buffers (gathered parameters at stage 3,
full gradients at stages 2-3, activations, staging copies). The runtime
records the same split here as buffers come and go, so a measured run can be
held against the plan. Peaks are kept per tier for the total, for model
states and for working buffers, and per buffer kind.

On CUDA the report also carries what the caching allocator holds on the
rank's device (``allocator``): the bytes its tensors occupy and the bytes it
has reserved from the driver, now and at their peaks since the rank started.
Reserved memory is what the device really gives this rank (the logical bytes
plus the allocator's rounding, per-stream pools and fragmentation, autograd's
temporaries, NCCL's buffers are apart), so the plan can be checked against it.
"""
from __future__ import annotations

import threading
from collections import defaultdict

import torch

MODEL_STATES = ("parameters", "gradients", "optimizer")


class MemoryMeter:
    """Current and peak bytes per tier; thread-safe (lanes allocate concurrently)."""

    def __init__(self, device: torch.device | None = None):
        self.device = device                                    # the rank's; the allocator is read on CUDA
        self._lock = threading.Lock()
        self._held: dict[str, tuple[str, str, str, int]] = {}   # name -> (tier, kind, category, bytes)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.current: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.peak: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for name, (tier, kind, category, nbytes) in self._held.items():
            self._add(tier, kind, category, nbytes)

    def _add(self, tier: str, kind: str, category: str, nbytes: int) -> None:
        cur, peak = self.current[tier], self.peak[tier]
        keys = ["total", category, f"kind:{kind}"]
        if category in MODEL_STATES:
            keys.append("model_states")
        for key in keys:
            cur[key] += nbytes
            if cur[key] > peak[key]:
                peak[key] = cur[key]

    def hold(self, name: str, tier: str, kind: str, category: str, nbytes: int) -> None:
        """``category``: parameters / gradients / optimizer for model states, else working."""
        with self._lock:
            if name in self._held:
                self._release(name)
            self._held[name] = (tier, kind, category, nbytes)
            self._add(tier, kind, category, nbytes)

    def _release(self, name: str) -> None:
        tier, kind, category, nbytes = self._held.pop(name)
        cur = self.current[tier]
        for key in ["total", category, f"kind:{kind}"] + (["model_states"] if category in MODEL_STATES else []):
            cur[key] -= nbytes

    def release(self, name: str) -> None:
        with self._lock:
            if name in self._held:
                self._release(name)

    def held(self, name: str) -> bool:
        return name in self._held

    def report(self) -> dict:
        """``{"peak": {tier: bytes}, "current": {tier: bytes}, "tiers": {tier: row}}``; a row
        has current and peak bytes for total, model_states, parameters, gradients,
        optimizer, working, and ``by_kind`` peaks. On CUDA also ``"allocator"``:
        :func:`allocator_bytes` of the device."""
        with self._lock:
            out = {}
            for tier in sorted(set(self.current) | set(self.peak)):
                cur, peak = self.current[tier], self.peak[tier]
                row: dict[str, int | dict[str, int]] = {"current": cur["total"], "peak": peak["total"]}
                for key in ("model_states", *MODEL_STATES, "working"):
                    row[f"peak_{key}"] = peak[key]
                    row[f"current_{key}"] = cur[key]
                row["by_kind"] = {k[5:]: v for k, v in peak.items() if k.startswith("kind:")}
                out[tier] = row
            report = {"peak": {t: r["peak"] for t, r in out.items()},
                      "current": {t: r["current"] for t, r in out.items()},
                      "tiers": out}
        allocator = allocator_bytes(self.device)
        if allocator:
            report["allocator"] = allocator
        return report


def allocator_bytes(device: torch.device | None) -> dict[str, int]:
    """What torch's CUDA caching allocator holds on ``device``: ``allocated`` and ``reserved``
    bytes now, ``peak_allocated`` and ``peak_reserved`` since the process started (or the last
    ``torch.cuda.reset_peak_memory_stats``); ``{}`` on any other device."""
    if device is None or device.type != "cuda":
        return {}
    return {"allocated": torch.cuda.memory_allocated(device), "peak_allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device), "peak_reserved": torch.cuda.max_memory_reserved(device)}
