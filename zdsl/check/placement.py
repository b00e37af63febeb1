"""Checking where model state lives and how it moves: the ZeRO policies.

``zero``/``shard`` (which states are sharded; the groups they are sharded over are
:mod:`zdsl.check.hierarchy`'s), ``offload`` (which tier holds
them, with DeepSpeed's rules: parameters only at stage 3, gradients from
stage 2 and only to the host, the optimizer from stage 1), ``prefetch``,
``bucket``, ``overlap``, ``recompute``, ``persist`` and ``memory``. Each method
reads one statement into the draft (:class:`zdsl.check.draft.StatementChecks`):
``self.s`` is the schedule being filled, ``self.r`` the reporter.
"""
from __future__ import annotations

import os

from zdsl.check.draft import StatementChecks
from zdsl.check.hierarchy import check_over
from zdsl.check.values import describe
from zdsl.ir import DTYPE_BYTES, TIERS
from zdsl.lang import ast
from zdsl.lang.errors import did_you_mean
from zdsl.lang.sizes import split_number
from zdsl.schedule import ALL_OVERLAPS, DIRECT_IO_ALIGN, OVERLAP_VERBS, PHASES, STATES, Placement, Span

OFFLOAD_TIERS = ("cpu", "nvme", "device")


class PlacementChecks(StatementChecks):
    def _zero(self, st: ast.ZeroStmt) -> None:
        stage = self.r.integer(st.stage, "zero stage", 0, 3)
        if stage is not None:
            self.s.stage = stage
        self.span("zero", st.span)

    def _shards(self, statements: list[ast.ShardStmt]) -> None:
        """``shard STATES [over GROUP]``; several only where each says ``over`` (the checker's
        ``_by_keyword``), together sharding a prefix of ZeRO's order, each state named once."""
        seen: list[str] = []
        for st in statements:
            self.span("zero", st.span)
            self.span("shard", st.span)
            if [n.value for n in st.states] == ["none"]:
                if st.over is not None:
                    self.r.error(st.over.span, "nothing is sharded here, so nothing is sharded over a group",
                                 hint="shard optimizer, gradients, parameters over node")
                self.s.stage = 0
                return
            names = self._state_names(st, seen)
            if names is None:
                return
            group = "all" if st.over is None else check_over(self.draft, st.over)
            if group is None:
                return
            for name, n in zip(names, st.states):
                self.s.shard_over[name] = group
                self.span(f"shard.{name}", st.over.span if st.over is not None else n.span)
            seen += names
        stage = len(seen)
        if set(seen) != set(STATES[:stage]):
            needed = STATES[:max(STATES.index(x) for x in seen) + 1]
            first, last = statements[-1].states[0].span, statements[-1].states[-1].span
            self.r.error(Span(first.file, first.line, first.column, last.end_column),
                         "sharding must follow ZeRO's order: optimizer, then gradients, "
                         "then parameters",
                         hint=f"shard {', '.join(needed)}  (= zero {len(needed)})")
            return
        self.s.stage = stage

    def _state_names(self, st: ast.ShardStmt, seen: list[str]) -> list[str] | None:
        """The states one ``shard`` statement names (None after an error)."""
        names: list[str] = []
        for n in st.states:
            if n.value not in STATES:
                self.r.error(n.span, f"unknown state {n.value!r}",
                             hint=did_you_mean(n.value, STATES, what="states are"))
                return None
            if n.value in seen or n.value in names:
                self.r.error(n.span, f"{n.value} is listed twice")
                return None
            names.append(n.value)
        return names

    def _offload(self, st: ast.OffloadStmt) -> None:
        state = st.state.value
        if state not in STATES:
            self.r.error(st.state.span,
                         "offloading activations is not supported" if state == "activations"
                         else f"unknown state {state!r}",
                         hint="use `recompute` to save activation memory" if state == "activations"
                         else did_you_mean(state, STATES, what="states are"))
            return
        key = f"offload.{state}"
        self.span(key, st.span)
        target = st.target
        if not isinstance(target.callee, ast.Name):
            self.r.error(target.callee.span, "offload to cpu or nvme(\"PATH\")",
                         hint=f'write nvme("{target.callee.value}")')
            return
        tier = self.r.choice(target.callee, "offload tier", OFFLOAD_TIERS)
        if tier is None:
            return
        p = Placement(tier=tier)
        positional = [a for a in target.args if a.key is None]
        keyword = [a for a in target.args if a.key is not None]
        if tier == "nvme":
            if not positional:
                self.r.error(target.span, "nvme needs a folder for its swap files",
                             hint=f'offload {state} -> nvme("/tmp/zdsl_swap")')
                return
            p.paths = self._nvme_folders(positional)
            positional = []
        for extra in positional:
            self.r.error(extra.span, f"{tier} takes key=value options here")
        allowed = {"cpu": ("pinned", "ratio"), "nvme": ("pinned", "ratio", "block", "depth"),
                   "device": ()}[tier]
        given = self.r.keywords(keyword, allowed, tier)
        for opt, arg in given.items():
            self.span(f"{key}.{opt}", arg.span)
            if opt == "pinned":
                pinned = self.r.boolean(arg.value, "pinned")
                if pinned is not None:
                    p.pinned = pinned
            elif opt == "ratio":
                ratio = self.r.real(arg.value, "ratio", 0.0, 1.0, lo_open=True)
                if ratio is not None:
                    p.ratio = ratio
            elif opt == "block":
                block = self.r.size(arg.value, "block", lo=DIRECT_IO_ALIGN)
                if block is not None and block % DIRECT_IO_ALIGN:
                    self.r.error(arg.value.span, f"block must be a multiple of 4KiB (O_DIRECT), "
                                                 f"not {describe(arg.value)}", hint="e.g. block=1MiB")
                elif block is not None:
                    p.block_bytes = block
            else:
                depth = self.r.integer(arg.value, "depth", 1, 1024)
                if depth is not None:
                    p.queue_depth = depth
        if tier == "device":
            self.s.placement.pop(state, None)
            return
        self._offload_rules(st, state, tier)
        self.s.placement[state] = p

    def _nvme_folders(self, args: list) -> tuple[str, ...]:
        """``nvme("A", "B", ...)``'s folders: one or more strings, each named once (several: every
        swap file's blocks are striped over them, as RAID-0 over the drives)."""
        folders: list[str] = []
        where: dict[str, Span] = {}
        for arg in args:
            folder = self.r.string(arg.value, "an nvme folder")
            if folder is None:
                continue
            key = os.path.normpath(folder)
            if key in where:
                self.r.error(arg.value.span, f"the folder {folder!r} is named twice in this nvme(...)",
                             hint=f"the first is at {_where(where[key])}; name each drive's folder once")
                continue
            where[key] = arg.value.span
            folders.append(folder)
        return tuple(folders)

    def _offload_rules(self, st: ast.OffloadStmt, state: str, tier: str) -> None:
        stage = self.s.stage
        if state == "parameters" and stage < 3:
            self.r.error(st.state.span, f"offloading parameters needs zero 3 (this is zero {stage})",
                         hint="add `zero 3`: as in DeepSpeed, only sharded parameters are offloaded")
        elif state == "gradients" and stage < 2:
            self.r.error(st.state.span, f"offloading gradients needs zero 2 or 3 (this is zero {stage})",
                         hint="add `zero 2`, or offload the optimizer instead")
        elif state == "optimizer" and stage < 1:
            self.r.error(st.state.span, "offloading the optimizer needs zero 1 or higher "
                                        "(this is zero 0)",
                         hint="add `zero 1` (ZeRO-Offload shards the optimizer state first)")
        if state == "gradients" and tier == "nvme":
            self.r.error(st.target.callee.span, "gradients are offloaded to cpu only",
                         hint="offload gradients -> cpu")

    def _prefetch(self, st: ast.PrefetchStmt) -> None:
        self.span("prefetch", st.span)
        if st.state is not None and st.state.value != "parameters":
            self.r.error(st.state.span, f"only parameters are prefetched, not {st.state.value}",
                         hint=did_you_mean(st.state.value, ["parameters"]) or
                         "prefetch parameters 2 units ahead")
            return
        depth = self.r.integer(st.depth, "prefetch depth", 0, 10 ** 6)
        if depth is None:
            return
        self.s.prefetch = depth
        if self.units is not None and depth >= len(self.units):
            self.r.warn(st.depth.span, f"prefetch {depth} is deeper than the model "
                                       f"({len(self.units)} units)",
                        hint=f"prefetch {max(1, len(self.units) - 1)} already gathers every unit ahead")

    def _bucket(self, st: ast.SizeStmt) -> None:
        self.span("bucket", st.span)
        n = self.r.size(st.size, "bucket")
        if n is not None:
            self.s.bucket_bytes = n

    def _overlap(self, st: ast.OverlapStmt) -> None:
        self.span("overlap", st.span)
        pairs: set[str] = set()
        for pair in st.pairs:
            io = pair.io.value
            if pair.phase is None and io in ("none", "all"):
                if len(st.pairs) > 1:
                    self.r.error(pair.io.span, f"`overlap {io}` stands alone")
                    return
                pairs = set() if io == "none" else set(ALL_OVERLAPS)
                continue
            if io not in OVERLAP_VERBS:
                self.r.error(pair.io.span, f"unknown transfer {io!r}",
                             hint=did_you_mean(io, OVERLAP_VERBS + ("none", "all"),
                                               what="transfers are"))
                continue
            if pair.phase is None:
                pairs |= {f"{io}/{p}" for p in PHASES}
                continue
            phase = self.r.choice(pair.phase, "phase", PHASES)
            if phase is not None:
                pairs.add(f"{io}/{phase}")
        self.s.overlap = pairs

    def _recompute(self, st: ast.RecomputeStmt) -> None:
        self.span("recompute", st.span)
        n = len(self.units) if self.units is not None else None
        if st.mode is not None:
            mode = self.r.choice(st.mode, "recompute choice", ("blocks", "all", "none"))
            if mode is None or mode == "none":
                self.s.recompute = set()
                return
            if n is None:
                self.r.warn(st.mode.span, f"`recompute {mode}` needs the model's units, "
                                          "which are not known here; nothing is recomputed")
                return
            self.s.recompute = set(range(1, n - 1)) if mode == "blocks" else set(range(n))
            return
        chosen: set[int] = set()
        for rng in st.ranges:
            first = self.r.integer(rng.first, "unit", 0, 10 ** 9)
            last = first if rng.last is None else self.r.integer(rng.last, "unit", 0, 10 ** 9)
            if first is None or last is None:
                continue
            if last < first:
                self.r.error(rng.span, f"range {first}..{last} is empty",
                             hint=f"write {last}..{first}")
                continue
            if n is not None and last >= n:
                self.r.error(rng.span, f"unit {last} is beyond the model (units 0..{n - 1})")
                continue
            chosen |= set(range(first, last + 1))
        self.s.recompute = chosen

    def _persist(self, st: ast.SizeStmt) -> None:
        self.span("persist", st.span)
        if split_number(st.size.text)[1]:
            n = self.r.size(st.size, "persist threshold")
            if n is not None:
                n //= DTYPE_BYTES[self.s.train.precision]
        else:
            n = self.r.integer(st.size, "persist threshold (parameters)", 0, 10 ** 15)
        if n is not None:
            self.s.persist_below = n

    def _memory(self, st: ast.MemoryStmt) -> None:
        self.span("memory", st.span)
        for b in st.budgets:
            tier = b.tier.value
            if tier not in TIERS:
                self.r.error(b.tier.span, f"unknown memory tier {tier!r}",
                             hint="host memory is called 'host' here" if tier == "cpu"
                             else did_you_mean(tier, TIERS, what="tiers are"))
                continue
            if f"memory.{tier}" in self.s.spans:
                self.r.error(b.tier.span, f"the {tier} budget is set twice",
                             hint=f"the first is at {_where(self.s.spans[f'memory.{tier}'])}")
                continue
            n = self.r.size(b.size, f"{tier} budget", lo=1)
            self.span(f"memory.{tier}", b.span)
            if n is not None:
                self.s.memory[tier] = n


def _where(span: Span) -> str:
    return f"{span.file}:{span.line}:{span.column}"
