"""Schedule (+ pipelines) back to .zs text: what ``zdsl plan --lowered`` prints.

The output is valid .zs that parses and checks to an equal schedule with the
given pipelines (compare with :func:`without_spans`, since positions differ).
Policy statements are printed where they still matter: settings that differ
from their defaults, plus the model, data, training, optimizer and ranks,
which a reader always wants to see. Numbers are printed exactly (``repr`` of
floats, sizes with the largest unit that divides them) so nothing drifts in
the round trip.
"""
from __future__ import annotations

import copy
import dataclasses
import re

from zdsl.ir import TIERS
from zdsl.lang.sizes import format_size
from zdsl.machine_profile import LINK_LEVELS
from zdsl.schedule import (
    ALL_OVERLAPS,
    MACHINE_OPTIONS,
    OVERLAP_VERBS,
    PHASES,
    STATES,
    OptimizerSpec,
    Pipeline,
    PipeStmt,
    Placement,
    Ref,
    Schedule,
)
from zdsl.sources import source_of

_PREPOSITIONS = {"read": "from", "write": "to", "copy": "to", "step": "on"}
_UNIT_VERBS = ("compute", "recompute", "step")


def print_schedule(schedule: Schedule, pipelines: dict[str, Pipeline] | None = None) -> str:
    """.zs text for ``schedule`` followed by ``pipelines`` (default: its own)."""
    if pipelines is None:
        pipelines = schedule.pipelines
    lines = [wrapped for line in _policies(schedule) for wrapped in wrap_statement(line)]
    if pipelines:
        lines.append("")
        lines.append("# pipelines: statement order is issue order; dependencies are derived")
        for phase in sorted(pipelines, key=lambda p: (PHASES + (p,)).index(p)):
            lines += _pipeline(pipelines[phase])
    return "\n".join(lines) + "\n"


def without_spans(schedule: Schedule) -> Schedule:
    """A copy with positions (spans, file) cleared, for comparing schedules."""
    out = copy.deepcopy(schedule)
    out.spans = {}
    out.file = ""
    for pipe in out.pipelines.values():
        pipe.span = None
        for stmt in pipe.body:
            stmt.span = None
    return out


# -- long statements ------------------------------------------------------------

WIDTH = 100     # a statement longer than this is printed over several lines


def wrap_statement(line: str, width: int = WIDTH) -> list[str]:
    """A statement as lines no longer than ``width`` where its commas allow.

    A call's settings go one per line inside its parentheses (the newlines inside
    ``(`` ... ``)`` continue the statement); a statement with top-level commas and no
    call (``train``, ``memory``, ``freeze``) breaks after each comma, each part under
    the first. A statement that fits, or has nowhere to break, is one line.
    """
    if len(line) <= width:
        return [line]
    depth, start, opened, closed = 0, 0, None, None
    parts: list[str] = []
    i = 0
    while i < len(line):
        c = line[i]
        if c == '"':                      # skip a string, escapes included
            i += 1
            while i < len(line) and line[i] != '"':
                i += 2 if line[i] == "\\" else 1
        elif c == "(":
            depth += 1
            if depth == 1 and opened is None:
                opened, start, parts = i, i + 1, []     # wrap at the call, not before it
        elif c == ")":
            depth -= 1
            if depth == 0 and opened is not None and closed is None:
                closed = i
                parts.append(line[start:i].strip())
        elif c == "," and depth == (1 if opened is not None and closed is None else 0):
            parts.append(line[start:i].strip())
            start = i + 1
        i += 1
    if opened is not None and closed is not None:
        if len(parts) < 2:
            return [line]
        inner = [f"    {p}," for p in parts[:-1]] + [f"    {parts[-1]}"]
        return [line[:opened + 1]] + inner + [line[closed:]]
    parts.append(line[start:].strip())
    keyword = re.match(r"\S+\s+", line)
    if len(parts) < 2 or keyword is None:
        return [line]
    indent = " " * keyword.end()      # under the first item, after the keyword
    return [parts[0] + ","] + [indent + p + "," for p in parts[1:-1]] + [indent + parts[-1]]


# -- values ---------------------------------------------------------------------

def value_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return string_text(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(value_text(v) for v in value) + ")"
    raise TypeError(f"cannot print {value!r} as a .zs value")


def string_text(text: str) -> str:
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("\t", "\\t").replace("\r", "\\r"))
    return f'"{escaped}"'


def _kwargs(items) -> str:
    return ", ".join(f"{k}={v if isinstance(v, _Raw) else value_text(v)}" for k, v in items)


class _Raw(str):
    """Text printed as is (a name such as ``fp32``, a size such as ``1MiB``)."""


# -- policies -------------------------------------------------------------------

def _policies(s: Schedule) -> list[str]:
    name = s.name if s.name.isidentifier() else "_" + "".join(
        c if c.isalnum() else "_" for c in s.name)
    out = [f"schedule {name}" + (f" {string_text(s.description)}" if s.description else "")]
    out.append(f"model     {_model(s)}")
    out.append(f"data      {_data(s)}")
    t = s.train
    out.append("train     " + _kwargs([("steps", t.steps), ("batch", t.batch),
                                        ("accumulate", t.accumulate),
                                        ("precision", _Raw(t.precision)), ("seed", t.seed)]))
    out.append(f"optimizer {_optimizer(s.optimizer)}")
    out.append(f"ranks     {s.ranks} on {s.device}" + (f", {s.per_node} per node" if s.per_node else ""))
    out.append(_sharding(s))
    if s.secondary:
        out.append(f"secondary parameters over {s.secondary}")
    for state in STATES:
        p = s.placement.get(state)
        if p is not None and p.tier != "device":
            out.append(f"offload   {state} -> {_placement(p)}")
    defaults = Schedule(name="")
    if s.prefetch != defaults.prefetch:
        out.append(f"prefetch  parameters {s.prefetch} units ahead")
    if s.bucket_bytes:
        out.append(f"bucket    {format_size(s.bucket_bytes)}")
    if set(s.overlap) != set(ALL_OVERLAPS):
        out.append(f"overlap   {_overlap(set(s.overlap))}")
    if s.recompute:
        out.append(f"recompute units {_ranges(sorted(s.recompute))}")
    if s.persist_below:
        out.append(f"persist   below {s.persist_below}")
    if s.memory:
        tiers = sorted(s.memory, key=lambda t: (TIERS + (t,)).index(t))
        out.append("memory    " + ", ".join(f"{t} {format_size(s.memory[t])}" for t in tiers))
    out += _machine(s)
    if s.checkpoint is not None:
        c = s.checkpoint
        out.append(f"checkpoint every {c.every} steps -> {string_text(c.dir)}"
                   + (f" keep {c.keep}" if c.keep else ""))
    if s.freeze:
        out.append("freeze    " + ", ".join(_pattern(g) for g in s.freeze))
    if s.eval is not None:
        e = s.eval
        out.append(f"eval      every {e.every} steps on {_data_text(e.data)} batches={e.batches}")
    return out


def _sharding(s: Schedule) -> str:
    """``zero N``, or ``shard STATES over GROUP`` where the sharded states span a smaller group
    (the checker gives them one)."""
    sharded = STATES[:s.stage]
    group = s.shard_over[sharded[0]] if sharded else "all"
    if group == "all":
        return f"zero      {s.stage}"
    return f"shard     {', '.join(sharded)} over {group}"


def _pattern(glob: str) -> str:
    """A glob as the grammar reads it back: bare where it is a name or a glob token, else quoted."""
    return glob if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|[A-Za-z0-9_]*[.*?\[][A-Za-z0-9_.*?\[\]]*", glob) \
        else string_text(glob)


def _model(s: Schedule) -> str:
    m = s.model
    if m.kind == "hf":      # the folder as the checker resolved it (absolute): valid from any folder
        return f"hf({', '.join([string_text(m.path or '')] + ([_kwargs(m.args.items())] if m.args else []))})"
    callee = "gpt" if m.kind == "gpt" else string_text(m.factory or "")
    return f"{callee}({_kwargs(m.args.items())})"


def _data(s: Schedule) -> str:
    return _data_text(s.data)


def _data_text(d) -> str:
    """``KIND("ARGUMENT", key=value...)`` as the source writes itself back."""
    source = source_of(d.kind)
    argument, settings = source.written(d)
    settings = [(k, _Raw(v) if k in source.bare else v) for k, v in settings]
    parts = ([string_text(argument)] if argument is not None else []) + ([_kwargs(settings)] if settings else [])
    return f"{d.kind}({', '.join(parts)})"


def _optimizer(o: OptimizerSpec) -> str:
    items: list[tuple[str, object]] = [("lr", o.lr)]
    if o.kind == "sgd":
        items.append(("momentum", o.momentum))
    else:
        items += [("betas", tuple(o.betas)), ("eps", o.eps)]
    items.append(("weight_decay", o.weight_decay))
    if o.clip is not None:
        items.append(("clip", o.clip))
    base = OptimizerSpec()
    for key in ("warmup", "decay", "min_lr", "decay_steps"):
        if getattr(o, key) != getattr(base, key):
            items.append((key, _Raw(o.decay) if key == "decay" else getattr(o, key)))
    groups = [*o.no_decay, *(string_text(g) for g in o.no_decay_names)]
    if groups:
        items.append(("no_decay", _Raw(groups[0] if len(groups) == 1 else f"({', '.join(groups)})")))
    return f"{o.kind}({_kwargs(items)})"


def _placement(p: Placement) -> str:
    base = Placement()
    items: list[tuple[str, object]] = []
    if p.pinned != base.pinned:
        items.append(("pinned", p.pinned))
    if p.ratio != base.ratio:
        items.append(("ratio", p.ratio))
    if p.tier == "nvme":
        if p.block_bytes != base.block_bytes:
            items.append(("block", _Raw(format_size(p.block_bytes))))
        if p.queue_depth != base.queue_depth:
            items.append(("depth", p.queue_depth))
        inner = ", ".join([string_text(folder) for folder in p.paths] + ([_kwargs(items)] if items else []))
        return f"nvme({inner})"
    return p.tier + (f"({_kwargs(items)})" if items else "")


def _overlap(pairs: set[str]) -> str:
    if not pairs:
        return "none"
    parts = []
    for verb in OVERLAP_VERBS:
        mine = {p for p in pairs if p.split("/")[0] == verb}
        if mine == {f"{verb}/{ph}" for ph in PHASES}:
            parts.append(verb)
        else:
            parts += [f"{verb}/{ph}" for ph in PHASES if f"{verb}/{ph}" in mine]
    return ", ".join(parts)


def _ranges(units: list[int]) -> str:
    out, i = [], 0
    while i < len(units):
        j = i
        while j + 1 < len(units) and units[j + 1] == units[j] + 1:
            j += 1
        out.append(str(units[i]) if i == j else f"{units[i]}..{units[j]}")
        i = j + 1
    return ", ".join(out)


def _machine(s: Schedule) -> list[str]:
    """The ``machine`` statement where the profile is not the device's default, and the ``link``
    statement for each level it gives both values of; a schedule that had only ``link`` gets no
    ``machine`` (it is planned with this machine's calibrated rates and those links)."""
    from zdsl.check.machine import CPU_PROFILE, CUDA_PROFILE  # the checker owns the built-in profiles
    m = s.machine
    default = CUDA_PROFILE if s.device == "cuda" else CPU_PROFILE
    if dataclasses.asdict(m) == dataclasses.asdict(default):
        return []
    base_name = m.name if m.name in ("cpu", "cuda") else "cpu"
    base = CUDA_PROFILE if base_name == "cuda" else CPU_PROFILE
    wires = dict(MACHINE_OPTIONS)
    levels = [(level, keys) for level, keys in LINK_LEVELS.items()
              if all(m.value(wires[k]) is not None for k in keys)
              and any(m.value(wires[k]) != base.value(wires[k]) for k in keys)]
    linked = {k for _, keys in levels for k in keys}
    items = [(opt, m.value(fld)) for opt, fld in MACHINE_OPTIONS
             if m.value(fld) != base.value(fld) and opt not in linked]
    out = []
    if items or base is not default or "machine" in s.spans or "link" not in s.spans:
        out.append(f"machine   {base_name}" + (f"({_kwargs(items)})" if items else ""))
    if levels:
        out.append("link      " + ", ".join(f"{level}={value_text(tuple(m.value(wires[k]) for k in keys))}"
                                            for level, keys in levels))
    return out


# -- pipelines ------------------------------------------------------------------

def _pipeline(p: Pipeline) -> list[str]:
    lines = [f"{p.phase} unit {p.var} {{"]
    lines += [f"    {_statement(stmt, p.var)}" for stmt in p.body]
    lines.append("}")
    return lines


def _index(ref: Ref, var: str) -> str:
    if ref.absolute is not None:
        return str(ref.absolute)
    if ref.offset > 0:
        return f"{var}+{ref.offset}"
    if ref.offset < 0:
        return f"{var}-{-ref.offset}"
    return var


def _statement(stmt: PipeStmt, var: str) -> str:
    index = _index(stmt.ref, var)
    target = index if stmt.verb in _UNIT_VERBS else f"{stmt.ref.state}[{index}]"
    text = f"{stmt.verb:<9} {target}"
    if stmt.tier is not None:
        text += f" {_PREPOSITIONS.get(stmt.verb, 'to')} {stmt.tier}"
    return text
