"""One pipeline statement for one unit to ops: the dispatch by verb, and the collective verbs.

Contract: :func:`run_stmt` issues, through the op stream, what ``stmt`` means for unit ``u`` in
``phase`` of micro-batch ``micro``, or nothing where it does not apply (the rules in
:mod:`zdsl.compile.instantiate`: a gather of parameters already gathered and not since updated,
a free of model state, a reduction before the last micro-batch at stages 0-1, a statement a
frozen unit does not need); a statement that cannot mean anything raises
:class:`~zdsl.compile.lowering_error.LoweringError` at its span. Compute and the step are
:mod:`zdsl.compile.compute_ops`, moves between tiers :mod:`zdsl.compile.transfers`.
"""
from __future__ import annotations

from zdsl.compile.compute_ops import compute, recompute, step
from zdsl.compile.emission import OpStream
from zdsl.compile.homes import UnitHomes
from zdsl.compile.lowering_error import LoweringError
from zdsl.compile.transfers import copy, device_shard, nvme
from zdsl.ir import buffer_name
from zdsl.schedule import PipeStmt

FREE_TARGETS = {"parameters": "param_full", "gradients": "grad_full", "activations": "act", "optimizer": "optim"}


def run_stmt(stream: OpStream, stmt: PipeStmt, u: int, phase: str, micro: int) -> None:
    verb, state = stmt.verb, stmt.ref.state
    if frozen_skips(stream.homes, verb, state, u, phase):
        return
    if verb == "compute":
        compute(stream, u, phase, micro, stmt)
    elif verb == "recompute":
        recompute(stream, u, phase, micro, stmt)
    elif verb == "step":
        step(stream, u, micro, stmt)
    elif verb == "gather":
        need_state(state, "parameters", stmt)
        gather(stream, u, phase, micro, stmt)
    elif verb == "free":
        free_stmt(stream, state, u, phase, micro, stmt)
    elif verb == "scatter":
        need_state(state, "gradients", stmt)
        scatter(stream, u, phase, micro, stmt)
    elif verb == "reduce":
        need_state(state, "gradients", stmt)
        reduce(stream, u, phase, micro, stmt)
    elif verb == "copy":
        copy(stream, state, u, stmt.tier, phase, micro, stmt)
    elif verb in ("read", "write"):
        nvme(stream, verb, state, u, phase, micro, stmt)
    else:
        raise LoweringError(f"unknown statement {verb!r}", stmt)


def frozen_skips(homes: UnitHomes, verb: str, state: str, u: int, phase: str) -> bool:
    """A statement a frozen unit does not need: anything in a backward it does not need,
    and the reductions, gradient and optimizer moves and step of a unit that does not
    train (frees always run: they drop what is no longer needed)."""
    if verb == "free":
        return False
    if phase == "backward" and not homes.needs_backward[u]:
        return True
    return not homes.trains[u] and (phase == "step" or verb in ("scatter", "reduce")
                                    or state in ("gradients", "optimizer"))


def need_state(state: str, want: str, stmt: PipeStmt) -> None:
    if state != want:
        raise LoweringError(f"`{stmt.verb}` acts on {want}, not {state}", stmt, f"write `{stmt.verb} {want}[u]`")


def gather(stream: OpStream, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
    """Stage 3: all-gather a unit's parameters (and those it ties to) within its shard group
    unless gathered and not since updated; with hpZ from the secondary shard within the node
    where one is held. Stages 1-2: all-gather the shard a step just updated."""
    homes = stream.homes
    full = buffer_name("param_full", u)
    if homes.stage == 0:
        return
    if homes.stage == 3:
        if not (stream.is_valid(full) and full not in stream.stale):
            gather_unit(stream, u, phase, micro, stmt)
        for j in homes.specs[u].uses:
            gather(stream, j, phase, micro, stmt)
            stream.waiting_users.setdefault(j, set()).add(u)
        return
    src = buffer_name("param_shard", u)   # stages 1-2: the shard a step just updated
    if src in stream.live:                # (its trainable parts: the frozen ones never change)
        stream.collective("comm.all_gather", u, [src], [full], phase, micro, stmt, trained=True,
                          group=homes.shard_group)
        stream.consume(src, phase, micro)


def gather_unit(stream: OpStream, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
    """Stage 3's all-gather of one unit. With hpZ (``secondary parameters over node``) the gather
    from the primary shard also keeps this rank's slice of the result within its node, the
    secondary shard (a working buffer, freed after its last use), and every later gather before
    the step (the backward's, a later micro-batch's forward) reads it within the node instead."""
    homes = stream.homes
    full, sec = buffer_name("param_full", u), buffer_name("param_sec", u)
    if homes.secondary is not None and stream.is_valid(sec) and sec not in stream.stale:
        stream.collective("comm.all_gather", u, [sec], [full], phase, micro, stmt, group=homes.secondary)
        return
    src = device_shard(stream, u, phase, micro, stmt)
    writes = [full] if homes.secondary is None else [full, sec]
    first = stream.collective("comm.all_gather", u, [src], writes, phase, micro, stmt, group=homes.shard_group)
    if homes.secondary is not None:     # the first part starts the secondary shard's new instance
        stream.drafts[first].fresh.add(sec)
    stream.consume(src, phase, micro)


def free_stmt(stream: OpStream, state: str, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
    target = FREE_TARGETS.get(state)
    if target is None:
        raise LoweringError(f"cannot free {state}", stmt)
    if target == "param_full" and phase == "forward" and u in stream.homes.persist:
        return   # persistent units stay gathered until their backward
    stream.free(buffer_name(target, u), phase, micro, stmt)


def scatter(stream: OpStream, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
    """Reduce-scatter a unit's full gradient into its shard within its shard group; at stage 1
    only on the last micro-batch (full gradients accumulate locally until then). Where the shard
    group is smaller than the ranks (HSDP, MiCS), the shard is then all-reduced across its
    replicas: once, on the last micro-batch, where shards accumulate on the device; after every
    reduce-scatter where each is copied to the host to accumulate there."""
    homes = stream.homes
    stage = homes.stage
    if stage == 0:
        raise LoweringError("scatter needs sharded gradients or optimizer state (zero 1 or more)", stmt,
                            "use `reduce gradients[u]` at zero 0")
    if stage == 1 and micro != homes.last_micro:
        return
    dst = buffer_name("grad_shard", u)
    accumulate = stage >= 2 and micro > 0 and homes.grad_home(u) == "device"
    first = stream.collective("comm.reduce_scatter", u, [buffer_name("grad_full", u)], [dst], phase, micro, stmt,
                              accumulate=accumulate, group=homes.shard_group)
    if not accumulate:      # the first part starts the shard's new instance; the others fill it
        stream.drafts[first].fresh.add(dst)
    if homes.replicas is not None and (micro == homes.last_micro or homes.grad_home(u) != "device"):
        stream.collective("comm.all_reduce", u, [dst], [dst], phase, micro, stmt, group=homes.replicas, shard=True)


def reduce(stream: OpStream, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
    """All-reduce a unit's full gradient (stage 0, as DDP) on the last micro-batch."""
    if stream.homes.stage != 0:
        raise LoweringError("reduce (all-reduce) keeps full gradients; it is for zero 0", stmt,
                            "use `scatter gradients[u]` when gradients are sharded")
    if micro == stream.homes.last_micro:
        grad = buffer_name("grad_full", u)
        stream.collective("comm.all_reduce", u, [grad], [grad], phase, micro, stmt)
