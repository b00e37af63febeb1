"""List scheduling of one step's task graph over the lanes of a device.

Every rank runs the same graph, so one rank's timeline is the prediction for
all. Each lane runs its ops in graph order; an op starts once its lane is free
and every op it depends on has ended. Durations come from the schedule's
machine profile (see :func:`op_duration`). The result is what ``zdsl plan``
reports: the predicted step time, per-op start and end, each lane's busy
seconds, the critical path and the memory held per tier over time.

Without shared cores, linear in ops + deps (one pass in topological order over
flat lists; numpy would cost more to import than the whole pass); with them, an
event loop over op completions (benchmarks/compile_speed.py times it).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from zdsl.ir import DTYPE_BYTES, LANES, TaskGraph, crosses_nodes, group_size
from zdsl.machine_profile import Link, MachineProfile
from zdsl.sim.graph_index import CyclicGraphError, GraphIndex, index_graph
from zdsl.sim.lanes import lane_slots, shared_memory_group, union_length
from zdsl.sim.memory import MemoryTimeline, memory_timeline
from zdsl.sim.rates import device_flops, disk_drives, for_graph


@dataclass
class Simulation:
    step_s: float                       # predicted step time (makespan)
    start: list[float]                  # per op (graph position), seconds from step start
    end: list[float]
    duration: list[float]
    lane_busy: dict[str, float]         # seconds each lane is busy
    critical_path: list[int]            # op positions, first to last, that set the step time
    bound_s: float                      # lower bound: max(busiest lane, longest dependency chain)
    memory: MemoryTimeline              # bytes per tier over time (model states + working)
    order: list[int] = field(default_factory=list)  # topological order used

    @property
    def overlap_efficiency(self) -> float:
        """How close the schedule is to its lower bound (1.0 = perfect overlap)."""
        return self.bound_s / self.step_s if self.step_s > 0 else 1.0


def collective_payload(graph: TaskGraph, op) -> int:
    """Bytes of the full (unsharded) tensor a collective moves, for one part.

    ``op.bytes`` when the lowering set it; else the largest full buffer it
    touches divided by its bucket parts.
    """
    if op.bytes:
        return op.bytes
    sizes = [graph.buffers[n].bytes for n in (*op.reads, *op.writes) if n in graph.buffers]
    return (max(sizes) // max(op.parts, 1)) if sizes else 0


def touched_bytes(graph: TaskGraph, op, kind: str) -> int:
    return sum(graph.buffers[n].bytes for n in set(op.reads) | set(op.writes)
               if n in graph.buffers and graph.buffers[n].kind == kind)


def op_duration(graph: TaskGraph, op, machine: MachineProfile) -> float:
    """Seconds one op takes on ``machine`` (the cost model): its rate-based time plus its
    fixed cost (:func:`op_fixed`)."""
    return rated_duration(graph, op, machine) + op_fixed(op, machine)


def rated_durations(graph: TaskGraph, machine: MachineProfile) -> list[float]:
    """:func:`rated_duration` of every op, the profile resolved once for the graph's shape."""
    machine = for_graph(machine, graph)
    unit_flops = device_flops(graph, machine)
    return [rated_duration(graph, op, machine, unit_flops, resolved=True) for op in graph.ops]


def op_fixed(op, machine: MachineProfile) -> float:
    """Fixed seconds per executed op: dispatch, thread hand-off, completion polling.

    Rates alone price a tiny op at microseconds, but the runtime pays a roughly
    constant cost to start and finish each op, which dominates small models: on
    CPU a worker thread's hand-off and wake-up for an op run in a lane's thread
    (``overhead``), and for a collective its watcher's wake-up and the wait for
    the peer that arrives last (``comm_overhead``, else ``overhead``); a
    reduce-scatter, whose reduction runs on the backend's threads beside the
    backward it overlaps, its own (``scatter_overhead``, else ``comm_overhead``).
    A compute op also pays ``kernel_overhead`` for each kernel it dispatches
    (``op.kernels``): eager PyTorch's cost per aten op, which makes a unit of
    many small ops slower than its flops say. A ``mem.free`` costs the
    runtime's event loop its CPU per op (``loop``): the loop wakes each op's
    task and keeps its books, a free's as any other's, and a free is nothing
    more (benchmarks/executor_overhead.py). 0 unless the profile sets them
    (``zdsl calibrate`` measures them).
    """
    costs = machine.costs
    if op.kind == "mem.free":
        return costs.loop
    if op.kernels:
        return costs.op + op.kernels * costs.kernel
    if op.kind == "comm.reduce_scatter":
        return costs.scatter_fixed
    if op.kind.startswith("comm."):
        return costs.comm_fixed
    return costs.op


# The ops priced by their flops at their unit's rate (and lengthened by ``compute_excess``).
UNIT_COMPUTE_KINDS = ("compute.forward", "compute.backward", "compute.recompute")


def rated_duration(graph: TaskGraph, op, machine: MachineProfile, unit_flops: list[float] | None = None,
                   resolved: bool = False) -> float:
    """Seconds one op takes from the machine's rates alone, at the graph's shape
    (zdsl.sim.rates: the compute rate of its precision at its unit's width, the disk's at its
    ranks); a collective a ring over its group's ranks (``op.group``) on its level's link: the
    cluster's where the group spans nodes (``machine.collectives.level``). ``unit_flops`` and
    ``resolved``: that done already (:func:`rated_durations`)."""
    n = graph.ranks
    kind = op.kind
    host = op.lane == "host"
    if not resolved:
        machine = for_graph(machine, graph)
    compute, disk = machine.compute, machine.disk
    if kind in UNIT_COMPUTE_KINDS:
        if host:
            rate = compute.host_flops
        else:
            rates = unit_flops if unit_flops is not None else device_flops(graph, machine)
            rate = rates[op.unit] if op.unit is not None and op.unit < len(rates) else compute.flops
        # the runtime's compute runs slower than calibrate's bare block does (``compute_excess``)
        return op.flops / rate * (1.0 + machine.costs.compute_excess)
    if kind == "compute.norm":
        if op.flops:
            return op.flops / (compute.host_flops if host else compute.flops) + upcast_seconds(graph, op, machine)
        return (op.bytes or touched_bytes(graph, op, "grad_full") + touched_bytes(graph, op, "grad_shard")) \
            / compute.memory_bandwidth
    if kind == "compute.step":
        optimizer_bytes = op.bytes or touched_bytes(graph, op, "optim")
        return optimizer_bytes / (compute.host_memory if host else compute.memory_bandwidth)
    if kind.startswith("comm."):
        size = group_size(op.group, n)
        if size == 1:
            return single_rank_collective_seconds(kind, collective_payload(graph, op), machine)
        link = machine.collectives.level(crosses_nodes(op.group, n, graph.per_node))
        return collective_seconds(kind, collective_payload(graph, op) * (size - 1) / size, link)
    if kind in ("copy.h2d", "copy.d2h"):
        return op.bytes / machine.copies.pcie_bandwidth
    if kind == "nvme.read":     # striped over several drives: their rates add up
        return disk.read_latency + op.bytes / (disk.read * disk_drives(graph, op))
    if kind == "nvme.write":
        return disk.write_latency + op.bytes / (disk.write * disk_drives(graph, op))
    return 0.0                              # mem.free: bookkeeping


def upcast_seconds(graph: TaskGraph, op, machine: MachineProfile) -> float:
    """A norm's copy of the bf16/fp16 gradients it reads into fp32 where a CPU reduces them: the
    runtime upcasts such a tensor into an fp32 block of the host pool and then reduces that
    (``upcast_on_host``), so the fp32 bytes are copied at the host's copy rate (``pcie``, calibrate's
    memcpy, on a cpu machine) before the reduction the flops price. A CUDA device reduces its own
    gradients in fp32 as it reads them: nothing to copy. In a large bf16 model the upcasts are
    most of the norm's time (benchmarks/capacity.py sets the plan against the run per op kind)."""
    elements = 0
    for name in op.reads:
        buf = graph.buffers.get(name)
        if buf is not None and buf.dtype != "fp32" and (machine.name == "cpu" or buf.tier != "device"):
            elements += buf.bytes // DTYPE_BYTES[buf.dtype]
    return elements * DTYPE_BYTES["fp32"] / host_copy_rate(machine) if elements else 0.0


def host_copy_rate(machine: MachineProfile) -> float:
    """Bytes a second a memory copy on the host moves: calibrate's memcpy (``pcie``) on a cpu
    machine; on CUDA, where ``pcie`` is the link to the device, the host's memory rate."""
    if machine.name == "cpu":
        return machine.copies.pcie_bandwidth
    return machine.compute.host_memory


def collective_seconds(kind: str, wire_bytes: float, link: Link) -> float:
    """``latency + wire / bandwidth`` with ``link``'s rates for this kind of collective.

    ``link``/``latency`` are the all-gather's; a reduce-scatter and an all-reduce have their own
    where the profile gives them (on gloo the runtime reduce-scatters with an all-reduce, so
    ``zdsl calibrate`` measures each), else a reduce-scatter costs an all-gather and an
    all-reduce a ring's reduce-scatter then all-gather.
    """
    gather = link.latency + wire_bytes / link.bandwidth
    scatter_latency, scatter_bandwidth = link.scatter
    scatter = scatter_latency + wire_bytes / scatter_bandwidth
    if kind == "comm.reduce_scatter":
        return scatter
    if kind == "comm.all_reduce":
        if link.reduce is not None:
            reduce_latency, reduce_bandwidth = link.reduce
            return reduce_latency + wire_bytes / reduce_bandwidth
        return scatter + gather
    return gather


def single_rank_collective_seconds(kind: str, payload: float, machine: MachineProfile) -> float:
    """A collective of one rank: nothing on the wire, but an all-gather copies its shard into the
    full buffer and a reduce-scatter the full gradient into its shard (the runtime's, gloo's and
    NCCL's alike), a memory copy of the payload (``pcie``: calibrate's memcpy rate on a cpu
    machine; the device's ``memory_bw`` on cuda). An all-reduce sums in place: nothing to move."""
    if kind == "comm.all_reduce":
        return 0.0
    return payload / (machine.copies.pcie_bandwidth if machine.name == "cpu" else machine.compute.memory_bandwidth)


def cpu_demand(op, machine: MachineProfile) -> float:
    """Cores of its rank's share an op keeps busy while it runs (the sharing model's weight).

    On a ``cpu`` machine every lane runs on the host: compute and the optimizer step use
    all of torch's threads (the whole share), a gloo collective or a memcpy one thread.
    On ``cuda`` only host work competes: the host optimizer step and the swapper.
    A disk transfer keeps the cores :func:`transfer_demand` says busy on either: the swapper's
    threads' system calls and the checksum of every block.
    """
    kind = op.kind
    cores = machine.costs.shared_cores
    on_host = machine.name == "cpu" or op.lane == "host"
    if kind.startswith("compute."):
        return cores if on_host else 0.0
    if kind.startswith(("comm.", "copy.")):
        return min(1.0, cores) if machine.name == "cpu" else 0.0
    if kind == "nvme.read":
        return transfer_demand(machine.disk.read_cpu, machine)
    if kind == "nvme.write":
        return transfer_demand(machine.disk.write_cpu, machine)
    return 0.0


def transfer_demand(share: float, machine: MachineProfile) -> float:
    """Cores a disk transfer keeps busy, from ``share`` (``disk_read_cpu``/``disk_write_cpu``):
    the part of compute's rate a transfer beside it took in calibrate, ``1 - alone / beside`` on
    a rank's core. Where transfers take their share first (:func:`takes_share_first`) that is
    their demand; where they share a core fairly, compute beside one took ``1 / (1 - share)`` its
    time alone, which a fair share of ``share / (1 - share)`` cores gives (at most the rank's
    cores)."""
    if share <= 0 or takes_share_first(machine):
        return share
    cores = machine.costs.shared_cores
    return min(float(cores), share / (1.0 - share)) if share < 1.0 else float(cores)


def takes_share_first(machine: MachineProfile) -> bool:
    """Whether disk transfers get their share of a rank's cores before the others divide the
    rest: where it has more than one, since its compute threads leave a core between kernels
    and the scheduler runs a waking swapper thread there (a transfer beside compute keeps its
    rate). On one core they queue behind the compute thread and share it fairly: there a
    transfer beside compute takes longer than alone, which a share taken first would price at
    its rate alone (benchmarks/prediction_error.py: programs/nvme.zs, a core per rank)."""
    return machine.costs.shared_cores > 1


def under_load(graph: TaskGraph, op, machine: MachineProfile) -> float:
    """The share of its rate a collective keeps while its rank's cores are full, or 0 where it
    shares them like other work (``comm_under_load``; cpu machines, more than one rank).

    Fair shares fit the compute lane and the host step, not gloo's threads: they wake for each
    message and, with compute filling the cores, wait for one, while taking next to nothing from
    the compute: beside a backward, a reduce-scatter slows far more than the backward does. So
    such a collective's transfer takes no share and moves in what the
    others leave idle, at least at ``comm_under_load`` of its rate (while the cores are full); its
    fixed part, the runtime issuing it and taking its completion, takes its share as any op's.
    A collective through shared memory (:func:`through_shared_memory`) is a worker thread's
    copies and sums: it takes its fair share as a copy does (taking none, the backward beside it
    was planned short and the collective far too long).
    A collective of one rank waits for no message: it is a memory copy on the rank's own thread
    (:func:`single_rank_collective_seconds`) and takes its share like the lanes' other copies
    (at ``comm_under_load`` it was planned far too long; benchmarks/capacity.py, one rank)."""
    under = machine.collectives.under_load
    if (graph.ranks > 1 and under and machine.name == "cpu" and op.kind.startswith("comm.")
            and not through_shared_memory(graph, op, on_host=True)):
        return under
    return 0.0


def through_shared_memory(graph: TaskGraph, op, on_host: bool) -> bool:
    """Whether the runtime runs this collective through shared memory: its group's
    (:func:`shared_memory_group`)."""
    return op.kind.startswith("comm.") and shared_memory_group(graph, op.group, on_host)


def wake_after(graph: TaskGraph, machine: MachineProfile) -> list[float]:
    """Per op, the seconds between the end of an input made on another lane and the op's start
    (``wake_latency``): the lane that made it posts its completion to the runtime's event loop,
    which wakes the waiting lane's task (a collective is issued, a free done, there) and hands a
    lane op to the lane's thread. Ops of one lane that are ready in turn run back to back with
    no such hop, so a schedule whose inputs are ready early (a deeper prefetch) pays it less
    often than one that waits on each (prefetch 0: every gather, every compute after it)."""
    return [machine.costs.wake] * len(graph.ops)


def simulate(graph: TaskGraph, machine: MachineProfile | None = None,
             index: GraphIndex | None = None) -> Simulation:
    """Predict one step of ``graph`` on ``machine`` (default: the graph's own profile).

    With ``machine.costs.cores`` set, lanes running at once share the rank's cores: while the
    running ops' demand (:func:`cpu_demand`) exceeds ``cores``, each op that needs a core
    progresses at ``cores / demand`` of its rate (the OS's fair share). Without it, lanes
    are independent (a GPU's streams, or a host with cores to spare).
    """
    if machine is None:
        machine = machine_of(graph)
    machine = for_graph(machine, graph)     # the cores and disk of the schedule's ranks
    rated = rated_durations(graph, machine)
    fixed = [op_fixed(op, machine) for op in graph.ops]
    index = index or index_graph(graph)
    deps, lane_prev, order = index.deps, index.lane_prev, index.order
    if isinstance(order, int):
        raise CyclicGraphError(order)
    slots = lane_slots(graph, machine)
    wake = wake_after(graph, machine)
    if machine.costs.shared_cores > 0:
        # The fixed cost per op is the host's work of running it (Python dispatch, a thread's
        # wake-up, a collective's completion): one thread's worth, shared like the rest, since
        # on one core per rank the lanes' host work only adds up.
        demands = op_demands(graph, machine, fixed, rated, wake)
        start, end, gate = _shared_schedule(graph, demands, deps, machine.costs.shared_cores, slots)
        dur = [e - s for s, e in zip(start, end)]
    else:
        dur = [r + f for r, f in zip(rated, fixed)]
        start, end, gate = _independent_schedule(graph, dur, deps, lane_prev, order, slots, wake)
    n = len(graph.ops)
    binding = [-1] * n          # the predecessor that made the op wait (ended last)
    chain = [0.0] * n           # longest dependency chain ending here (no lane contention)
    ops = graph.ops
    for i in order:
        b, t, c = -1, -1.0, 0.0
        p = gate[i]
        if p >= 0:
            b, t = p, end[p]
        for d in deps[i]:
            e = end[d] + (wake[i] if ops[d].lane != ops[i].lane else 0.0)
            if e > t:
                b, t = d, e
            if chain[d] > c:
                c = chain[d]
        binding[i] = b
        chain[i] = c + dur[i]
    step_s = max(end, default=0.0)
    lane_busy: dict[str, float] = {}
    for op, d in zip(graph.ops, dur):
        lane_busy[op.lane] = lane_busy.get(op.lane, 0.0) + d
    for lane in slots:                  # ops that ran at once count once: the time it had one running
        if lane in lane_busy:
            lane_busy[lane] = union_length([(start[i], end[i]) for i, op in enumerate(graph.ops) if op.lane == lane])
    lane_busy = {lane: lane_busy[lane] for lane in (*LANES, *sorted(set(lane_busy) - set(LANES)))
                 if lane in lane_busy}
    critical = []
    i = end.index(step_s) if n else -1
    while i >= 0:
        critical.append(i)
        i = binding[i]
    critical.reverse()
    bound = max([*lane_busy.values(), max(chain, default=0.0), 0.0])
    return Simulation(step_s=step_s, start=start, end=end, duration=dur, lane_busy=lane_busy,
                      critical_path=critical, bound_s=bound,
                      memory=memory_timeline(graph, start, end), order=order)


def _independent_schedule(graph: TaskGraph, dur, deps, lane_prev, order, slots: dict[str, int], wake=None):
    """Start and end per op when lanes never slow each other: one pass in topological order.
    Also each op's lane gate (-1: none): the lane op whose end let it start, the one before it,
    or on a lane that runs k at once the k-th latest end before it (starts stay in order).
    ``wake[i]``: seconds op i starts after an input made on another lane ended."""
    n = len(dur)
    ops = graph.ops
    wake = wake or [0.0] * n
    start, end, gate = [0.0] * n, [0.0] * n, [-1] * n
    recent: dict[str, list[tuple[float, int]]] = {lane: [] for lane in slots}   # the k latest ends (a heap)
    for i in order:
        p = lane_prev[i]
        lane = graph.ops[i].lane
        k = slots.get(lane, 1)
        if k == 1:
            t = end[p] if p >= 0 else 0.0
            gate[i] = p
        else:
            heap = recent[lane]
            t = start[p] if p >= 0 else 0.0
            if len(heap) == k:
                t, gate[i] = max(t, heap[0][0]), heap[0][1]
        for d in deps[i]:
            e = end[d] + (wake[i] if ops[d].lane != lane else 0.0)
            if e > t:
                t = e
        start[i] = t
        end[i] = t + dur[i]
        if k > 1:
            heapq.heappush(recent[lane], (end[i], i))
            if len(recent[lane]) > k:
                heapq.heappop(recent[lane])
    return start, end, gate


@dataclass
class OpDemands:
    """What each op asks of its rank while it runs, one list per input of the core-sharing
    model, indexed by graph position (lists: the event loop reads them per op per event)."""
    fixed: list[float]        # seconds of host work first, one thread's (:func:`op_fixed`)
    work: list[float]         # seconds of its rated work alone (:func:`rated_duration`)
    work_cores: list[float]   # cores its work keeps busy (:func:`cpu_demand`)
    under: list[float]        # its share of its rate while the cores are full; 0: a fair share (:func:`under_load`)
    first: list[bool]         # a disk transfer that takes its share before the others (:func:`takes_share_first`)
    wake: list[float]         # seconds it starts after an input made on another lane ended (:func:`wake_after`)
    some_first: bool = field(init=False)   # any op takes its share first (none does on one core)

    def __post_init__(self) -> None:
        self.some_first = any(self.first)


def op_demands(graph: TaskGraph, machine: MachineProfile, fixed: list[float], work: list[float],
               wake: list[float]) -> OpDemands:
    """Each op's demands on ``machine`` (resolved for the graph's shape). Ops of one kind on one
    lane keep as many cores busy (:func:`cpu_demand`), and ops of one kind over one group keep
    as much of their rate under load (:func:`under_load`): each is worked out once per key."""
    share_first = takes_share_first(machine)
    ops = graph.ops
    by_lane = {(op.kind, op.lane): op for op in ops}       # one op of each kind on each lane
    by_group = {(op.kind, op.group): op for op in ops}     # one op of each kind over each group
    lane_cores = {key: cpu_demand(op, machine) for key, op in by_lane.items()}
    group_under = {key: under_load(graph, op, machine) for key, op in by_group.items()}
    kind_first = {kind: share_first and kind.startswith("nvme.") for kind, _ in by_lane}
    work_cores = [lane_cores[op.kind, op.lane] for op in ops]
    under = [group_under[op.kind, op.group] for op in ops]
    first = [kind_first[op.kind] for op in ops]
    return OpDemands(fixed, work, work_cores, under, first, wake)


def _shared_schedule(graph: TaskGraph, demands: OpDemands, deps, cores: float, slots: dict[str, int]):
    """Start and end per op when running ops share ``cores``: an event loop over op
    completions; between two events every running op progresses at a fixed rate. An op
    first spends its ``fixed`` seconds (one thread of host work), then its ``work`` seconds
    (``work_cores`` busy); each takes that long alone and is slowed by the share while the
    running ops' demand exceeds ``cores`` (:func:`_share_rates`). A lane runs one op at a time,
    or ``slots[lane]``, started in lane order; an op starts no sooner than its ``wake`` after an
    input made on another lane ended (waiting, no share). Also returns each op's lane gate (see
    _independent_schedule)."""
    n = len(graph.ops)
    ops = graph.ops
    ready_at = [0.0] * n                     # no start before: the latest input from another lane + wake
    lanes: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        lanes.setdefault(op.lane, []).append(i)
    queues = list(lanes.values())
    capacity = [slots.get(lane, 1) for lane in lanes]
    head = [0] * len(queues)                 # next op to start, per lane
    ended: list[list[int]] = [[] for _ in queues]   # per lane, its ops in the order they ended
    waiting = [len(ds) for ds in deps]       # unfinished deps per op
    succ: list[list[int]] = [[] for _ in range(n)]
    for i, ds in enumerate(deps):
        for d in ds:
            succ[d].append(i)
    start, end, gate = [0.0] * n, [0.0] * n, [-1] * n
    fixed, work, wake_of = demands.fixed, demands.work, demands.wake
    fixed_left, work_left = list(fixed), list(work)
    fixed_demand = min(1.0, cores)           # a fixed part is one thread's work
    running: dict[int, int] = {}             # op running -> its lane queue
    busy = [0] * len(queues)                 # ops running per lane
    t, done = 0.0, 0
    while done < n:
        woken = math.inf                     # the earliest wake-up a lane's next op waits for
        for q, queue in enumerate(queues):
            while busy[q] < capacity[q] and head[q] < len(queue) and waiting[queue[head[q]]] == 0:
                i = queue[head[q]]
                if ready_at[i] > t + 1e-12:
                    woken = min(woken, ready_at[i])
                    break
                # the k-th latest end among the lane's earlier ops, as _independent_schedule's
                free = capacity[q] - busy[q]
                gate[i] = ended[q][-free] if len(ended[q]) >= free else -1
                head[q] += 1
                busy[q] += 1
                running[i] = q
                start[i] = t
        if not running:
            if woken < math.inf:             # nothing runs until a lane wakes
                t = woken
                continue
            raise CyclicGraphError(next(i for i in range(n) if waiting[i] > 0))
        rate = _share_rates(running, fixed_left, demands, cores, fixed_demand)
        # the next event: an op leaves its fixed part (and starts competing), or ends
        dt = min((fixed_left[i] if fixed_left[i] > 0 else work_left[i]) / rate[i] for i in running if rate[i] > 0)
        dt = min(dt, woken - t)
        t += dt
        for i, q in list(running.items()):
            if fixed_left[i] > 0:
                fixed_left[i] -= dt * rate[i]
                if fixed_left[i] <= 1e-12 * (1.0 + fixed[i]):
                    fixed_left[i] = 0.0
            else:
                work_left[i] -= dt * rate[i]
            if fixed_left[i] == 0.0 and work_left[i] <= 1e-12 * (1.0 + work[i]):
                end[i] = t
                del running[i]
                busy[q] -= 1
                ended[q].append(i)
                done += 1
                for s_ in succ[i]:
                    waiting[s_] -= 1
                    wake = wake_of[s_]
                    if wake and ops[s_].lane != ops[i].lane and t + wake > ready_at[s_]:
                        ready_at[s_] = t + wake
    return start, end, gate


def _share_rates(running: dict[int, int], fixed_left: list[float], demands: OpDemands,
                 cores: float, fixed_demand: float) -> dict[int, float]:
    """Per running op, the share of its rate it moves at until the next event. A fixed part is
    the host's own work (a collective's issue and completion too): it takes one thread's share.
    An op with ``under`` takes no share for its work and moves in what the others leave idle, at
    least at ``under`` of its rate; one with ``first`` takes its share before the others divide
    what is left; the rest share the cores fairly. ``fixed_demand``: a fixed part's demand."""
    work_cores, under, first = demands.work_cores, demands.under, demands.first
    need = {i: (0.0 if under[i] else work_cores[i]) if fixed_left[i] == 0.0 else fixed_demand
            for i in running}
    load = sum(need.values())
    # disk transfers past their fixed part take their share first; the others share the rest
    claiming = {i for i in running if first[i] and fixed_left[i] == 0.0} if demands.some_first else ()
    claim = sum(need[i] for i in claiming) if claiming else 0
    room, rest = max(0.0, cores - claim), load - claim
    slow = room / rest if rest > room else 1.0
    idle = max(0.0, cores - load)
    rate = {}
    for i in running:
        if i in claiming:
            rate[i] = min(1.0, cores / claim) if need[i] > 0 else 1.0
        elif need[i] > 0:
            rate[i] = slow
        elif under[i]:
            rate[i] = max(under[i], min(1.0, idle / work_cores[i]))
        else:
            rate[i] = 1.0
    return rate


def machine_of(graph: TaskGraph) -> MachineProfile:
    """The machine profile carried in the graph's config (the schedule's ``machine``), else defaults."""
    return MachineProfile.of_config(graph.config)
