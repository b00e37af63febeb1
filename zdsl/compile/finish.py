"""The op stream to the graph's ops: the overlap policy, the frees no statement wrote, the deps.

Contract: :func:`finish_ops` takes an :class:`~zdsl.compile.emission.OpStream` whose phases are
all issued and leaves ``stream.drafts`` as the graph's op order (the host budget reads positions
in it), returning the ops with their dependencies:

* **overlap policy**: a ``verb/phase`` pair missing from ``overlap`` puts those ops and the
  phase's compute in one chain through a zero-byte ``token`` buffer, so they never run at once;
* **auto-free**: a working buffer instance that no statement frees is freed right after its
  last use, on that use's lane;
* **dependencies** come from the buffers each op reads and writes (read after write, write
  after read, write after write); a free counts as a write.
"""
from __future__ import annotations

from zdsl.compile.buffers import BufferTable
from zdsl.compile.emission import Draft, OpStream
from zdsl.ir import Op
from zdsl.schedule import PHASES

# the overlap policy's verb for each op kind it can chain
POLICY_VERBS = {"comm.all_gather": "gather", "comm.reduce_scatter": "scatter", "comm.all_reduce": "reduce",
                "nvme.read": "read", "nvme.write": "write", "copy.h2d": "copy", "copy.d2h": "copy"}


def finish_ops(stream: OpStream, overlap) -> list[Op]:
    apply_overlap_policy(stream.drafts, overlap, stream.buffers)
    stream.drafts = auto_free(stream.drafts, stream.buffers)
    return derive_deps(stream.drafts)


def apply_overlap_policy(drafts: list[Draft], overlap, buffers: BufferTable) -> None:
    """Chain, through ``token``, the ops of every ``verb/phase`` pair ``overlap`` leaves out
    with the compute of that phase."""
    forbidden = {(verb, phase) for verb in set(POLICY_VERBS.values()) for phase in PHASES
                 if f"{verb}/{phase}" not in overlap}
    if not forbidden:
        return
    phases = {phase for _, phase in forbidden}
    buffers.get("token")
    for draft in drafts:
        chained = (POLICY_VERBS.get(draft.kind), draft.phase) in forbidden or (
            draft.kind.startswith("compute.") and draft.phase in phases)
        if chained:
            draft.reads.append("token")
            draft.writes.append("token")


def auto_free(drafts: list[Draft], buffers: BufferTable) -> list[Draft]:
    """``drafts`` with each working buffer instance that no statement frees freed right after
    its last use."""
    pending = unfreed_last_uses(drafts, buffers)
    out: list[Draft] = []
    for i, draft in enumerate(drafts):
        out.append(draft)
        for name in pending.get(i, []):
            out.append(Draft("mem.free", draft.lane, buffers.by_name[name].unit, [], [name], draft.phase,
                             draft.micro))
    return out


def unfreed_last_uses(drafts: list[Draft], buffers: BufferTable) -> dict[int, list[str]]:
    """Position in ``drafts`` -> the buffers whose unfreed instance is last used there."""
    last_use: dict[str, int] = {}       # buffer -> position of its current instance's last use
    pending: dict[int, list[str]] = {}
    live: dict[str, None] = {}          # insertion-ordered: the graph must not depend on hashing
    for i, draft in enumerate(drafts):
        for name in draft.writes:
            if buffers.by_name[name].persistent or name == "token":
                continue
            if draft.kind == "mem.free":
                live.pop(name, None)
                last_use.pop(name, None)
                continue
            if name in live and name in draft.fresh and name not in draft.reads:
                # a fresh write over an instance nobody freed: free it after its last use
                pending.setdefault(last_use[name], []).append(name)
            live[name] = None
            last_use[name] = i
        for name in draft.reads:
            if name in live:
                last_use[name] = i
    for name in live:
        pending.setdefault(last_use[name], []).append(name)
    return pending


def derive_deps(drafts: list[Draft]) -> list[Op]:
    """The ops, each depending on the last writer of what it reads or writes and on the readers
    since of what it writes."""
    ops: list[Op] = []
    last_write: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for i, draft in enumerate(drafts):
        deps: set[int] = set()
        for name in draft.reads:
            if name in last_write:
                deps.add(last_write[name])
        for name in draft.writes:
            if name in last_write:
                deps.add(last_write[name])
            deps.update(readers.get(name, ()))
        for name in draft.reads:
            readers.setdefault(name, []).append(i)
        for name in draft.writes:
            last_write[name] = i
            readers[name] = []
        deps.discard(i)
        ops.append(Op(id=i, kind=draft.kind, lane=draft.lane, unit=draft.unit, reads=draft.reads,
                      writes=draft.writes, bytes=draft.bytes, flops=draft.flops, kernels=draft.kernels,
                      deps=sorted(deps), micro=draft.micro, phase=draft.phase, part=draft.part,
                      parts=draft.parts, accumulate=draft.accumulate, span=draft.span, group=draft.group))
    return ops
