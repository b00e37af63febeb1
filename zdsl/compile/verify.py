"""The verifier: a compiled task graph either runs safely on every rank or is rejected here.

Checks, each reported at the .zs statement that caused it:

* **cycles** in deps + lane order (no rank could ever finish the step);
* **buffers**: every read has a producer (persistent model states count as
  produced at the start of the step), nothing is used after its ``free``,
  and every pair of conflicting accesses to a buffer (write/read, read/write,
  write/write, anything/free) is ordered, by lane order or a chain of deps.
  Ops on different lanes with no such chain run in either order: a race;
* **collectives**: each must be ordered before the next one of its group
  (``Op.group``) in graph order (on one lane, or through deps), so every rank
  of the group issues them in the same order. Two collectives of one group
  that could swap places on one rank hang the job; collectives of different
  groups run on different process groups, which need no order between them;
* **memory**: the simulated peak of every tier fits the schedule's
  ``memory`` budget. The error names the tier, the peak, the budget, and
  points at the statement that set the prefetch depth or the placement.

Ordering is decided with vector clocks over the lanes (one pass in
topological order, O(ops x lanes)), so the race checks stay linear.
"""
from __future__ import annotations

from dataclasses import dataclass

from zdsl.ir import ALL, COLLECTIVE_KINDS, LANES, OP_LANES, TaskGraph, parse_group
from zdsl.lang.errors import Diagnostic
from zdsl.lang.sizes import human_bytes
from zdsl.schedule import Schedule, Span
from zdsl.sim.graph_index import CyclicGraphError, index_graph
from zdsl.sim.memory import MemoryTimeline
from zdsl.sim.simulate import Simulation, simulate

STATE_WORDS = {"param_full": "gathered parameters", "param_shard": "parameter shards",
               "param_sec": "secondary parameter shards",
               "grad_full": "unreduced gradients", "grad_shard": "gradient shards",
               "optim": "optimizer state", "act": "activations", "act_inner": "recomputed activations",
               "act_grad": "activation gradients"}


@dataclass
class Finding:
    severity: str               # "error" or "warning"
    message: str
    span: Span | None
    hint: str | None = None


OP_WORDS = {"compute.forward": "forward", "compute.backward": "backward", "compute.recompute": "recompute",
            "compute.norm": "gradient norm", "compute.step": "optimizer step", "comm.all_gather": "all-gather",
            "comm.reduce_scatter": "reduce-scatter", "comm.all_reduce": "all-reduce",
            "copy.h2d": "copy to device", "copy.d2h": "copy to host", "nvme.read": "nvme read",
            "nvme.write": "nvme write", "mem.free": "free"}
BUFFER_WORDS = {"param_full": "gathered parameters", "param_shard": "parameter shard",
                "param_sec": "secondary parameter shard",
                "grad_full": "full gradients", "grad_shard": "gradient shard", "optim": "optimizer state",
                "act": "activations", "act_inner": "recomputed activations", "act_grad": "activation gradients"}


def describe(op) -> str:
    """``forward of unit 3 (op 17, lane compute)``: what a user's statement became."""
    unit = "" if op.unit is None else f" of unit {op.unit}"
    micro = f", micro-batch {op.micro}" if op.micro else ""
    group = f", group {op.group}" if op.is_collective and op.group != ALL else ""
    return f"{OP_WORDS.get(op.kind, op.kind)}{unit} (op {op.id}, lane {op.lane}{micro}{group})"


def plain(name: str) -> str:
    """``param_full[1] (the gathered parameters of unit 1)``."""
    base, _, tier = name.partition("@")
    kind, _, rest = base.partition("[")
    words = BUFFER_WORDS.get(kind)
    if words is None:
        return name
    unit = f" of unit {rest.rstrip(']')}" if rest else ""
    where = f" on {tier}" if tier else ""
    return f"{name} (the {words}{unit}{where})"


class GraphVerifier:
    """The checks above over one task graph; ``run`` appends what it finds to ``findings``
    (the .zs checker, :mod:`zdsl.check.checker`, is the one for schedules)."""

    def __init__(self, graph: TaskGraph, schedule: Schedule):
        self.graph = graph
        self.schedule = schedule
        self.findings: list[Finding] = []

    # -- positions --------------------------------------------------------------
    def op_span(self, op) -> Span | None:
        if op.span is None:
            return self.stmt_span("model")
        return Span(self.schedule.file, op.span[0], op.span[1])

    def stmt_span(self, *keys: str) -> Span | None:
        for key in keys:
            if key in self.schedule.spans:
                return self.schedule.spans[key]
        return None

    def error(self, message: str, span: Span | None, hint: str | None = None) -> None:
        self.findings.append(Finding("error", message, span, hint))

    def warn(self, message: str, span: Span | None, hint: str | None = None) -> None:
        self.findings.append(Finding("warning", message, span, hint))

    # -- structure ----------------------------------------------------------------
    def check_structure(self) -> bool:
        ids = {op.id for op in self.graph.ops}
        ok = len(ids) == len(self.graph.ops)
        if not ok:
            self.error("the task graph has duplicate op ids", self.stmt_span("schedule"))
        for op in self.graph.ops:
            if op.kind not in OP_LANES:
                self.error(f"unknown op kind in {describe(op)}", self.op_span(op))
                ok = False
            if op.lane not in LANES:
                self.error(f"unknown lane {op.lane!r} in {describe(op)}", self.op_span(op),
                           f"lanes are {', '.join(LANES)}")
                ok = False
            if op.kind in COLLECTIVE_KINDS and not self.group_fits(op):
                ok = False
            missing = [d for d in op.deps if d not in ids]
            if missing:
                self.error(f"{describe(op)} depends on op {missing[0]}, which is not in the graph",
                           self.op_span(op))
                ok = False
        return ok

    def group_fits(self, op) -> bool:
        """A collective's group is one of zdsl.ir's and tiles the graph's ranks."""
        try:
            _, size = parse_group(op.group)
        except ValueError as exc:
            self.error(f"{describe(op)}: {exc}", self.op_span(op), "groups are all, within:S and across:S")
            return False
        if size and (size > self.graph.ranks or self.graph.ranks % size):
            self.error(f"{describe(op)} runs over {op.group}, which does not divide the {self.graph.ranks} ranks "
                       f"into groups", self.op_span(op))
            return False
        return True

    def check_cycles(self) -> list[int] | None:
        self.index = index_graph(self.graph)
        deps, lane_prev, order = self.index.deps, self.index.lane_prev, self.index.order
        if isinstance(order, int):
            cycle = cycle_through(order, deps, lane_prev)
            ops = self.graph.ops
            path = " -> ".join(describe(ops[i]) for i in cycle[:6]) + (" -> ..." if len(cycle) > 6 else "")
            self.error(f"dependency cycle (a -> b: a must end before b starts): {path} -> back to "
                       f"the first; no rank could finish the step",
                       self.op_span(ops[cycle[0]]),
                       "an op waits (through deps or its lane's order) for an op that waits for it; "
                       "reorder the statements so each buffer is produced before it is used")
            return None
        self.deps, self.lane_prev, self.order = deps, lane_prev, order
        return order

    # -- happens-before ------------------------------------------------------------
    def lane_positions(self) -> None:
        """Each op's lane (as a small int) and its position within that lane (graph order)."""
        ops = self.graph.ops
        lane_ix: dict[str, int] = {}
        self.lane_of = [lane_ix.setdefault(op.lane, len(lane_ix)) for op in ops]
        count = [0] * len(lane_ix)
        pos = [0] * len(ops)
        for i, lane in enumerate(self.lane_of):
            pos[i] = count[lane]
            count[lane] += 1
        self.pos = pos
        self.lanes = len(lane_ix)
        self.clocks: list[list[int]] | None = None

    def vector_clocks(self) -> list[list[int]]:
        """clock[i][l] = last position on lane l surely finished before op i starts (own lane: its own).

        Built only when a pair of ops is neither on one lane nor linked by a direct
        dep (the compiler derives direct deps for every conflicting pair, so
        usually never)."""
        if self.clocks is None:
            clocks: list[list[int]] = [[] for _ in self.pos]   # each set before read: order is topological
            empty = [-1] * self.lanes
            for i in self.order:
                p = self.lane_prev[i]
                vc = list(clocks[p]) if p >= 0 else list(empty)
                for d in self.deps[i]:
                    vc = [a if a >= b else b for a, b in zip(vc, clocks[d])]
                vc[self.lane_of[i]] = self.pos[i]
                clocks[i] = vc
            self.clocks = clocks
        return self.clocks

    def before(self, a: int, b: int) -> bool:
        """Op a surely ends before op b starts, on every rank (lane order, then deps, transitively)."""
        if a == b:
            return False
        if self.lane_of[a] == self.lane_of[b]:
            return self.pos[a] < self.pos[b]
        if a in self.deps[b]:
            return True
        return self.vector_clocks()[b][self.lane_of[a]] >= self.pos[a]

    # -- buffers --------------------------------------------------------------------
    def check_buffers(self) -> None:
        graph, ops = self.graph, self.graph.ops
        last_write: dict[str, int | None] = {}      # absent = never produced; None = model state at start
        readers: dict[str, list[int]] = {}
        freed_by: dict[str, int] = {}
        reported: set[str] = set()
        for name, buf in graph.buffers.items():
            if buf.persistent or buf.kind == "token":     # model state, or an ordering token
                last_write[name] = None
                readers[name] = []

        def race(name: str, first: int, second: int, what: str) -> None:
            if name in reported:
                return
            reported.add(name)
            a, b = ops[first], ops[second]
            self.error(f"{describe(b)} {what} {plain(name)}, but nothing orders it after {describe(a)}: "
                       f"they run on different lanes with no dependency between them, so on some "
                       f"steps or ranks they run the other way round", self.op_span(b),
                       "the lowering derives deps from reads and writes; a hand-written pipeline "
                       "must issue the producer before its users")

        lane_of, pos, deps, buffers = self.lane_of, self.pos, self.deps, graph.buffers

        def before(a: int, b: int) -> bool:       # self.before, inlined for the hot loop
            if lane_of[a] == lane_of[b]:
                return pos[a] < pos[b]
            return a in deps[b] or self.before(a, b)

        def ordered_after_all(name: str, i: int, what: str) -> None:
            w = last_write.get(name)
            if w is not None and w != i and not before(w, i):
                race(name, w, i, what)
            for r in readers.get(name, ()):
                if r != i and not before(r, i):
                    race(name, r, i, what)

        for i, op in enumerate(ops):
            if op.kind == "mem.free":
                for name in dict.fromkeys((*op.reads, *op.writes)):
                    if name not in graph.buffers:
                        self.error(f"{describe(op)} frees {name}, which the graph does not declare",
                                   self.op_span(op))
                        continue
                    if graph.buffers[name].persistent:
                        self.error(f"{describe(op)} frees {plain(name)}, a model state that must live the "
                                   f"whole step", self.op_span(op),
                                   "free only working buffers (gathered parameters, unreduced gradients)")
                        continue
                    if name in freed_by or name not in last_write:
                        self.warn(f"{describe(op)} frees {plain(name)}, which is not held at this point "
                                  f"({'already freed' if name in freed_by else 'never produced'})",
                                  self.op_span(op))
                        continue
                    ordered_after_all(name, i, "frees")
                    freed_by[name] = i
                    last_write.pop(name)
                    readers.pop(name, None)
                continue
            for name in op.reads:
                if name not in buffers:
                    self.error(f"{describe(op)} reads {name}, which the graph does not declare",
                               self.op_span(op))
                    continue
                if name in freed_by and name not in last_write:
                    f = ops[freed_by[name]]
                    at = f" at line {f.span[0]}" if f.span else ""
                    self.error(f"{describe(op)} uses {plain(name)} after it was freed by {describe(f)}{at}",
                               self.op_span(op),
                               "move the `free` after the buffer's last use, "
                               "or gather/copy/read it again before this statement")
                    reported.add(name)
                    continue
                if name not in last_write:
                    if name not in reported:
                        reported.add(name)
                        self.error(f"{describe(op)} reads {plain(name)}, but no earlier op produces it",
                                   self.op_span(op),
                                   "gather, copy or read it before this statement (index offsets are "
                                   "clipped at the model's ends)")
                    continue
                w = last_write[name]
                if w is not None and w != i and not before(w, i):
                    race(name, w, i, "reads")
                readers.setdefault(name, []).append(i)
            for name in op.writes:
                if name not in buffers:
                    self.error(f"{describe(op)} writes {name}, which the graph does not declare",
                               self.op_span(op))
                    continue
                if name in last_write:
                    ordered_after_all(name, i, "writes")
                last_write[name] = i
                readers[name] = [i] if name in op.reads else []
                freed_by.pop(name, None)

    # -- collectives -------------------------------------------------------------------
    def check_collectives(self) -> None:
        """One issue order per group: each collective before the next of its group."""
        ops = self.graph.ops
        by_group: dict[str, list[int]] = {}
        for i, op in enumerate(ops):
            if op.kind in COLLECTIVE_KINDS:
                by_group.setdefault(op.group, []).append(i)
        for group, coll in by_group.items():
            for a, b in zip(coll, coll[1:]):
                if not self.before(a, b):
                    where = "" if group == ALL else f" of group {group}"
                    self.error(f"collective {describe(ops[b])} may be issued before {describe(ops[a])}{where}: "
                               f"they are on lanes {ops[b].lane} and {ops[a].lane} with no dependency "
                               f"between them, so ranks could issue them in different orders and hang",
                               self.op_span(ops[b]),
                               "put every collective on the comm lane, or make each depend on the previous one")
                    return

    # -- memory ---------------------------------------------------------------------------
    def check_memory(self, sim: Simulation) -> None:
        mem = sim.memory
        for tier, budget in sorted((self.schedule.memory or {}).items()):   # the checker's tier names
            peak = mem.peak(tier)
            states = mem.states.get(tier, {})
            model = sum(states.values())
            working = peak - model
            if peak > budget:
                span, hint, cause = self.blame(mem, tier, model, working)
                split = ", ".join(f"{k} {human_bytes(v)}" for k, v in states.items() if v)
                self.error(f"peak {tier} memory {human_bytes(peak)} exceeds the budget of {human_bytes(budget)}"
                           f"{self.budget_where(tier)}: model states {human_bytes(model)}"
                           f"{' (' + split + ')' if split else ''}, working buffers {human_bytes(working)}"
                           f"{cause}", span, hint)
            elif peak == 0:
                self.warn(f"the {tier} memory budget of {human_bytes(budget)} is never reached: "
                          f"this schedule places nothing on {tier}", self.stmt_span(f"memory.{tier}", "memory"))

    def budget_of(self, tier: str) -> int:
        return (self.schedule.memory or {}).get(tier, 0)

    def budget_where(self, tier: str) -> str:
        span = self.stmt_span(f"memory.{tier}", "memory")
        if span is None:
            return ""
        return f" (set at line {span.line})" if span.file == self.schedule.file else \
            f" (set at {span.file}:{span.line})"

    def blame(self, mem: MemoryTimeline, tier: str, model: int, working: int) -> tuple[Span | None, str, str]:
        """The statement that made ``tier`` too full: prefetch depth or a placement."""
        live = mem.live_at_peak(tier) if working > 0 else []
        kinds: dict[str, int] = {}
        for iv in live:
            kind = iv.buffer.split("[", 1)[0].split("@", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + iv.bytes
        top = max(kinds, key=lambda k: kinds[k]) if kinds else None
        cause = ""
        if top:
            units = sorted({iv.buffer for iv in live
                            if iv.buffer.split("[", 1)[0].split("@", 1)[0] == top},
                           key=lambda name: (len(name), name))
            shown = ", ".join(units[:4]) + (", ..." if len(units) > 4 else "")
            cause = f"; at the peak it holds mostly {STATE_WORDS.get(top, top)} ({shown})"
        gathered = sorted((iv.bytes for iv in live if iv.buffer.startswith("param_full")), reverse=True)
        relief = sum(gathered[1:])      # what prefetching less could give back: all but the unit computing
        excess = model + working - self.budget_of(tier)
        if gathered and relief >= excess and self.stmt_span("prefetch"):
            return (self.stmt_span("prefetch"),
                    f"prefetch fewer units ahead (now {self.schedule.prefetch}): the units gathered "
                    f"ahead hold {human_bytes(relief)} at the peak", cause)
        if tier == "device" and working >= model and top in ("act", "act_inner", "act_grad"):
            span = self.stmt_span("recompute", "train", "prefetch", "memory")
            return span, "recompute more units (recompute blocks) or lower the batch", cause
        # model states (or unattributed working memory): the placement of the biggest state here
        states = mem.states.get(tier, {})
        for state in sorted(states, key=lambda s: -states[s]):
            if states[state] and (span := self.stmt_span(f"offload.{state}")):
                other = "nvme" if tier == "host" else "cpu"
                return span, f"offload {state} -> {other}, or raise the {tier} budget", cause
        if tier == "device":
            span = self.stmt_span("zero", "shard", "prefetch", "memory", "model", "schedule")
            return span, "shard more state (zero 3) or offload optimizer -> cpu", cause
        span = self.stmt_span("memory", "model", "schedule")
        return span, f"move state off {tier}, or raise the {tier} budget", cause

    def run(self, sim: Simulation | None, want_sim: bool = True) -> Simulation | None:
        """All checks; simulates (for the memory budgets) when given no ``sim`` and
        budgets are set or ``want_sim``. Returns the simulation, if any."""
        self.want_sim = want_sim
        if not self.check_structure():
            return None
        if self.check_cycles() is None:
            return None
        self.lane_positions()
        self.check_buffers()
        self.check_collectives()
        try:
            if sim is None and (self.schedule.memory or self.want_sim):
                sim = simulate(self.graph, self.schedule.machine, self.index)
        except CyclicGraphError:            # already reported
            return None
        if sim is not None:
            self.check_memory(sim)
        return sim


def cycle_through(i: int, deps: list[list[int]], lane_prev: list[int]) -> list[int]:
    """The ops of one cycle through op position ``i``, in dependency order."""
    preds = lambda j: [p for p in (*deps[j], lane_prev[j]) if p >= 0]  # noqa: E731
    # breadth-first back from i until we return to i
    parent: dict[int, int | None] = {i: None}
    frontier = [i]
    while frontier:
        nxt = []
        for j in frontier:
            for p in preds(j):
                if p == i:
                    path, back = [j], parent[j]
                    while back is not None:
                        path.append(back)
                        back = parent[back]
                    return [i] + path[:-1]  # i before j before parent[j] ... before i
                if p not in parent:
                    parent[p] = j
                    nxt.append(p)
        frontier = nxt
    return [i]


def findings(graph: TaskGraph, schedule: Schedule, sim: Simulation | None = None,
             want_sim: bool = True) -> tuple[list[Finding], Simulation | None]:
    """All findings and the simulation the memory check used (reusable by the planner);
    ``want_sim=False`` skips simulating when no budget needs it (``zdsl check``)."""
    verifier = GraphVerifier(graph, schedule)
    sim = verifier.run(sim, want_sim)
    return merge_repeats(verifier.findings), sim


def merge_repeats(found: list[Finding]) -> list[Finding]:
    """One finding per statement and kind of problem: a template statement is instantiated
    for every unit, and its mistake should be reported once, not once per unit."""
    first: dict[tuple, Finding] = {}
    extra: dict[tuple, int] = {}
    out = []
    for f in found:
        key = (f.severity, f.span, f.hint)
        if f.span is not None and key in first:
            extra[key] = extra.get(key, 0) + 1
            continue
        first[key] = f
        out.append(f)
    for key, n in extra.items():
        f = first[key]
        f.message += f" (and {n} more like it from this statement)"
    return out


def verify(graph: TaskGraph, schedule: Schedule, sim: Simulation | None = None) -> list[Diagnostic]:
    """Diagnostics (errors and warnings) for ``graph`` compiled from ``schedule``; empty = safe."""
    found, _ = findings(graph, schedule, sim)
    return [to_diagnostic(f) for f in found]


def to_diagnostic(f: Finding) -> Diagnostic:
    return Diagnostic(severity=f.severity, message=f.message, span=f.span, hint=f.hint)
