"""The phases of one step in issue order: each template instantiated for every unit, and woven.

Contract: :func:`run_step_phases` issues, per micro-batch, the forward template for units
0..L-1 and the backward for L-1..0; the step template runs for L-1..0 after the last backward,
or woven into it. A statement whose unit lies ``e`` positions ahead in phase order also covers,
at the first position, the units it would never reach (a prologue); one that lies behind
covers the rest after the last position (an epilogue): :func:`phase_slots`.

Two of the step's three meanings of "ahead" are woven here (their relation, and which runs
first: :mod:`zdsl.compile.lower`'s docstring): the template offsets place each statement in a
slot (:func:`phase_slots`), and the last backward carries either every unit's step ``lag``
units behind it (:func:`run_backward_and_step`) or, where the step waits for the global norm,
the step's first ``read_ahead`` NVMe optimizer reads (:func:`run_backward_reading_ahead`).
"""
from __future__ import annotations

from zdsl.compile.compute_ops import norm
from zdsl.compile.emission import OpStream
from zdsl.compile.homes import UnitHomes
from zdsl.compile.lowering_error import LoweringError
from zdsl.compile.verbs import run_stmt
from zdsl.schedule import Pipeline, PipeStmt

Slots = list[list[tuple[PipeStmt, int]]]


def run_step_phases(stream: OpStream, pipelines: dict[str, Pipeline], read_ahead: int = 0) -> None:
    """Every micro-batch's forward and backward, and the step (woven into the last backward
    where nothing waits for every gradient first)."""
    homes = stream.homes
    last = homes.last_micro
    weaves_step = not homes.clip and homes.n_units > 1
    for micro in range(last + 1):
        run_phase(stream, pipelines["forward"], "forward", micro)
        if micro == last and weaves_step:
            run_backward_and_step(stream, pipelines["backward"], pipelines["step"], micro)
        elif micro == last and read_ahead:
            run_backward_reading_ahead(stream, pipelines["backward"], pipelines["step"], micro, read_ahead)
        else:
            run_phase(stream, pipelines["backward"], "backward", micro)
    if not weaves_step:
        run_phase(stream, pipelines["step"], "step", last)


def phase_slots(homes: UnitHomes, pipe: Pipeline, phase: str) -> Slots:
    """What one phase emits, in order: one slot of (statement, unit) per position in the
    phase's unit order, and a last slot for the statements that lag behind (epilogue)."""
    order = homes.order(phase)
    direction = 1 if phase == "forward" else -1
    n_units = homes.n_units
    slots: Slots = [[] for _ in range(n_units + 1)]
    for i in range(n_units):
        for stmt in pipe.body:
            if stmt.ref.absolute is not None:
                if i == 0:
                    slots[i].append((stmt, check_unit(homes, stmt.ref.absolute, stmt)))
                continue
            ahead = stmt.ref.offset * direction
            targets = range(0, ahead + 1) if (ahead > 0 and i == 0) else [i + ahead]
            for pos in targets:
                if 0 <= pos < n_units:
                    slots[i].append((stmt, order[pos]))
    for stmt in pipe.body:   # epilogue: statements that lag behind
        if stmt.ref.absolute is None:
            ahead = stmt.ref.offset * direction
            if ahead < 0:
                for pos in range(n_units + ahead, n_units):
                    if 0 <= pos < n_units:
                        slots[n_units].append((stmt, order[pos]))
    return slots


def check_unit(homes: UnitHomes, u: int, stmt: PipeStmt) -> int:
    if not 0 <= u < homes.n_units:
        raise LoweringError(f"unit {u} does not exist (the model has units 0..{homes.n_units - 1})", stmt)
    return u


def run_slot(stream: OpStream, slot: list[tuple[PipeStmt, int]], phase: str, micro: int) -> None:
    for stmt, u in slot:
        run_stmt(stream, stmt, u, phase, micro)


def run_phase(stream: OpStream, pipe: Pipeline, phase: str, micro: int) -> None:
    if phase == "step" and stream.homes.clip:
        norm(stream, micro)
    for slot in phase_slots(stream.homes, pipe, phase):
        run_slot(stream, slot, phase, micro)


def run_backward_and_step(stream: OpStream, backward: Pipeline, step: Pipeline, micro: int) -> None:
    """The last backward with each unit's step woven in, ``lag`` units behind it.

    Why: a unit's gradient is final once its backward (and reduction) is done, so its
    step need not wait for the whole backward; with offloaded optimizer state the
    reads, the host step and the writes then overlap the rest of the backward instead
    of forming one serial tail (the NVMe lane idle through the backward, then every
    read, step and write in a row; benchmarks/nvme_vs_host.py). The bits are those of stepping after the backward:
    each unit's step reads its own gradient. Only without clipping or fp16 loss scaling,
    whose global norm or overflow check needs every gradient first (``homes.clip``). A
    unit whose parameters another unit uses (a tied weight) steps only after that unit's
    backward; ``lag`` keeps the backward's own prefetches ahead of the step's writes on a
    shared lane.
    """
    homes = stream.homes
    n_units = homes.n_units
    backward_slots, step_slots = phase_slots(homes, backward, "backward"), phase_slots(homes, step, "step")
    after = step_positions(homes, lag=max(1, homes.schedule.prefetch))
    next_step = 0
    for i in range(n_units):
        run_slot(stream, backward_slots[i], "backward", micro)
        while next_step < n_units and after[next_step] <= i:
            run_slot(stream, step_slots[next_step], "step", micro)
            next_step += 1
    run_slot(stream, backward_slots[n_units], "backward", micro)
    for slot in step_slots[next_step:]:
        run_slot(stream, slot, "step", micro)


def step_positions(homes: UnitHomes, lag: int) -> list[int]:
    """Per step slot, the backward slot it may follow: its unit's last user, plus ``lag``; kept
    in order so the step's own offsets (read optimizer[u-k]) stay as written."""
    order = homes.order("backward")
    position = {u: i for i, u in enumerate(order)}
    last_user = [position[u] for u in range(homes.n_units)]   # unit -> backward position of its last user
    for user in range(homes.n_units):
        for used in homes.specs[user].uses:
            last_user[used] = max(last_user[used], position[user])
    after, ready = [], 0
    for i in range(homes.n_units):
        ready = max(ready, last_user[order[i]] + lag)
        after.append(min(ready, homes.n_units - 1))
    return after


def run_backward_reading_ahead(stream: OpStream, backward: Pipeline, step: Pipeline, micro: int,
                               read_ahead: int) -> None:
    """The last backward with the step's first ``read_ahead`` NVMe optimizer reads woven in,
    one after each unit's backward statements; the step finds those copies on the host.

    Why: with clipping or fp16 every unit's step waits for the global norm, after the whole
    backward, and the step's reads then queue on the one NVMe lane behind the writes of the
    units stepped before them, while the disk sat idle through the backward
    (benchmarks/capacity.py traces it). The host budget decides how many copies can wait there
    (:mod:`zdsl.compile.host_budget`).
    """
    homes = stream.homes
    first: dict[int, PipeStmt] = {}
    for slot in phase_slots(homes, step, "step"):
        for stmt, u in slot:
            if stmt.verb == "read" and stmt.ref.state == "optimizer" and stmt.tier in (None, "nvme"):
                first.setdefault(u, stmt)
    early = list(first.items())[:read_ahead]
    for i, slot in enumerate(phase_slots(homes, backward, "backward")):
        run_slot(stream, slot, "backward", micro)
        if i < len(early):
            u, stmt = early[i]
            run_stmt(stream, stmt, u, "step", micro)
