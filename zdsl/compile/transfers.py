"""The statements that move state between tiers to ops: ``copy ... to host|device``, ``read``/``write`` NVMe.

Contract: a move is issued only where it applies: for a unit whose state lives on the tier
it moves from or to (partial offload drops the others), when its source holds data now, and
not when its destination already does. A staging copy a move reads is used up by it (freed
after). An NVMe read whose host copy the host budget kept resting revives it instead.
"""
from __future__ import annotations

from zdsl.compile.emission import OpStream
from zdsl.compile.lowering_error import LoweringError
from zdsl.ir import buffer_name
from zdsl.schedule import PipeStmt

NVME_KINDS = {"parameters": "param_shard", "optimizer": "optim", "gradients": "grad_shard"}


def device_shard(stream: OpStream, u: int, phase: str, micro: int, stmt: PipeStmt) -> str:
    """The device copy of a unit's parameter shard, fetched now if no statement brought it
    (a tied unit gathered for its user, or a template that omits the read or copy)."""
    homes = stream.homes
    dev, host = buffer_name("param_shard", u), buffer_name("param_shard", u, "host")
    tier = homes.param_tier(u)
    if tier == "device" or stream.is_valid(dev):
        return dev
    if tier == "nvme" and not stream.is_valid(host):
        stream.read_nvme("param_shard", u, phase, micro, stmt)
    stream.issue("copy.h2d", u, [host], [dev], phase, micro, stmt,
                 bytes=homes.layouts[u].shard_numel * homes.elem_bytes, fresh={dev})
    if tier == "nvme":
        stream.consume(host, phase, micro)
    return dev


def copy(stream: OpStream, state: str, u: int, to: str | None, phase: str, micro: int, stmt: PipeStmt) -> None:
    if to not in ("host", "device"):
        raise LoweringError("copy goes `to host` or `to device`", stmt)
    if state == "parameters":
        copy_parameters(stream, u, to, phase, micro, stmt)
    elif state == "gradients":
        copy_gradients(stream, u, to, phase, micro, stmt)
    elif state == "activations":
        copy_activations(stream, u, to, phase, micro, stmt)
    else:
        raise LoweringError(f"cannot copy {state}", stmt)


def copy_parameters(stream: OpStream, u: int, to: str, phase: str, micro: int, stmt: PipeStmt) -> None:
    homes = stream.homes
    dev, host = buffer_name("param_shard", u), buffer_name("param_shard", u, "host")
    nbytes = homes.layouts[u].shard_numel * homes.elem_bytes
    if to == "device":
        if homes.stage == 3 and homes.param_tier(u) == "device" and phase != "step":
            return
        if not stream.is_valid(host) or (dev in stream.live and phase != "step"):
            return
        stream.issue("copy.h2d", u, [host], [dev], phase, micro, stmt, bytes=nbytes, fresh={dev})
        stream.consume(host, phase, micro)
    else:
        if not stream.is_valid(dev) or homes.param_tier(u) == "device":
            return
        stream.issue("copy.d2h", u, [dev], [host], phase, micro, stmt, bytes=nbytes)


def copy_gradients(stream: OpStream, u: int, to: str, phase: str, micro: int, stmt: PipeStmt) -> None:
    homes = stream.homes
    stage = homes.stage
    if to != "host" or (homes.grad_home(u) == "device" and homes.optim_tier(u) == "device"):
        return
    src = buffer_name("grad_full", u) if stage == 0 else buffer_name("grad_shard", u)
    if not stream.is_valid(src) or (stage < 2 and micro != homes.last_micro):
        return
    if stage == 0:
        raise LoweringError("gradients move to the host only when sharded (zero 1 or more)", stmt)
    dst = buffer_name("grad_shard", u, "host")
    accumulate = stage >= 2 and micro > 0
    stream.issue("copy.d2h", u, [src], [dst], phase, micro, stmt, accumulate=accumulate,
                 bytes=homes.layouts[u].trainable_shard_numel * homes.elem_bytes,
                 fresh=set() if accumulate else {dst})


def copy_activations(stream: OpStream, u: int, to: str, phase: str, micro: int, stmt: PipeStmt) -> None:
    act, act_host = buffer_name("act", u), buffer_name("act", u, "host")
    kind, src, dst = ("copy.d2h", act, act_host) if to == "host" else ("copy.h2d", act_host, act)
    if stream.is_valid(src):
        stream.issue(kind, u, [src], [dst], phase, micro, stmt, bytes=stream.buffers.get(act).bytes, fresh={dst})
        stream.free(src, phase, micro, None)


def nvme(stream: OpStream, verb: str, state: str, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
    """``read``/``write`` of a unit's sharded state from/to NVMe, where that state lives there."""
    if stmt.tier not in (None, "nvme"):
        raise LoweringError(f"{verb} moves state {'from' if verb == 'read' else 'to'} nvme", stmt)
    kind = NVME_KINDS.get(state)
    if kind is None:
        raise LoweringError(f"cannot {verb} {state} on nvme", stmt)
    if stream.homes.state_tier(kind, u) != "nvme":
        return
    on_disk, host = buffer_name(kind, u, "nvme"), buffer_name(kind, u, "host")
    nbytes = stream.buffers.get(on_disk).bytes
    if verb == "read":
        if not stream.is_valid(host):
            stream.read_nvme(kind, u, phase, micro, stmt)
    elif stream.is_valid(host):
        stream.issue("nvme.write", u, [host], [on_disk], phase, micro, stmt, bytes=nbytes)
