"""The compute statements to ops: ``compute``, ``recompute``, ``step``, and the step's global norm.

Contract: each function issues a unit's compute op through the op stream, with the buffers it
reads and writes (dependencies follow from them), its flops and kernels for the cost model.
A backward accumulates into the full gradients it finds live, so it also reads them; a unit
without gradients of its own computes only the input gradient. A step reads the gradient and
optimizer state where the optimizer lives (on the host lane for a ``step u on cpu`` of
offloaded state) and writes the updated parameters to a fresh copy unless they are the home.
"""
from __future__ import annotations

from zdsl.compile.emission import OpStream
from zdsl.compile.lowering_error import LoweringError
from zdsl.ir import buffer_name, optimizer_bytes_per_param
from zdsl.schedule import PipeStmt


def param_reads(stream: OpStream, u: int) -> list[str]:
    """The gathered parameters unit ``u``'s compute reads: its own and those it ties to."""
    return [buffer_name("param_full", j) for j in (u, *stream.homes.specs[u].uses)]


def compute(stream: OpStream, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
    homes = stream.homes
    spec = homes.specs[u]
    for j in spec.uses:
        stream.waiting_users.get(j, set()).discard(u)
    if phase == "forward":
        forward(stream, u, micro, stmt)
    elif phase == "backward":
        backward(stream, u, micro, stmt)
    else:
        raise LoweringError("`compute` belongs in a forward or backward template", stmt,
                            "the step template uses `step u`")


def forward(stream: OpStream, u: int, micro: int, stmt: PipeStmt) -> None:
    spec, last_unit = stream.homes.specs[u], stream.homes.n_units - 1
    reads = ([buffer_name("act", u - 1)] if u > 0 else []) + param_reads(stream, u)
    writes = [buffer_name("act", u)] + (["loss"] if u == last_unit else [])
    stream.issue("compute.forward", u, reads, writes, "forward", micro, stmt,
                 flops=spec.fwd_flops_per_seq * stream.homes.batch, kernels=spec.fwd_kernels,
                 fresh={buffer_name("act", u)})


def backward(stream: OpStream, u: int, micro: int, stmt: PipeStmt) -> None:
    homes = stream.homes
    spec, last_unit = homes.specs[u], homes.n_units - 1
    reads = [buffer_name("act", u)]
    if u in homes.recompute:
        reads.append(buffer_name("act_inner", u))
    if u < last_unit:
        reads.append(buffer_name("act_grad", u + 1))
    reads += param_reads(stream, u)
    grads = [buffer_name("grad_full", j) for j in (u, *spec.uses) if homes.trains[j]]
    hands_back = u > 0 and homes.needs_backward[u - 1]   # an earlier unit's backward needs its input gradient
    writes = grads + ([buffer_name("act_grad", u)] if hands_back else [])
    held = [grad for grad in grads if stream.is_valid(grad)]
    fresh = {buffer_name("act_grad", u)} | {grad for grad in grads if not stream.is_valid(grad)}
    flops = spec.fwd_flops_per_seq * homes.batch
    stream.issue("compute.backward", u, reads + held, writes, "backward", micro, stmt,
                 flops=(2 if homes.trains[u] else 1) * flops, kernels=spec.bwd_kernels, fresh=fresh)


def recompute(stream: OpStream, u: int, phase: str, micro: int, stmt: PipeStmt) -> None:
    """The forward again inside the backward, for a unit ``recompute`` names."""
    homes = stream.homes
    if u not in homes.recompute or phase != "backward":
        return
    reads = [buffer_name("act", u), *param_reads(stream, u)]
    stream.issue("compute.recompute", u, reads, [buffer_name("act_inner", u)], phase, micro, stmt,
                 flops=homes.specs[u].fwd_flops_per_seq * homes.batch, kernels=homes.specs[u].fwd_kernels,
                 fresh={buffer_name("act_inner", u)})


def step(stream: OpStream, u: int, micro: int, stmt: PipeStmt) -> None:
    homes = stream.homes
    if not homes.trains[u]:
        return
    stage = homes.stage
    on_host = stmt.tier == "cpu" and homes.optim_tier(u) != "device"
    shard_tier = "host" if on_host else None
    grad = buffer_name("grad_full", u) if stage == 0 else buffer_name("grad_shard", u, shard_tier)
    optim = homes.home_optim(u)
    if homes.optim_tier(u) == "nvme":
        optim = buffer_name("optim", u, "host")
    reads = [grad, optim] + (["norm"] if homes.clip else [])
    writes = [optim]
    if stage == 0:
        dest = buffer_name("param_full", u)
        reads.append(dest)
    else:
        dest = buffer_name("param_shard", u, shard_tier)
        # without a master the step updates the current parameters; at stage 3 a partly frozen
        # unit's fresh copy (not the home) also carries the frozen parts on from them
        carries = stage == 3 and homes.layouts[u].frozen_parts and dest != homes.home_param(u)
        if not homes.has_master(u) or carries:
            reads.append(buffer_name("param_full", u) if stage < 3 else homes.home_param(u))
        stream.stale.add(buffer_name("param_full", u))
        stream.stale.add(buffer_name("param_sec", u))      # hpZ's copy of the parameters before the step
    writes.append(dest)
    layout = homes.layouts[u]
    numel = layout.trainable_numel if stage == 0 else layout.trainable_shard_numel
    optimizer = homes.schedule.optimizer
    per_param = optimizer_bytes_per_param(optimizer.kind, optimizer.momentum, homes.has_master(u))
    state_bytes = numel * (per_param + 2 * homes.elem_bytes)
    stream.issue("compute.step", u, reads, writes, "step", micro, stmt, lane="host" if on_host else "compute",
                 bytes=state_bytes, flops=12.0 * numel,
                 fresh={dest} if dest not in stream.buffers.persistent else set())


def norm(stream: OpStream, micro: int) -> None:
    """The global gradient norm (clip, fp16's overflow check) after the last backward.

    With sharded gradients (stage >= 1) each unit's squared norm is its own op, on the lane
    that holds its gradient, and ``norm`` sums them in unit order: the same values summed
    the same way as one op over every gradient, but each part runs as soon as its gradient
    is final, during the rest of the backward, instead of all of them after it, where one op
    over every gradient leaves the disk and the compute idle (benchmarks/capacity.py traces it)."""
    homes = stream.homes
    training = [u for u in range(homes.n_units) if homes.trains[u]]
    all_host = all(homes.optim_tier(u) != "device" for u in training)
    lane = "host" if all_host else "compute"
    if homes.stage == 0:
        shard_numel = sum(homes.layouts[u].trainable_shard_numel for u in training)
        reads = [buffer_name("grad_full", u) for u in training]
        stream.issue("compute.norm", None, reads, ["norm"], "step", micro, None, lane=lane, flops=2.0 * shard_numel)
        return
    parts = {}
    for u in homes.order("backward"):
        if not homes.trains[u]:
            continue
        on_host = homes.optim_tier(u) != "device"
        parts[u] = buffer_name("norm", u, "host" if on_host else None)
        stream.issue("compute.norm", u, [buffer_name("grad_shard", u, "host" if on_host else None)], [parts[u]],
                     "step", micro, None, lane="host" if on_host else "compute",
                     flops=2.0 * homes.layouts[u].trainable_shard_numel)
    stream.issue("compute.norm", None, [parts[u] for u in training], ["norm"], "step", micro, None,
                 lane=lane, flops=float(len(training)))
    # within the shard group: after the all-reduce across replicas each of them holds the same shards
    stream.issue("comm.all_reduce", None, ["norm"], ["norm"], "step", micro, None, bytes=4, group=homes.shard_group)
