"""A happens-before checker of the CUDA path that runs on the CPU.

:class:`HBChecker` is the executor's stream seam (``Executor(streams=...)``, the calls
``runtime/exec/streams.py``'s ``LaneStreams`` answers on CUDA): the executor runs a CPU step
exactly as it would on CUDA, and the checker replays what each call would order on the device
(``runtime/exec/hb_model.py``: vector clocks, the caching allocator's pools):

* ``begin_step``: every lane waits for the default stream, where the caller's work before the
  step (zeroed gradients, the micro-batches) is stamped; host lanes see it too;
* ``ordered``: a device lane's stream waits on the events of its dependencies on other lanes (and
  of every dependency before a free), and is ordered after the host-side completion of its
  host-lane dependencies (it was enqueued after them); a host lane, and a device-lane op whose
  body touches a host buffer, synchronize on their dependencies' events; ``record`` is an event
  recorded on the lane's stream;
* a collective runs on NCCL's own stream, ordered after its issuing stream at issue (what gloo
  does after its first c10d call counts as the collective's: NCCL runs it as one kernel); the
  watcher's ``wait`` (``on_lane``) and what follows it are ordered after it and after the lane's
  work up to the issue, not after what the lane issued since (the watcher may come first); the
  lane's later ops that depend on it are (its wait is on their stream before them);
* ``end_step``/``device_times``: a device synchronize; ``timing`` as LaneStreams' (``device_times``
  only while it is set: ``zdsl run`` sets it to whether the step is timed).

A ``TorchDispatchMode`` stamps every aten op's storage reads and writes (written: the arguments
the schema marks mutable, and fresh outputs; read: the other tensor arguments; views: neither)
on the simulated stream of the thread that runs it; a collective's (``c10d``) on NCCL's stream.
The host's own accesses (NVMe transfers, the native AdamW step) come through
``runtime/io/host_access.py``. The buffer table's allocations and frees feed the allocator
model, and its ``record_current_stream`` calls are the streams recorded on a freed block
(``record_streams=False`` models a free path without them).

A race makes ``end_step`` (or ``device_times``) raise :class:`HBRaceError`, which names the
rank, the step, the buffer, both ops with their lanes and units, and, for a reuse, the free.
A user runs it with ``ZDSL_HB_CHECK=1 zdsl run prog.zs`` (:func:`run_streams`).

Not modelled: an op's temporaries the allocator frees when their last reference goes (they live
and die on the op's stream); host memory's pools (pinned blocks are guarded by the copies' events).
"""
from __future__ import annotations

import copy
import re
import threading
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from zdsl import env
from zdsl.ir import Op, TaskGraph
from zdsl.runtime.exec.errors import describe_op
from zdsl.runtime.exec.hb_model import Block, Clocks, Freed, Pools, Race
from zdsl.runtime.exec.streams import HOST_LANES, host_side_ops
from zdsl.runtime.io import host_access

FACTORY = re.compile(r"new_.*|.*_like")    # as torch.cuda._sanitizer: their tensor arguments are metadata
DEFAULT, NCCL = "default", "nccl"
WAIT = ":wait#"                 # a collective's wait on its lane: "comm:wait#12"
MAX_REPORTED = 12


class HBRaceError(RuntimeError):
    """A step has accesses no stream or event orders: what CUDA could run in either order."""


class _Stamp(TorchDispatchMode):
    """Stamps every aten op the thread runs on the checker (one instance per thread that enters)."""

    def __init__(self, checker: "HBChecker"):
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.checker.stamp_op(func, args, kwargs, out)
        return out


class HBChecker:
    """The CPU stand-in for ``LaneStreams`` that checks the order CUDA would give (see the module
    docstring). Use as a context manager around the steps (it stamps the calling thread's work
    as the default stream's); ``state`` is the rank's state (its buffer table's allocations and
    frees feed the allocator model)."""

    def __init__(self, graph: TaskGraph, state=None, rank: int = 0, record_streams: bool = True):
        """``graph``: what the checker orders by (each op's dependencies and lane), the graph the
        executor runs unless a test mutates it."""
        self.rank, self.record_streams = rank, record_streams
        self.table = getattr(state, "table", None)
        self.clocks = Clocks()
        self.pools = Pools(self.clocks)
        self.lock = threading.RLock()
        self.local = threading.local()
        self.blocks: dict[int, tuple[StorageWeakRef, Block]] = {}     # data_ptr -> the block there
        self.root = self            # the checker whose races are reported once, whichever graph ran
        self.reported = 0           # the root's: races already raised
        self._undo: list = []
        self._order_by(graph, "step")

    def _order_by(self, graph: TaskGraph, what: str) -> None:
        """What this seam orders by: ``graph``'s dependencies and lanes; ``what`` names a run of it."""
        self.graph, self.what = graph, what
        self.timing = True          # as LaneStreams': device_times() only while set (the executor's record)
        self.deps = [op.deps for op in graph.ops]
        self.lane_of = [op.lane for op in graph.ops]
        self.host_side = host_side_ops(graph)
        n = len(graph.ops)
        self.events: list[dict | None] = [None] * n       # each device op's end, as a recorded clock
        self.host_done: list[dict | None] = [None] * n    # each host-lane op's end on its host thread
        self.work: dict[int, dict] = {}                   # collective op -> NCCL's clock after it
        self.step = -1

    def for_graph(self, graph: TaskGraph, what: str) -> "HBChecker":
        """The seam of another graph run on the same rank state between steps (the evaluation's
        forward graph, with an executor of its own): ordered by ``graph``, on the same streams,
        clocks, allocator pools and blocks, so each graph's ops are checked against the other's.
        As on CUDA, where that executor has lane streams of its own; without them its ops would be
        the caller's work on the default stream, which waits for no collective. Installed while
        this checker is (it is not a context manager of its own); ``what`` names its runs."""
        view = copy.copy(self)
        view._undo = []
        view._order_by(graph, what)
        return view

    # -- installing ----------------------------------------------------------------
    def __enter__(self) -> "HBChecker":
        from zdsl.runtime.state import buffers
        host_access.observer = self.stamp_host
        saved = buffers.record_current_stream
        buffers.record_current_stream = self._record_stream
        self._undo.append(lambda: setattr(buffers, "record_current_stream", saved))
        if self.table is not None:
            table, alloc, release = self.table, self.table.alloc, self.table.release
            table.alloc = lambda slot: self._alloc(alloc, slot)
            table.release = lambda slot: self._release(release, slot)
            self._undo.append(lambda: (table.__dict__.pop("alloc", None), table.__dict__.pop("release", None)))
        self._undo.append(lambda: setattr(host_access, "observer", None))
        mode = _Stamp(self)
        mode.__enter__()
        self.local.mode = True

        def leave() -> None:
            mode.__exit__(None, None, None)
            self.local.mode = False
        self._undo.append(leave)
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    @contextmanager
    def _on(self, agent: str, op: Op | None):
        """Run the body as ``agent`` (a lane's stream or host thread) doing ``op``."""
        local = self.local
        saved = (getattr(local, "agent", None), getattr(local, "op", None), getattr(local, "in_collective", False),
                 getattr(local, "seam", None))
        local.agent, local.op, local.in_collective, local.seam = agent, op, False, self
        mode = None
        if not getattr(local, "mode", False):
            mode = _Stamp(self)
            mode.__enter__()
            local.mode = True
        try:
            yield
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
                local.mode = False
            local.agent, local.op, local.in_collective, local.seam = saved
            if op is not None:
                self._name_buffers(op)

    def _agent(self) -> str:
        return getattr(self.local, "agent", None) or DEFAULT

    def _who(self) -> str:
        op = getattr(self.local, "op", None)
        if op is None:
            return "the caller's work around the step (default stream)"
        return f"op {describe_op(op)} on lane {op.lane}"

    # -- the seam (what runtime/exec/streams.py's LaneStreams answers on CUDA) --------------
    def begin_step(self) -> None:
        with self.lock:
            self.step += 1
            n = len(self.events)
            self.events, self.host_done, self.work = [None] * n, [None] * n, {}
            origin = self.clocks.snapshot(DEFAULT)
            for lane in set(self.lane_of):          # lane streams wait on the origin event; host
                self.clocks.merge(lane, origin)     # threads come after the caller's host work

    def end_step(self) -> None:
        with self.lock:
            self.clocks.sync_all(DEFAULT)
            self.pools.synchronized()
        self._raise_races()

    def device_times(self) -> dict[int, tuple[float, float]]:
        if not self.timing:
            raise RuntimeError("device_times: these lane streams were made without timing events")
        self.end_step()
        return {}                                  # no device: the executor keeps its host times

    @contextmanager
    def ordered(self, op: Op):
        lane = op.lane
        host = lane in HOST_LANES
        with self.lock:
            for d in self.deps[op.id]:
                event = self.events[d]
                if event is None:
                    if self.lane_of[d] in HOST_LANES:     # enqueued (or run) after it finished
                        self.clocks.merge(lane, self.host_done[d])
                elif host or self.host_side[op.id] or self.lane_of[d] != lane or op.kind == "mem.free":
                    self.clocks.merge(lane, event)       # event.synchronize / stream.wait_event
                elif self.graph.ops[d].is_collective:    # its watcher's wait is on this stream already
                    self.clocks.merge(lane, event)
        with self._on(lane, op):
            yield
            if not host:
                self.record(op)
        if host:
            with self.lock:
                self.host_done[op.id] = self.clocks.snapshot(lane)

    def record(self, op: Op) -> None:
        if op.lane not in HOST_LANES:
            with self.lock:
                agent = self._agent()
                self.events[op.id] = self.clocks.snapshot(agent if agent != DEFAULT else op.lane)

    @contextmanager
    def on_lane(self, op: Op):
        """The watcher's ``wait`` and what follows it on the lane: ordered after the collective's work
        on NCCL's stream and after the lane's work up to the collective's issue, but not after what
        the lane issued since (the watcher may run before that is enqueued): a wait agent of its own."""
        agent = f"{op.lane}{WAIT}{op.id}"
        with self.lock:
            self.clocks.merge(agent, self.events[op.id])
            self.clocks.merge(agent, self.work.get(op.id))
        with self._on(agent, op):
            yield

    # -- stamping ----------------------------------------------------------------------
    def stamp_op(self, func, args, kwargs, out) -> None:
        schema = func._schema
        if func.namespace == "c10d":
            self._collective(schema, args, kwargs)
            return
        if func is torch.ops.aten.record_stream.default:
            return
        reads, writes, fresh = [], [], []
        factory = FACTORY.fullmatch(schema.name.split("::")[-1]) is not None
        for arg, value in _bound(schema, args, kwargs):
            alias = arg.alias_info
            if alias is None:
                if not factory:                  # empty_like(x) reads only x's metadata
                    reads.extend(_tensors(value))
            elif alias.is_write:
                writes.extend(_tensors(value))
        returns = schema.returns
        values = (out,) if len(returns) == 1 else (out if isinstance(out, (tuple, list)) else ())
        for ret, value in zip(returns, values):
            if ret.alias_info is None:
                fresh.extend(_tensors(value))
        if reads or writes or fresh:
            self._stamp(reads, writes, fresh)

    def stamp_host(self, reads, writes) -> None:
        """runtime/io/host_access.py's observer: the host itself reads/writes these tensors."""
        self._stamp(list(reads), list(writes), [])

    def _stamp(self, reads, writes, fresh, agent: str | None = None) -> None:
        issuer = self._agent()
        if agent is None and getattr(self.local, "in_collective", False):
            agent = NCCL           # what a backend does after its first c10d call is the collective's own
        agent = agent or issuer
        who = self._who()
        with self.lock:
            if fresh and issuer not in HOST_LANES and issuer != NCCL and WAIT not in issuer:
                self.pools.allocate(issuer, who)
            epoch = self.clocks.tick(agent)
            written = set()
            for t in fresh:
                st = _storage(t)
                if st is not None:
                    self._new_block(st, issuer)
                    writes.append(t)
            for t in writes:
                st = _storage(t)
                if st is not None and st.data_ptr() not in written:
                    written.add(st.data_ptr())
                    self.clocks.access(self._block(st, issuer), agent, epoch, who, True)
            for t in reads:
                st = _storage(t)
                if st is not None and st.data_ptr() not in written:
                    self.clocks.access(self._block(st, issuer), agent, epoch, who, False)
            op = getattr(self.local, "op", None)
            if agent == NCCL and op is not None:      # the collective's, in the graph its op is of
                seam = getattr(self.local, "seam", None) or self
                seam.work[op.id] = self.clocks.snapshot(NCCL)

    def _collective(self, schema, args, kwargs) -> None:
        """A c10d op: NCCL's stream waits for the issuing stream, then reads its inputs and writes
        its outputs (a broadcast's root only reads)."""
        bound = dict((a.name, v) for a, v in _bound(schema, args, kwargs))
        if schema.name.endswith("barrier"):
            return
        root = bound.get("root_rank")
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        for name, value in bound.items():
            tensors = _tensors(value)
            if name.startswith("input"):
                reads.extend(tensors)
            elif name.startswith("output") or name == "tensors":
                (reads if root is not None and root == self.rank and "broadcast" in schema.name
                 else writes).extend(tensors)
        issuer = self._agent()
        with self.lock:
            self.clocks.merge(NCCL, self.clocks.of(issuer))
            self._stamp(reads, writes, [], agent=NCCL)
        if issuer != DEFAULT and WAIT not in issuer:
            # gloo builds some collectives from several calls and copies (runtime/dist/collectives.py);
            # NCCL runs each as one kernel on its stream: the rest of the issue is the collective's
            self.local.in_collective = True

    # -- blocks and the allocator model ------------------------------------------------
    def _block(self, st, agent: str) -> Block:
        key = st.data_ptr()
        renewing = getattr(self.local, "renewing", None)
        if renewing is not None:           # inside a buffer's allocation: its memory is a new block
            block = renewing.get(key)
            if block is None:
                block = renewing[key] = self._new_block(st, agent)
            return block
        entry = self.blocks.get(key)
        if entry is not None and entry[0].cdata == st._cdata and not entry[0].expired():
            return entry[1]
        return self._new_block(st, agent)

    def _new_block(self, st, agent: str, name: str | None = None) -> Block:
        block = Block(agent, name)
        self.blocks[st.data_ptr()] = (StorageWeakRef(st), block)
        return block

    def _alloc(self, alloc, slot):
        """A buffer's allocation: a new block on the allocating stream's pool, whatever memory the
        CPU run reuses for it (a flat buffer's storage, the host pool's blocks). Host memory has
        no stream pools (a pinned block is held back by its copies' events): only a new block."""
        self.local.renewing = {}
        try:
            t = alloc(slot)
        finally:
            renewed, self.local.renewing = self.local.renewing, None
        st = _storage(t)
        if st is not None:
            with self.lock:
                agent = self._agent()
                block = renewed.get(st.data_ptr()) or self._new_block(st, agent)
                block.name = slot.buf.name
                if slot.buf.tier == "device" and agent not in HOST_LANES and WAIT not in agent:
                    self.pools.allocate(agent, self._who())
        return t

    def _release(self, release, slot) -> None:
        if slot.buf.tier != "device" or self.table is None:    # (installed only where there is a table)
            release(slot)
            return
        held = self._held(slot)          # weak references only: the release must be able to free
        self.local.recorded = {}
        try:
            release(slot)
            recorded = self.local.recorded
        finally:
            self.local.recorded = None
        # the runtime gives the memory back here (whatever references a finished collective's
        # work object still holds), unless another live buffer shares it (an activation's input)
        live = {t.untyped_storage()._cdata for s in self.table.slots.values() if s.live
                for t in _slot_tensors(s) if t.untyped_storage().nbytes()}
        with self.lock:
            agent, who = self._agent(), self._who()
            for key, ref, block in held:
                if not ref.expired() and ref.cdata in live:
                    continue
                self.pools.free(Freed(block, who, agent, recorded.get(key, [])))
                if self.blocks.get(key, (None, None))[1] is block:
                    del self.blocks[key]

    def _held(self, slot) -> list:
        held = []
        with self.lock:
            for t in _slot_tensors(slot):
                st = _storage(t)
                if st is not None:
                    block = self._block(st, self._agent())
                    block.name = block.name or slot.buf.name
                    held.append((st.data_ptr(), StorageWeakRef(st), block))
        return held

    def _record_stream(self, t) -> None:
        """buffers.record_current_stream while the checker runs: the freeing stream is recorded on
        the block (its clock now), unless the checker models a free path without it."""
        recorded = getattr(self.local, "recorded", None)
        st = _storage(t) if isinstance(t, torch.Tensor) else None
        if recorded is None or st is None or not self.record_streams:
            return
        with self.lock:
            recorded.setdefault(st.data_ptr(), []).append(self.clocks.snapshot(self._agent()))

    def _name_buffers(self, op: Op) -> None:
        """Name the blocks of the buffers ``op`` touched, for the report."""
        if self.table is None:
            return
        with self.lock:
            for name in op.reads + op.writes:
                slot = self.table.slots.get(name)
                if slot is None or not slot.live:
                    continue
                for t in _slot_tensors(slot):
                    st = _storage(t)
                    if st is None:
                        continue
                    entry = self.blocks.get(st.data_ptr())
                    if entry is not None and entry[0].cdata == st._cdata and entry[1].name is None:
                        entry[1].name = name

    # -- the report ----------------------------------------------------------------------
    def _raise_races(self) -> None:
        root = self.root
        races = self.clocks.races[root.reported:]
        root.reported = len(self.clocks.races)
        if races:
            raise HBRaceError(self.report(races))

    def report(self, races: list[Race]) -> str:
        head = (f"rank {self.rank}: happens-before check: {len(races)} race{'s' if len(races) > 1 else ''} "
                f"in {self.what} {self.step} (ordered as on CUDA: a stream per device lane, NCCL's own stream, "
                f"the caching allocator's pools)")
        lines = [head] + ["  " + describe(race) for race in races[:MAX_REPORTED]]
        if len(races) > MAX_REPORTED:
            lines.append(f"  ... and {len(races) - MAX_REPORTED} more")
        return "\n".join(lines)


def describe(race: Race) -> str:
    """One race, as the report says it."""
    buf = race.block.name or "an unnamed tensor"
    first, second = race.first, race.second
    verb = "writes" if first.write else "reads"
    if race.freed is not None:
        return (f"{buf}: {first.who} {verb} it on {_agent_text(first.agent)}; {race.freed.by} frees it "
                f"{'with' if race.freed.recorded else 'without'} recording {_agent_text(race.freed.agent)} on it, "
                f"back to the pool of {_agent_text(race.block.agent)}, where {second.who} allocates "
                f"before {_agent_text(race.block.agent)} is ordered after that {verb[:-1]}: the block can be reused "
                f"while it is still {'written' if first.write else 'read'}")
    return (f"{buf}: {first.who} {verb} it on {_agent_text(first.agent)} and {second.who} "
            f"{'writes' if second.write else 'reads'} it on {_agent_text(second.agent)}, "
            f"with no stream or event ordering them")


def _agent_text(agent: str) -> str:
    if agent == NCCL:
        return "NCCL's stream"
    if agent == DEFAULT:
        return "the default stream"
    if agent in HOST_LANES:
        return f"the {agent} lane's host thread"
    if WAIT in agent:
        lane, _, op = agent.partition(WAIT)
        return f"the {lane} stream after waiting for op #{op}'s collective"
    return f"the {agent} stream"


def _bound(schema, args, kwargs):
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            yield arg, args[i]
        elif arg.name in kwargs:
            yield arg, kwargs[arg.name]


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage(t):
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    st = t.untyped_storage()
    return st if st.nbytes() else None


def _slot_tensors(slot) -> list:
    rec = slot.record
    return [t for t in (slot.tensor, *((rec.input, rec.output) if rec is not None else ()))
            if isinstance(t, torch.Tensor)]


def streams_for(run_streams, graph: TaskGraph, device: torch.device, what: str):
    """The stream seam of another graph run on the rank state whose run has ``run_streams`` (the
    evaluation's): the run's checker ordering by ``graph`` where the run is checked
    (``ZDSL_HB_CHECK=1``), else CUDA's lane streams of its own, untimed (None on the CPU)."""
    from zdsl.runtime.exec.streams import lane_streams
    if isinstance(run_streams, HBChecker):
        view = run_streams.for_graph(graph, what)
        view.timing = False
        return view
    return lane_streams(graph, device, timing=False)


@contextmanager
def run_streams(graph: TaskGraph, device: torch.device, state, rank: int, timing: bool = True):
    """The executor's stream seam for a run: CUDA's lane streams (None on the CPU), or with
    ``ZDSL_HB_CHECK=1`` on a CPU run the checker, installed for the run's duration."""
    from zdsl.runtime.exec.streams import lane_streams
    if not env.flag("ZDSL_HB_CHECK"):
        yield lane_streams(graph, device, timing)
        return
    if device.type != "cpu":
        raise ValueError(f"rank {rank}: ZDSL_HB_CHECK=1 checks the CUDA path's ordering on a CPU run; this run "
                         f"is on {device}: run it on the CPU (--set device=cpu), or use TORCH_CUDA_SANITIZER=1")
    with HBChecker(graph, state, rank) as checker:
        checker.timing = timing
        yield checker
