"""Checking where the schedule runs: ``ranks N on DEVICE``, ``machine cpu|cuda(...)``, the
rates the planner's cost model uses (``zdsl calibrate`` writes them), and ``link node=(RATE,
LATENCY), cluster=(RATE, LATENCY)``, the collectives' link per level (calibrate measures one
machine; the rate across nodes is the user's to give). A level's link is the ``machine``
keywords of :data:`~zdsl.machine_profile.LINK_LEVELS` or the ``link`` statement, never both;
either way its values are read and set by :func:`_set_options`."""
from __future__ import annotations

from zdsl.check.draft import Draft, where
from zdsl.check.values import describe
from zdsl.lang import ast
from zdsl.lang.errors import did_you_mean
from zdsl.lang.overrides import MACHINE_KEYS
from zdsl.machine_profile import (
    LINK_LEVELS,
    MACHINE_MAY_BE_ZERO,
    MACHINE_OPTIONS,
    MACHINE_TUPLES,
    MachineProfile,
    given_links,
)
from zdsl.schedule import DEVICES

# ``machine cpu(...)`` option -> MachineProfile wire field.
MACHINE_FIELDS = dict(MACHINE_OPTIONS)
CUDA_PROFILE = MachineProfile.of(name="cuda", flops=2e14, host_flops=5e10, link_bandwidth=1e11,
                                 link_latency=1e-5, pcie_bandwidth=2.5e10, disk_read=3e9,
                                 disk_write=2e9, memory_bandwidth=2e12, comm_slots=1)
CPU_PROFILE = MachineProfile()
MAX_RANKS = 1 << 16


def check_ranks(draft: Draft, st: ast.RanksStmt) -> None:
    draft.span("ranks", st.span)
    n = draft.report.integer(st.count, "ranks", 1, MAX_RANKS)
    if n is not None:
        draft.schedule.ranks = n
    if st.device is not None:
        device = draft.report.choice(st.device, "device", DEVICES)
        if device is not None:
            draft.schedule.device = device
            draft.span("device", st.device.span)


def check_machine(draft: Draft, st: ast.CallStmt) -> None:
    draft.span("machine", st.span)
    report, call = draft.report, st.call
    base = report.choice(call.callee, "machine", ("cpu", "cuda"))
    if base is None:
        return
    given = report.keywords(call.args, MACHINE_KEYS, f"machine {base}")
    values = _set_options(draft, [(key, arg.value, arg.span, key) for key, arg in given.items()], "machine")
    profile = (CUDA_PROFILE if base == "cuda" else CPU_PROFILE).with_fields(**values)
    _tables(draft, profile, given)
    draft.schedule.machine = profile


def check_link(draft: Draft, st: ast.LinkStmt) -> None:
    """``link node=(RATE, LATENCY), cluster=(RATE, LATENCY)``: set on the schedule's profile (its
    ``machine`` statement's, else the device's defaults; this machine's calibrated profile gets
    them too, ``given_links``). Checked after ``machine``, so a level given there is known."""
    draft.span("link", st.span)
    for arg in st.args:
        level = _level(draft, arg)
        pair = None if level is None else _rate_and_latency(draft, arg, level)
        if level is None or pair is None or _given_before(draft, arg, level):
            continue
        draft.span(f"link.{level}", arg.span)
        before = len(draft.report.diagnostics)
        values = _set_options(draft, [(key, value, arg.span, f"link {level}'s {part}")
                                      for key, value, part in zip(LINK_LEVELS[level], pair, ("rate", "latency"))], None)
        for diag in draft.report.diagnostics[before:]:
            diag.hint = diag.hint or f"{level}=(2.5e10, 2e-5): bytes a second each rank moves, seconds per collective"
        draft.schedule.machine = draft.schedule.machine.with_fields(**values)


def _given_before(draft: Draft, arg: ast.Arg, level: str) -> bool:
    """Whether ``level`` was given already, by a ``link`` statement or the ``machine`` keywords
    (an error here naming both)."""
    spans, keys = draft.schedule.spans, LINK_LEVELS[level]
    machine_keys = [k for k in keys if f"machine.{k}" in spans]
    earlier = spans.get(f"link.{level}") or (spans[f"machine.{machine_keys[0]}"] if machine_keys else None)
    if earlier is None:
        return False
    written = "an earlier link statement" if f"link.{level}" in spans else \
        f"the machine statement's {' and '.join(machine_keys)}"
    draft.report.error(arg.key.span if arg.key else arg.span,
                       f"the {level} link is given twice: here and at {where(earlier)} ({written})",
                       hint=f"keep one: `link {level}=(RATE, LATENCY)` or the machine statement's "
                            f"{'=, '.join(keys)}=")
    return True


def _level(draft: Draft, arg: ast.Arg) -> str | None:
    """The level ``arg`` names (None after an error)."""
    if arg.key is None:
        draft.report.error(arg.span, f"link takes LEVEL=(RATE, LATENCY), not a bare {describe(arg.value)}",
                           hint="link node=(3e11, 1e-5), cluster=(2.5e10, 2e-5)")
        return None
    if arg.key.value not in LINK_LEVELS:
        draft.report.error(arg.key.span, f"link has no level {arg.key.value!r}",
                           hint=did_you_mean(arg.key.value, list(LINK_LEVELS), what="levels are"))
        return None
    return arg.key.value


def _rate_and_latency(draft: Draft, arg: ast.Arg, level: str) -> tuple[ast.Value, ast.Value] | None:
    """``(RATE, LATENCY)``: bytes a second each rank moves, seconds per collective."""
    items = arg.value.items if isinstance(arg.value, ast.Tuple) else [arg.value]
    if len(items) == 2:
        return items[0], items[1]
    rate = describe(items[0]) if len(items) == 1 else "RATE"
    problem = "needs a latency too" if len(items) == 1 else f"takes two values, not {len(items)}"
    draft.report.error(arg.value.span, f"link {level} {problem}: (RATE, LATENCY), bytes a second and seconds",
                       hint=f"{level}=({rate}, 1e-5)")
    return None


def _set_options(draft: Draft, options: list, statement: str | None) -> dict:
    """The wire fields of ``options`` (``machine`` keyword, value, span, what a message calls it),
    each read by :func:`_rate`, those with an error left out; ``statement``: keep each one's span
    as ``STATEMENT.KEY``."""
    values = {}
    for key, value, span, what in options:
        read = _rate(draft, key, value, what)
        if read is not None:
            values[MACHINE_FIELDS[key]] = read
            if statement is not None:
                draft.span(f"{statement}.{key}", span)
    return values


def _rate(draft: Draft, key: str, v, what: str):
    """One option's value (None after an error): rates must be > 0; a fixed cost per op may be 0,
    cores 0 turns sharing off, and the per-collective and host rates 0 mean "not given" (derived
    from the others). ``what``: the option as messages name it."""
    report = draft.report
    if key == "comm_slots":     # a count of the backend's threads, not a rate
        return report.integer(v, what, 1, 1024)
    if key in ("disk_ranks", "compute_ranks"):   # a count of ranks; 0: unknown
        return report.integer(v, what, 0, MAX_RANKS)
    if key in MACHINE_TUPLES:
        return _rates(draft, v, key)
    if key == "comm_under_load":  # a share of a collective's rate
        return report.real(v, what, 0.0, 1.0)
    return report.real(v, what, 0.0, None, lo_open=key not in MACHINE_MAY_BE_ZERO)


def _rates(draft: Draft, v, key: str) -> tuple[float, ...] | None:
    """``flops_widths=(64, 512, 2048)``, ``flops_bf16=(...)``: numbers > 0 (one: a 1-tuple)."""
    items = v.items if isinstance(v, ast.Tuple) else [v]
    values = [draft.report.real(x, f"each of {key}", 0.0, None, lo_open=True) for x in items]
    rates = [v for v in values if v is not None]
    return tuple(rates) if len(rates) == len(values) else None


def _tables(draft: Draft, profile: MachineProfile, given: dict) -> None:
    """The per-precision rates have one number per ``flops_widths``, which increase."""
    report, widths = draft.report, profile.compute.widths
    if "flops_widths" in given and any(b <= a for a, b in zip(widths, widths[1:])):
        report.error(given["flops_widths"].value.span, "flops_widths must increase, "
                     f"not {', '.join(f'{w:g}' for w in widths)}", hint="flops_widths=(64, 512, 2048)")
    for key in MACHINE_TUPLES[1:]:
        rates = profile.value(key)
        if key in given and rates and len(rates) != len(widths):
            report.error(given[key].value.span,
                         f"{key} has {len(rates)} rate(s) for {len(widths)} flops_widths: one per width",
                         hint=f"flops_widths=(64, 512), {key}=(7e10, 2e11)")


def machine_for_device(draft: Draft, has_machine: bool) -> None:
    """Without a ``machine`` statement a CUDA schedule is planned with CUDA's rates (and the
    ``link`` statement's)."""
    if not has_machine and draft.schedule.device == "cuda":
        draft.schedule.machine = CUDA_PROFILE.with_fields(**given_links(draft.schedule))
