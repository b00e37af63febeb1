"""Bytes moved between tiers per step per rank, against the minimum of ZeRO-Infinity's accounting.

ZeRO-Infinity (Rajbhandari et al., 2021, section 4) counts, per iteration, what offloaded training
must move: the parameters read once for the forward and once for the backward of every
micro-batch, the gradients written once, the optimizer state read and written once for the step,
and the updated parameters written back once. Here the same accounting runs over the graph's own
model states, so the plan can show what a schedule moves beside what it must move:

* NVMe reads: 2 x accumulate x parameter shards on NVMe + optimizer state on NVMe;
* NVMe writes: the trained parameter shards on NVMe + optimizer state on NVMe;
* host to device: 2 x accumulate x parameter shards off the device (stage 3), or the updated
  shards once (stages 1-2, optimizer off the device);
* device to host: the gradient shards, once per micro-batch where they accumulate on the host
  (stages 2-3) or once (stage 1), and the updated shards once where the step runs on the device
  and the parameters live off it.

Host residency (``memory host``, :mod:`zdsl.compile.residency`) can take NVMe traffic below the
minimum: a parameter shard kept between forward and backward is read once, and state held on the
host through the whole step is neither read nor written (the minimum counts it where the
schedule placed it).
"""
from __future__ import annotations

from zdsl.ir import TaskGraph

PATHS = {"nvme.read": "nvme -> host", "nvme.write": "host -> nvme", "copy.h2d": "host -> device",
         "copy.d2h": "device -> host"}


def moved(graph: TaskGraph) -> dict[str, int]:
    """Op kind (``nvme.read``, ``nvme.write``, ``copy.h2d``, ``copy.d2h``) -> bytes per step."""
    out = dict.fromkeys(PATHS, 0)
    for op in graph.ops:
        if op.kind in out:
            out[op.kind] += op.bytes
    return out


def infinity_minimum(graph: TaskGraph) -> dict[str, int]:
    """The same keys as :func:`moved`: ZeRO-Infinity's accounting over this graph's model states."""
    held: dict[tuple[str, str], int] = {}
    trained: dict[tuple[str, str], int] = {}
    trains = {u.index: u.trains for u in graph.units}
    # state residency holds on the host for the whole step is counted where the schedule placed it
    on_nvme = set((graph.config.get("residency") or {}).get("held", ()))
    for buf in graph.buffers.values():
        if buf.persistent and buf.kind in ("param_shard", "grad_shard", "optim"):
            placed = "nvme" if buf.name.replace("@host", "@nvme") in on_nvme else buf.tier
            key = (buf.kind, placed)
            held[key] = held.get(key, 0) + buf.bytes
            if buf.unit is None or trains.get(buf.unit, True):
                trained[key] = trained.get(key, 0) + buf.bytes
    acc = graph.accumulate
    params_nvme, optim_nvme = held.get(("param_shard", "nvme"), 0), held.get(("optim", "nvme"), 0)
    params_off = params_nvme + held.get(("param_shard", "host"), 0)
    optim_off = optim_nvme + held.get(("optim", "host"), 0)
    trained_off = trained.get(("param_shard", "nvme"), 0) + trained.get(("param_shard", "host"), 0)
    grads_host = held.get(("grad_shard", "host"), 0)
    # stages 1-2 keep full parameters on the device; an offloaded step's updated shard comes back once
    shard_bytes = sum(u.shard_numel for u in graph.units if u.trains) * (4 if graph.precision == "fp32" else 2)
    h2d = 2 * acc * params_off if graph.stage == 3 else (shard_bytes if optim_off else 0)
    step_on_device = not optim_off
    d2h = grads_host * (acc if graph.stage >= 2 else 1) + (trained_off if step_on_device else 0)
    return {"nvme.read": 2 * acc * params_nvme + optim_nvme,
            "nvme.write": trained.get(("param_shard", "nvme"), 0) + optim_nvme,
            "copy.h2d": h2d, "copy.d2h": d2h}


def traffic_json(graph: TaskGraph) -> dict:
    """path -> {bytes, minimum}, for the paths this graph moves anything on."""
    have, least = moved(graph), infinity_minimum(graph)
    return {PATHS[kind]: {"bytes": have[kind], "minimum": least[kind]}
            for kind in PATHS if have[kind] or least[kind]}
