"""The syntax tree of a .zs file: what was written, where, nothing resolved.

The parser (:mod:`zdsl.lang.parse`) builds these from lark's parse tree; the
checker (:mod:`zdsl.check.checker`) turns them into a :class:`~zdsl.schedule.Schedule`.
Every node keeps the :class:`Span` of its text so that any later error can
point at it. Values keep their source text (``64MiB``, ``1e-3``) because
their meaning depends on where they are used (a size, a count, a rate).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zdsl.schedule import Span

# -- values ---------------------------------------------------------------------

@dataclass
class Num:
    text: str                  # as written, sign included: "-3", "64MiB", "1e-3"
    span: Span


@dataclass
class Str:
    value: str                 # escapes resolved
    span: Span


@dataclass
class Name:
    value: str
    span: Span


@dataclass
class Tuple:
    items: list                # of Num | Str | Name
    span: Span


Value = Num | Str | Name | Tuple


@dataclass
class Arg:
    """``key=value`` (key set) or a positional ``value`` (key None)."""
    key: Name | None
    value: Value
    span: Span


@dataclass
class Call:
    """``gpt(layers=2)``, ``"my_model.py:build"(hidden=64)``, ``cpu``, ``nvme("/tmp")``."""
    callee: Name | Str
    args: list[Arg]
    has_parens: bool
    span: Span


# -- statements -----------------------------------------------------------------

@dataclass
class Stmt:
    keyword: str               # the statement's first word
    span: Span                 # the whole statement
    key_span: Span             # the keyword itself


@dataclass(kw_only=True)
class ScheduleStmt(Stmt):
    name: Name
    description: Str | None = None


@dataclass(kw_only=True)
class CallStmt(Stmt):
    """model, data, optimizer, machine: a keyword and a call."""
    call: Call


@dataclass(kw_only=True)
class TrainStmt(Stmt):
    args: list[Arg] = field(default_factory=list)


@dataclass(kw_only=True)
class LinkStmt(Stmt):
    """``link node=(RATE, LATENCY), cluster=(RATE, LATENCY)``: the collectives' link per level."""
    args: list[Arg] = field(default_factory=list)


@dataclass(kw_only=True)
class RanksStmt(Stmt):
    count: Num
    device: Name | None = None
    per_node: Num | None = None    # ``ranks 16 on cuda, 8 per node``: ranks on each node
    per_word: Name | None = None   # the word after ``per`` (``node``)


@dataclass(kw_only=True)
class ZeroStmt(Stmt):
    stage: Num


@dataclass
class Over:
    """A shard group: ``all``, ``node`` or ``group(K)`` (``size`` set)."""
    kind: Name
    size: Num | None
    span: Span


@dataclass(kw_only=True)
class ShardStmt(Stmt):
    states: list[Name] = field(default_factory=list)
    over: Over | None = None       # ``shard STATES over node``; None: over all


@dataclass(kw_only=True)
class SecondaryStmt(Stmt):
    """``secondary parameters over node``: a second, node-local shard of the parameters (hpZ)."""
    state: Name
    over: Over


@dataclass(kw_only=True)
class OffloadStmt(Stmt):
    state: Name
    target: Call


@dataclass(kw_only=True)
class PrefetchStmt(Stmt):
    state: Name | None = None
    depth: Num
    ahead: bool = False        # "units ahead" written


@dataclass(kw_only=True)
class SizeStmt(Stmt):
    """bucket SIZE, persist below SIZE."""
    size: Num


@dataclass
class Pair:
    io: Name
    phase: Name | None
    span: Span


@dataclass(kw_only=True)
class OverlapStmt(Stmt):
    pairs: list[Pair] = field(default_factory=list)


@dataclass
class Range:
    first: Num
    last: Num | None
    span: Span


@dataclass(kw_only=True)
class RecomputeStmt(Stmt):
    mode: Name | None = None   # blocks | all | none; None when units are listed
    ranges: list[Range] = field(default_factory=list)


@dataclass
class Budget:
    tier: Name
    size: Num
    span: Span


@dataclass(kw_only=True)
class MemoryStmt(Stmt):
    budgets: list[Budget] = field(default_factory=list)


@dataclass(kw_only=True)
class IncludeStmt(Stmt):
    path: Str


@dataclass(kw_only=True)
class CheckpointStmt(Stmt):
    every: Num
    dir: Str
    keep: Num | None = None


@dataclass(kw_only=True)
class FreezeStmt(Stmt):
    patterns: list[Str] = field(default_factory=list)   # parameter-name globs, quoted or not


@dataclass(kw_only=True)
class EvalStmt(Stmt):
    every: Num
    source: Call        # a data source, as in ``data``
    batches: Num | None = None


# -- pipelines ------------------------------------------------------------------

@dataclass
class Index:
    """``u``, ``u+2``, ``u-1`` (var set) or ``0`` (var None, absolute)."""
    var: Name | None
    offset: int
    absolute: int | None
    span: Span


@dataclass
class Target:
    """``parameters[u+1]`` (state set) or a bare unit index ``u+1`` (state None)."""
    state: Name | None
    index: Index
    span: Span


@dataclass
class PipeLine:
    verb: Name
    target: Target
    prep: Name | None          # from | to | on
    tier: Name | None
    span: Span


@dataclass(kw_only=True)
class PipelineStmt(Stmt):
    var: Name
    body: list[PipeLine] = field(default_factory=list)


@dataclass
class Program:
    file: str
    source: str
    statements: list[Stmt]
