"""What ``zdsl plan`` shows: one :class:`Plan` per schedule, as a table or as JSON.

The plan gathers the planner's three answers (memory per tier, communication
per step, the simulated step) with the ZeRO paper's formula beside the model
states, so a user can check the compiler against the numbers they know.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from functools import cached_property

from rich.console import Console
from rich.table import Table

from zdsl.ir import LANES, TIERS, TaskGraph, group_size, parse_buffer_name
from zdsl.lang.sizes import human_bytes
from zdsl.planner.bound import worst_working
from zdsl.planner.comm import CommPlan, comm_plan, zero_comm_elements
from zdsl.planner.freeze_plan import FreezePlan, freeze_plan
from zdsl.planner.levels import bytes_by_level, hierarchy_json, hierarchy_lines, level_lines
from zdsl.planner.state_fit import largest_model, largest_model_line
from zdsl.planner.traffic import traffic_json
from zdsl.schedule import Schedule, nvme_placements
from zdsl.sim.memory import STATES, zero_model_states
from zdsl.sim.profile_cache import calibrated_source, rates_line
from zdsl.sim.rates import drives, nvme_lines
from zdsl.sim.rates import gaps as rate_gaps
from zdsl.sim.simulate import Simulation, simulate

# Largest graph the worst-order working peak is computed for (a max flow in pure Python: ~1-3 s at 20,000 ops).
WORST_MAX_OPS = 20000


@dataclass
class Plan:
    graph: TaskGraph
    schedule: Schedule
    sim: Simulation
    comm: CommPlan
    units: list | None = None     # the model's UnitSpecs (what ``freeze``'s saving is measured with)

    @property
    def parameters(self) -> int:
        return sum(u.numel for u in self.graph.units)

    @property
    def budgets(self) -> dict[str, int]:
        return dict(self.schedule.memory or {})   # the checker has named every tier device, host or nvme

    def zero_formula(self) -> dict[str, float]:
        """The paper's model states per rank, sharded over the schedule's shard group (every rank,
        or a node or group(K) whose shards are replicated across the others)."""
        o = self.schedule.optimizer
        shard_ranks = group_size(self.schedule.shard_group(), self.graph.ranks)
        return zero_model_states(self.parameters, shard_ranks, self.graph.stage, self.graph.precision,
                                 o.kind, o.momentum)

    @cached_property
    def working_worst(self) -> dict[str, int] | None:
        """tier -> the working peak of the worst order the graph allows (what a run can reach with
        other timings than the simulated ones), or None for a graph over WORST_MAX_OPS ops."""
        if len(self.graph.ops) > WORST_MAX_OPS:
            return None
        simulated = {tier: tl.working_peak for tier, tl in self.sim.memory.tiers.items()}
        return worst_working(self.graph, simulated)

    def working_worst_note(self) -> str | None:
        if self.working_worst is not None:
            return None
        return (f"worst-order working peak not computed: {len(self.graph.ops):,} ops is over "
                f"{WORST_MAX_OPS:,}")

    def machine_source(self) -> str | None:
        """Where the rates came from: ``FILE:LINE`` of the machine statement that set some, or
        None for zdsl's built-in defaults (not measured on any machine the user has)."""
        spans = self.schedule.spans
        at = spans.get("machine")
        if at is None or not any(key.startswith("machine.") for key in spans):
            return None
        return "--set" if at.file == "--set" else f"{at.file}:{at.line}"

    def machine_line(self) -> str:
        name = self.schedule.machine.name
        source = self.machine_source()
        if source is None:
            calibrated = rates_line()
            if calibrated is not None:
                return calibrated
            return (f"rates: zdsl's uncalibrated default {name!r} profile; calibrate: "
                    f"zdsl calibrate --out machine.zs, then include \"machine.zs\"")
        if source == "--set":
            return f"rates: the {name!r} profile with the machine.* values given by --set"
        return f"rates: the {name!r} profile of the machine statement at {source}"

    def critical_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i in self.sim.critical_path:
            kind = self.graph.ops[i].kind
            out[kind] = out.get(kind, 0.0) + float(self.sim.duration[i])
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def decay_split(self) -> dict[str, int] | None:
        """Parameters weight decay applies to and those exempt (``no_decay``), or None without groups."""
        units = self.graph.units
        if all(u.decay is None for u in units):
            return None
        decay = sum(b - a for u in units for a, b in (u.decay if u.decay is not None else [(0, u.numel)]))
        return {"decay": decay, "no_decay": self.parameters - decay}

    @cached_property
    def freeze(self) -> FreezePlan | None:
        """What ``freeze`` saves against the same schedule without it (None without freeze)."""
        return freeze_plan(self.graph, self.schedule, self.units) if self.units is not None else None

    @property
    def residency(self) -> dict | None:
        """What the host copies kept between uses save (zdsl/compile/residency.py), or None."""
        return self.graph.config.get("residency")

    def to_json(self) -> dict:
        g, sim = self.graph, self.sim
        memory = sim.memory.to_json()
        for tier, budget in self.budgets.items():
            memory.setdefault(tier, {"model_states": dict.fromkeys(STATES, 0), "working": 0, "peak": 0})
            memory[tier]["budget"] = budget
        worst = self.working_worst
        if worst is not None:
            for tier, row in memory.items():
                row["working_worst"] = worst.get(tier, 0)
        extra: dict[str, object] = {} if worst is not None else {"working_worst_note": self.working_worst_note()}
        if self.decay_split() is not None:
            extra["weight_decay_groups"] = self.decay_split()
        if self.freeze is not None:
            extra["freeze"] = self.freeze.to_json()
        if self.residency is not None:
            extra["residency"] = self.residency
        if nvme_placements(g.config):
            extra["nvme"] = nvme_json(g)
        if (shape := hierarchy_json(g, self.schedule)) is not None:
            extra["hierarchy"] = shape
        if "device" in self.budgets:
            extra["largest_model_on_device"] = largest_model(g, self.budgets["device"])
        return {
            "schedule": g.schedule,
            "file": self.schedule.file,
            "ranks": g.ranks,
            "stage": g.stage,
            "precision": g.precision,
            "accumulate": g.accumulate,
            "parameters": self.parameters,
            "units": len(g.units),
            "ops": len(g.ops),
            "memory": memory,
            "zero_formula": {"model_states": self.zero_formula(),
                             "comm_elements_per_step": zero_comm_elements(self.parameters, g.stage)},
            "comm_bytes_per_step": self.comm.payload_bytes,
            "comm_bytes_per_step_by_level": bytes_by_level(g),
            "comm": self.comm.to_json(),
            "moved_bytes_per_step": traffic_json(g),
            "machine": {"name": self.schedule.machine.name, "source": self.machine_source() or calibrated_source(),
                        **({"gaps": gaps} if (gaps := rate_gaps(self.schedule.machine, g)) else {})},
            "predicted_step_s": sim.step_s,
            "lower_bound_s": sim.bound_s,
            "overlap_efficiency": sim.overlap_efficiency,
            "lanes": dict(sim.lane_busy),            # lane -> busy seconds
            "lane_share": {lane: busy / sim.step_s if sim.step_s else 0.0 for lane, busy in sim.lane_busy.items()},
            "critical_path": {"ops": len(sim.critical_path), "by_kind_s": self.critical_by_kind()},
            **extra,
        }


def nvme_json(graph: TaskGraph) -> dict:
    """State -> where its NVMe swap files go: folders, block, depth, and the drives they are on."""
    return {state: {"folders": list(p.paths), "block": p.block_bytes, "depth": p.queue_depth,
                    "drives": drives(p.paths)} for state, p in nvme_placements(graph.config).items()}


def build_plan(graph: TaskGraph, schedule: Schedule, sim: Simulation | None = None, units=None) -> Plan:
    """``units``: the model's UnitSpecs, for what ``freeze`` saves (left out without them)."""
    sim = sim if sim is not None else simulate(graph, schedule.machine)
    return Plan(graph=graph, schedule=schedule, sim=sim, comm=comm_plan(graph), units=units)


def fmt_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


def optimizer_lines(plan: Plan) -> list[str]:
    """The rate schedule and the weight decay groups, when the optimizer statement sets them."""
    o = plan.schedule.optimizer
    out = []
    if o.warmup or o.decay != "constant":
        rest = "constant" if o.decay == "constant" else \
            f"{o.decay} to {o.min_lr:g}" + (f" over {o.decay_steps} steps" if o.decay_steps else "")
        out.append(f"lr {o.lr:g}: warmup {min(o.warmup, plan.schedule.train.steps)} steps, then {rest} "
                   f"(zdsl/lr.py)")
    split = plan.decay_split()
    if split is not None:
        decay, none = split["decay"], split["no_decay"]
        exempt = ", ".join([*o.no_decay, *(repr(g) for g in o.no_decay_names)])
        out.append(f"weight decay {o.weight_decay:g} on {decay:,} parameters ({fmt_count(decay)}), "
                   f"none on {none:,} ({fmt_count(none)}: {exempt})")
    return out


def moved_table(console, plan: Plan) -> None:
    """Bytes per tier path per step against ZeRO-Infinity's minimum, and what host residency saves."""
    rows = traffic_json(plan.graph)
    if not rows:
        return
    table = Table(title="tiers: bytes moved per step per rank", title_justify="left")
    for col in ("path", "moved", "ZeRO-Infinity minimum", "moved / minimum"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for path, row in rows.items():
        ratio = f"{row['bytes'] / row['minimum']:.2f}" if row["minimum"] else "-"
        table.add_row(path, human_bytes(row["bytes"]), human_bytes(row["minimum"]), ratio)
    console.print(table)
    console.print("  minimum: parameters read for each forward and backward, gradients written once, "
                  "optimizer state read and written once, updated parameters written once", style="dim")
    r = plan.residency
    if r is not None:
        reads = rows.get("nvme -> host", {}).get("bytes", 0)
        uncached = reads + r["saved_bytes"] + r.get("held_read_bytes", 0)
        console.print(f"host residency (Belady, memory host {human_bytes(r['host_budget'])}): NVMe reads "
                      f"{human_bytes(reads)} per step, {human_bytes(uncached)} with no cache, "
                      f"{human_bytes(uncached - r['lru_saved_bytes'])} with an LRU cache of the same room; "
                      f"{r['kept']} of {r['candidates']} re-reads in the step kept on the host save "
                      f"{human_bytes(r['saved_bytes'])}")
        if r.get("held"):
            console.print(f"  held on the host through the whole step: {held_words(r['held'])}; NVMe reads and "
                          f"writes {human_bytes(r['held_saved_bytes'])} lower per step")


def held_words(names: list[str]) -> str:
    """``parameters of units 0-8, 41; optimizer state of units 0, 41`` from NVMe buffer names."""
    by_kind: dict[str, list[int]] = {}
    for name in names:
        kind, u, _ = parse_buffer_name(name)
        if u is not None:
            by_kind.setdefault(kind, []).append(u)
    out = []
    for kind, words in (("param_shard", "parameters"), ("optim", "optimizer state")):
        units = sorted(by_kind.get(kind, []))
        runs, start = [], None
        for i, u in enumerate(units):
            start = u if start is None else start
            if i + 1 == len(units) or units[i + 1] != u + 1:
                runs.append(str(u) if start == u else f"{start}-{u}")
                start = None
        if runs:
            out.append(f"{words} of unit{'s' if len(units) > 1 else ''} {', '.join(runs)}")
    return "; ".join(out)


def render_plan(plan: Plan, width: int = 124, color: bool = False) -> str:
    """The readable report: summary, memory per tier, communication, lanes."""
    g, sim = plan.graph, plan.sim
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, color_system="standard" if color else None,
                      highlight=False)
    o = plan.schedule.optimizer
    console.print(f"[bold]{g.schedule}[/bold]  {plan.schedule.file}")
    console.print(f"{len(g.units)} units, Ψ = {plan.parameters:,} parameters ({fmt_count(plan.parameters)}), "
                  f"{g.ranks} ranks, ZeRO stage {g.stage}, {g.precision}, {o.kind}, "
                  f"accumulate {g.accumulate}, {len(g.ops):,} ops")
    for line in optimizer_lines(plan):
        console.print(line)
    if plan.freeze is not None:
        console.print(plan.freeze.line())

    mem = Table(title="memory per rank", title_justify="left")
    worst = plan.working_worst
    cols = ("tier", "parameters", "gradients", "optimizer", "model states", "working", "worst order", "peak",
            "budget")
    for col in (c for c in cols if worst is not None or c != "worst order"):
        mem.add_column(col, justify="left" if col == "tier" else "right", no_wrap=True)
    budgets = plan.budgets
    memory = sim.memory.to_json()
    for tier in TIERS:
        row = memory[tier]
        ms = row["model_states"]
        if not row["peak"] and tier not in budgets:
            continue
        budget = budgets.get(tier)
        over = budget is not None and row["peak"] > budget
        peak = human_bytes(row["peak"])
        worst_cell = [] if worst is None else [human_bytes(worst.get(tier, 0))]
        mem.add_row(tier, human_bytes(ms["parameters"]), human_bytes(ms["gradients"]), human_bytes(ms["optimizer"]),
                    human_bytes(sum(ms.values())), human_bytes(row["working"]), *worst_cell,
                    f"[red]{peak}[/red]" if over else peak, human_bytes(budget) if budget is not None else "-")
    formula = plan.zero_formula()
    mem.add_row("ZeRO formula", *(human_bytes(formula[s]) for s in STATES), human_bytes(sum(formula.values())),
                *([""] * (4 if worst is not None else 3)), style="dim")
    console.print(mem)
    if worst is not None:
        console.print("  worst order: the working peak in the worst order the dependencies allow, "
                      "which a run's timings can reach", style="dim")
    if plan.working_worst_note():
        console.print(f"  {plan.working_worst_note()}", style="dim")
    if "device" in budgets:
        console.print(f"  {largest_model_line(g, budgets['device'])}", style="dim")
    states = sum(sum(memory[tier]["model_states"].values()) for tier in TIERS)
    for line in hierarchy_lines(g, plan.schedule, states):
        console.print(line)
    for tier in TIERS:
        split = memory[tier]["working_at_peak"]
        if split:
            console.print(f"  {tier} working at its peak: " +
                          ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in split.items()))

    c = plan.comm
    comm = Table(title="communication per step per rank", title_justify="left")
    wire = "on the wire (×(N-1)/N)" if c.wire_by_kind is None else "on the wire (×(n-1)/n, n its group's)"
    for col in ("collective", "payload", wire):
        comm.add_column(col, justify="left" if col == "collective" else "right")
    for kind, nbytes in c.by_kind.items():
        if nbytes:
            comm.add_row(kind.split(".", 1)[1], human_bytes(nbytes), human_bytes(c.wire(kind)))
    comm.add_row("total", human_bytes(c.payload_bytes), human_bytes(c.wire_bytes), style="bold")
    elems = zero_comm_elements(plan.parameters, g.stage)
    comm.add_row(f"ZeRO formula ({'3' if g.stage == 3 else '2'}Ψ)",
                 human_bytes(elems * (4 if g.precision == "fp32" else 2)), "", style="dim")
    console.print(comm)
    for line in level_lines(g, plan.schedule.machine):
        console.print(line)
    moved_table(console, plan)

    console.print(f"[bold]predicted step {fmt_s(sim.step_s)}[/bold] (lower bound {fmt_s(sim.bound_s)}, "
                  f"overlap efficiency {sim.overlap_efficiency:.2f}) on machine {plan.schedule.machine.name!r}")
    console.print(f"  {plan.machine_line()}", style="dim", soft_wrap=True)    # a path stays whole
    for gap in rate_gaps(plan.schedule.machine, plan.graph):
        console.print(f"  {gap}", style="dim", soft_wrap=True)
    for line in nvme_lines(plan.graph):
        console.print(f"  {line}", soft_wrap=True)
    lanes = Table(title="lanes", title_justify="left")
    for col in ("lane", "busy", "share", ""):
        lanes.add_column(col, justify="left" if col in ("lane", "") else "right")
    for lane in LANES:
        if lane in sim.lane_busy:
            busy = sim.lane_busy[lane]
            share = busy / sim.step_s if sim.step_s else 0.0
            lanes.add_row(lane, fmt_s(busy), f"{share:.0%}", "█" * round(20 * min(share, 1.0)))
    console.print(lanes)
    kinds = ", ".join(f"{k.split('.', 1)[1]} {fmt_s(v)}" for k, v in plan.critical_by_kind().items() if v > 0)
    console.print(f"critical path: {len(sim.critical_path)} ops ({kinds})")
    return buf.getvalue()
