"""Checking the pipelines level: ``forward unit u { gather parameters[u+1] ... }``.

Each statement is a verb acting on a buffer reference (``parameters[u+2]``)
or on a unit (``compute u``). The checker resolves names (verbs, states,
tiers, the unit variable), enforces which verb takes which state and tier,
and which verbs belong in which phase, and builds the contract's
:class:`~zdsl.schedule.Pipeline`. Dependencies are never written: the
lowering derives them from what each op reads and writes.
"""
from __future__ import annotations

from zdsl.check.draft import Draft
from zdsl.lang import ast
from zdsl.lang.errors import did_you_mean
from zdsl.schedule import Pipeline, PipeStmt, Ref

UNIT_VERBS = ("compute", "recompute", "step")
BUFFER_VERBS = ("gather", "scatter", "reduce", "read", "write", "copy", "free")
VERBS = BUFFER_VERBS + UNIT_VERBS
REF_STATES = ("parameters", "gradients", "optimizer", "activations")
UNIT_STATE = "units"   # Ref.state of compute/recompute/step, as zdsl.compile.lower writes it

# verb -> states it may act on (None: any)
VERB_STATES = {"gather": ("parameters",), "scatter": ("gradients",), "reduce": ("gradients",)}
# verb -> (preposition, tiers) it requires (step: optional)
VERB_TIERS = {"read": ("from", ("nvme",)), "write": ("to", ("nvme",)),
              "copy": ("to", ("host", "device")), "step": ("on", ("cpu", "device"))}
# verb -> phases it may appear in
VERB_PHASES = {"compute": ("forward", "backward"), "recompute": ("backward",),
               "step": ("backward", "step")}
EXAMPLES = {"gather": "gather parameters[u+1]", "scatter": "scatter gradients[u]",
            "reduce": "reduce gradients[u]", "read": "read parameters[u+2] from nvme",
            "write": "write optimizer[u] to nvme", "copy": "copy parameters[u+1] to device",
            "free": "free parameters[u]", "compute": "compute u", "recompute": "recompute u",
            "step": "step u on cpu"}


def check_pipeline(draft: Draft, st: ast.PipelineStmt) -> None:
    """Check one ``PHASE unit VAR { ... }`` block and store it in the schedule."""
    var = st.var.value
    body: list[PipeStmt] = []
    for line in st.body:
        stmt = _statement(draft, st.keyword, var, line)
        if stmt is not None:
            body.append(stmt)
    draft.span(st.keyword, st.span)
    if not draft.report.failed:
        draft.schedule.pipelines[st.keyword] = Pipeline(st.keyword, var, body, st.span)


def check_pipelines_complete(draft: Draft, pipelines: list[ast.PipelineStmt]) -> None:
    """Written pipelines replace the lowering, so they must compute and step."""
    report = draft.report
    phases = {p.keyword: p for p in pipelines}
    anchor = pipelines[0].key_span
    for phase in ("forward", "backward"):
        if phase not in phases:
            report.error(anchor, f"pipelines are written but there is no {phase} pipeline",
                         hint=f"add `{phase} unit u {{ ... compute u ... }}`")
    verbs = {(p.keyword, line.verb.value) for p in pipelines for line in p.body}
    for phase in ("forward", "backward"):
        if phase in phases and (phase, "compute") not in verbs:
            report.error(phases[phase].key_span, f"the {phase} pipeline never computes",
                         hint="add `compute u`")
    if not any(v == "step" for _, v in verbs):
        report.error(anchor, "no pipeline steps the optimizer",
                     hint="add `step unit u { step u }`")


def _statement(draft: Draft, phase: str, var: str, line: ast.PipeLine) -> PipeStmt | None:
    report = draft.report
    verb = line.verb.value
    if verb not in VERBS:
        report.error(line.verb.span, f"unknown verb {verb!r}",
                     hint=did_you_mean(verb, VERBS, what="verbs are"))
        return None
    if verb in VERB_PHASES and phase not in VERB_PHASES[verb]:
        report.error(line.verb.span, f"{verb} does not belong in the {phase} pipeline",
                     hint=f"{verb} goes in " + " or ".join(VERB_PHASES[verb]))
        return None
    target = line.target
    if verb in UNIT_VERBS:
        if target.state is not None:
            report.error(target.span, f"{verb} takes a unit, not a buffer",
                         hint=f"write {EXAMPLES[verb]}")
            return None
        state = UNIT_STATE
    else:
        if target.state is None:
            report.error(target.span, f"{verb} needs a state and a unit",
                         hint=f"write {EXAMPLES[verb]}")
            return None
        state = target.state.value
        allowed = VERB_STATES.get(verb, REF_STATES)
        if state not in REF_STATES:
            report.error(target.state.span, f"unknown state {state!r}",
                         hint=did_you_mean(state, REF_STATES, what="states are"))
            return None
        if state not in allowed:
            report.error(target.state.span, f"{verb} acts on {allowed[0]}, not {state}",
                         hint=f"write {EXAMPLES[verb]}")
            return None
    ref = _ref(draft, state, var, target.index)
    tier = _tier(draft, verb, line)
    if ref is None or tier is False:
        return None
    return PipeStmt(verb, ref, tier or None, line.span)


def _ref(draft: Draft, state: str, var: str, index: ast.Index) -> Ref | None:
    report = draft.report
    if index.var is not None and index.var.value != var:
        report.error(index.var.span, f"unknown unit variable {index.var.value!r}",
                     hint=f"this pipeline's unit is {var!r}")
        return None
    if index.absolute is not None:
        units = draft.units
        if units is not None and index.absolute >= len(units):
            report.error(index.span, f"unit {index.absolute} is beyond the model "
                                     f"(units 0..{len(units) - 1})")
            return None
        return Ref(state, 0, index.absolute)
    return Ref(state, index.offset)


def _tier(draft: Draft, verb: str, line: ast.PipeLine):
    """The statement's tier (None if it has none); False after an error."""
    report = draft.report
    rule = VERB_TIERS.get(verb)
    if rule is None:
        if line.prep is not None:
            report.error(line.prep.span, f"{verb} takes no '{line.prep.value}'",
                         hint=f"write {EXAMPLES[verb]}")
            return False
        return None
    prep, tiers = rule
    if line.prep is None:
        if verb == "step":
            return None
        report.error(line.target.span, f"{verb} needs '{prep} " + "|".join(tiers) + "'",
                     hint=f"write {EXAMPLES[verb]}")
        return False
    if line.prep.value != prep:
        report.error(line.prep.span, f"{verb} takes '{prep}', not '{line.prep.value}'",
                     hint=f"write {EXAMPLES[verb]}")
        return False
    if line.tier is None:           # the grammar writes a tier after each preposition
        return False
    tier = line.tier.value
    if tier not in tiers:
        report.error(line.tier.span, f"{verb} {prep} {tier!r}: expected " + " or ".join(tiers),
                     hint=did_you_mean(tier, tiers) or f"write {EXAMPLES[verb]}")
        return False
    if verb == "step" and tier == "device":
        return None
    return tier
