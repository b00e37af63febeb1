"""Checking hierarchical sharding: ranks per node, the group each state is sharded over, and the
secondary shard of the parameters.

``ranks 16 on cuda, 8 per node`` says how ranks group into nodes (consecutive ranks share one);
``shard STATES over node|group(K)|all`` shards those states within each node (HSDP), within
groups of K consecutive ranks (MiCS) or over every rank (the default), replicated across the
groups; ``secondary parameters over node`` keeps, after each unit's forward, a node-local shard
of its parameters that the backward gathers from (ZeRO++'s hpZ).

What the compiler builds, and so what is refused here with the reason and a fix:

* one shard group for every sharded state, as FSDP2's HSDP, ZeRO++ and MiCS have it: a rank's
  shards of the parameters, gradients and optimizer state then cover the same elements, the
  gradient is reduce-scattered within the group and all-reduced across its replicas, and the
  step updates the shard the rank holds;
* a group that tiles the ranks and the nodes: its size divides the ranks, and divides the ranks
  per node or is a whole number of nodes (a group that straddles a node boundary on some ranks
  and not on others has no one cost, and no published form builds it);
* a secondary shard only of sharded parameters (zero 3) whose shard group spans more than a node:
  where they are already sharded within a node, the secondary shard would be the primary one.

Statement checks (:func:`check_per_node`, :func:`check_over`, :func:`check_secondary`) read
values; :func:`check_hierarchy` applies the rules above once every statement is read.
"""
from __future__ import annotations

from zdsl.check.draft import Draft
from zdsl.check.machine import MAX_RANKS
from zdsl.lang import ast
from zdsl.lang.errors import did_you_mean
from zdsl.schedule import STATES

GROUP_WORDS = ("all", "node", "group")


def check_per_node(draft: Draft, st: ast.RanksStmt) -> None:
    """``, P per node`` of a ranks statement."""
    if st.per_node is None:
        return
    if st.per_word is not None and st.per_word.value != "node":
        draft.report.error(st.per_word.span, f"ranks are counted per node, not per {st.per_word.value}",
                           hint=f"ranks {st.count.text}, {st.per_node.text} per node")
        return
    per_node = draft.report.integer(st.per_node, "ranks per node", 1, MAX_RANKS)
    if per_node is not None:
        draft.schedule.per_node = per_node
        draft.span("per_node", st.per_node.span)


def check_over(draft: Draft, over: ast.Over) -> str | None:
    """``all``, ``node`` or ``group(K)`` as the schedule writes it (None after an error)."""
    word = over.kind.value
    if word not in GROUP_WORDS:
        draft.report.error(over.kind.span, f"unknown shard group {word!r}",
                           hint=did_you_mean(word, GROUP_WORDS) or "shard over all, node or group(K)")
        return None
    if word == "group":
        if over.size is None:
            draft.report.error(over.span, "group needs its size: the ranks in each group",
                               hint="e.g. over group(8)")
            return None
        size = draft.report.integer(over.size, "group size", 1, MAX_RANKS)
        return None if size is None else f"group({size})"
    if over.size is not None:
        draft.report.error(over.span, f"{word} takes no size",
                           hint=f"over {word}, or over group({over.size.text})")
        return None
    return word


def check_secondary(draft: Draft, st: ast.SecondaryStmt) -> None:
    """``secondary parameters over node``."""
    draft.span("secondary", st.span)
    if st.state.value != "parameters":
        draft.report.error(st.state.span, f"only parameters have a secondary shard, not {st.state.value}",
                           hint="secondary parameters over node (ZeRO++'s hpZ: the backward gathers "
                                "the parameters within the node)")
        return
    group = check_over(draft, st.over)
    if group is not None and group != "node":
        draft.report.error(st.over.span, f"the secondary shard is kept within a node, not over {group}",
                           hint="secondary parameters over node")
        return
    draft.schedule.secondary = group


def group_size(group: str, ranks: int, per_node: int | None) -> int:
    """Ranks in each instance of a schedule's shard group (``all``, ``node``, ``group(K)``)."""
    if group == "node":
        return per_node or ranks
    if group.startswith("group("):
        return int(group[6:-1])
    return ranks


def check_hierarchy(draft: Draft) -> None:
    """The rules across statements (the module's docstring), once every statement is read."""
    s = draft.schedule
    if s.per_node is not None and s.ranks % s.per_node:
        span = s.spans.get("per_node")
        draft.report.error(span, f"{s.per_node} ranks per node do not divide the {s.ranks} ranks",
                           hint=f"ranks {s.ranks}, {_divisors_text(s.ranks, s.per_node)} per node")
        return
    sharded = list(STATES[:s.stage])
    if sharded and _one_group(draft, sharded):
        _group_tiles(draft, sharded[-1], s.shard_over[sharded[-1]])
    if s.secondary is not None:
        _secondary_fits(draft)


def _one_group(draft: Draft, sharded: list[str]) -> bool:
    """Every sharded state has one group; else an error naming the pair and why it is not built."""
    s = draft.schedule
    first = sharded[0]
    for state in sharded[1:]:
        a, b = s.shard_over[first], s.shard_over[state]
        if a == b:
            continue
        span = s.spans.get(f"shard.{state}") or s.spans.get("shard")
        draft.report.error(span, f"{first} is sharded over {a} and {state} over {b}: every sharded state "
                                 f"must be sharded over one group ({_why_one(s, first, state)})",
                           hint=f"shard {', '.join(sharded)} over {a}" + _hpz_hint(a, sharded))
        return False
    return True


def _hpz_hint(group: str, sharded: list[str]) -> str:
    """Where parameters are sharded: how ZeRO++'s hpZ keeps the backward's gathers within a node."""
    if "parameters" not in sharded:
        return ""
    if group == "all":
        return "; `secondary parameters over node` keeps the backward's gathers within a node (ZeRO++'s hpZ)"
    return ", or over all with `secondary parameters over node` (ZeRO++'s hpZ)"


def _why_one(s, first: str, later: str) -> str:
    """Why ``first`` and ``later`` (in ZeRO's order) cannot have their two groups."""
    a = group_size(s.shard_over[first], s.ranks, s.per_node)
    b = group_size(s.shard_over[later], s.ranks, s.per_node)
    if a == b:
        return "the two name the same ranks; write them the same way"
    if b > a:      # e.g. the optimizer within a node, gradients over all
        return (f"a rank's {first} shard, 1/{a} of each unit, covers elements whose {later} it does "
                f"not hold, sharded 1/{b}")
    return (f"a rank's step updates 1/{a} of each unit and its {later} shard holds 1/{b}: the rest would "
            f"come from the other replicas by an all-gather after every step, which the compiler does not build")


def _group_tiles(draft: Draft, state: str, group: str) -> None:
    """A shard group whose size divides the ranks and fits the nodes."""
    s = draft.schedule
    span = s.spans.get(f"shard.{state}") or s.spans.get("shard")
    size = group_size(group, s.ranks, s.per_node)
    if group == "node" and s.per_node is None:
        draft.report.warn(span, f"the {s.ranks} ranks are all on one node (the ranks statement says no "
                                f"`per node`), so `over node` shards over every rank, as `over all`",
                          hint=f"ranks {s.ranks}{_on(s)}, P per node")
    if size > s.ranks or s.ranks % size:
        draft.report.error(span, f"{group} does not divide the {s.ranks} ranks into groups",
                           hint=f"over group({_divisors_text(s.ranks, size)})")
        return
    p = s.per_node
    if p is not None and size % p and p % size:
        fits = sorted({k for k in range(1, s.ranks + 1) if s.ranks % k == 0 and (p % k == 0 or k % p == 0)})
        draft.report.error(span, f"{group} would straddle nodes of {p} ranks: a group divides the ranks "
                                 f"per node or holds whole nodes",
                           hint="over group(K) with K one of " + ", ".join(map(str, fits)))
        return
    if size == 1 and s.ranks > 1:
        draft.report.warn(span, f"{group} holds one rank here, so nothing is sharded: every rank holds whole "
                                f"states and still reduce-scatters and all-reduces them",
                          hint="zero 0 (plain data parallelism) moves less; or shard over more ranks")


def _secondary_fits(draft: Draft) -> None:
    """hpZ: zero 3, with the parameters' shard group spanning more than one node."""
    s = draft.schedule
    span = s.spans.get("secondary")
    if s.stage < 3:
        draft.report.error(span, f"a secondary shard of the parameters needs sharded parameters "
                                 f"(this is zero {s.stage})",
                           hint="zero 3, or shard optimizer, gradients, parameters")
        return
    if s.per_node is None:
        draft.report.error(span, "with every rank on one node the parameters' shard is already node-local: "
                                 "the secondary shard would be the primary one",
                           hint=f"say how ranks group into nodes: ranks {s.ranks}{_on(s)}, P per node")
        return
    size = group_size(s.shard_over["parameters"], s.ranks, s.per_node)
    if size <= s.per_node:
        draft.report.error(span, f"the parameters are sharded over {s.shard_over['parameters']} "
                                 f"({size} ranks), within a node of {s.per_node} already: the secondary "
                                 f"shard would be the primary one",
                           hint="remove `secondary`, or shard the parameters over all (ZeRO++'s hpZ)")


def _divisors_text(n: int, near: int) -> str:
    """The divisors of ``n`` closest to ``near``, as a hint: ``4 or 8``."""
    divisors = sorted((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), d))[:2]
    return " or ".join(str(d) for d in sorted(divisors))


def _on(s) -> str:
    """`` on cuda`` as the ranks statement reads, where a device was named."""
    return "" if s.device == "auto" else f" on {s.device}"
