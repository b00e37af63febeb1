"""Checking where the schedule runs: ``ranks N on DEVICE`` and ``machine cpu|cuda(...)``, the
rates the planner's cost model uses (``zdsl calibrate`` writes them)."""
from __future__ import annotations

from zdsl.check.draft import Draft
from zdsl.lang import ast
from zdsl.lang.overrides import MACHINE_KEYS
from zdsl.machine_profile import MACHINE_MAY_BE_ZERO, MACHINE_OPTIONS, MACHINE_TUPLES, MachineProfile
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
    values = {}
    for key, arg in given.items():
        value = _rate(draft, key, arg.value)
        if value is not None:
            values[MACHINE_FIELDS[key]] = value
            draft.span(f"machine.{key}", arg.span)
    profile = (CUDA_PROFILE if base == "cuda" else CPU_PROFILE).with_fields(**values)
    _tables(draft, profile, given)
    draft.schedule.machine = profile


def _rate(draft: Draft, key: str, v):
    """One option's value (None after an error): rates must be > 0; a fixed cost per op may be 0,
    cores 0 turns sharing off, and the per-collective and host rates 0 mean "not given" (derived
    from the others)."""
    report = draft.report
    if key == "comm_slots":     # a count of the backend's threads, not a rate
        return report.integer(v, key, 1, 1024)
    if key in ("disk_ranks", "compute_ranks"):   # a count of ranks; 0: unknown
        return report.integer(v, key, 0, MAX_RANKS)
    if key in MACHINE_TUPLES:
        return _rates(draft, v, key)
    if key == "comm_under_load":  # a share of a collective's rate
        return report.real(v, key, 0.0, 1.0)
    return report.real(v, key, 0.0, None, lo_open=key not in MACHINE_MAY_BE_ZERO)


def _rates(draft: Draft, v, key: str) -> tuple[float, ...] | None:
    """``flops_widths=(64, 512, 2048)``, ``flops_bf16=(...)``: numbers > 0 (one: a 1-tuple)."""
    items = v.items if isinstance(v, ast.Tuple) else [v]
    values = [draft.report.real(x, f"each of {key}", 0.0, None, lo_open=True) for x in items]
    return None if None in values else tuple(values)


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
    """Without a ``machine`` statement a CUDA schedule is planned with CUDA's rates."""
    if not has_machine and draft.schedule.device == "cuda":
        draft.schedule.machine = CUDA_PROFILE.with_fields()
