"""fp16 against a reference that does the same fp16 arithmetic, and the loss scaler on its own.

The reference (``ddp_reference.fp16_train``) is DDP over an fp16 copy of the GPT with an fp32
master copy, a loss scale, an overflow check that skips the step and halves the scale, unscaling
into fp32 gradients, ``clip_grad_norm_`` and the torch optimizer: the recipe zdsl's fp16 claims
to be. Where nothing depends on how the global norm is summed, the runs must agree to the bit:
the forward, the scaled backward and DDP's averaging are the same fp16 operations, and
unscaling multiplies by a power of two (exact). The reported ``grad_norm`` is a sum of squares
taken in another order (zdsl: per flat buffer, from the scaled fp16 gradients; the reference:
per parameter, from the unscaled fp32 ones), so it agrees to float32 rounding (1e-5 relative
here); where clipping is active that norm sets the coefficient, so the parameters agree to
about the same relative error (stated per case below). Each bound is orders of magnitude below
what a mistake in the scale makes: gradients left scaled are 65,536x too large (SGD moves every
parameter by 65,536 times its step), a norm left scaled is off by 65,536x.

Also: the loss scale grows after ``growth_interval`` clean steps and backs off on an overflow
(a run started at 2**20 overflows three times), in step with the reference.
"""
from __future__ import annotations

import math

import pytest
import torch

from ddp_reference import fp16_train, run_steps, spawn
from test_state_vs_ddp import BATCH, MODEL, STEPS, make_schedule

from zdsl.runtime.state.precision import LossScaler

pytestmark = pytest.mark.slow     # spawns ranks: deselect with -m 'not slow'

SGD = dict(kind="sgd", momentum=0.9)


def zdsl_fp16(schedule, rank: int, world: int, scale: float, growth_interval: int):
    """The real runtime (trio executor) on an fp16 schedule, with the scaler's start set."""
    from zdsl.driver import compile_schedule
    from zdsl.runtime.models.gpt import GPT
    from zdsl.runtime.state.rank import RankState
    from zdsl.model.units import gpt_units

    graph = compile_schedule(schedule, gpt_units(**MODEL))
    state = RankState(graph, GPT(**MODEL, seed=schedule.train.seed), rank, world, device="cpu")
    state.scaler.scale, state.scaler.growth_interval = scale, growth_interval
    rows = run_steps(graph, state, schedule, rank, world)
    return state.export_state(), rows


def run_case(rank: int, world: int, case: dict) -> dict:
    case = dict(case)
    scale, growth = case.pop("scale", 2.0 ** 16), case.pop("growth_interval", 2000)
    schedule = make_schedule(world, precision="fp16", **case)
    mine, rows = zdsl_fp16(schedule, rank, world, scale, growth)
    t = schedule.train
    ref, ref_rows = fp16_train(MODEL, schedule.data, seed=t.seed, steps=STEPS, batch=BATCH, accumulate=t.accumulate,
                               optimizer=schedule.to_config()["optimizer"], rank=rank, world=world, scale=scale,
                               growth_interval=growth)
    return dict(mine=mine, rows=rows, ref=ref, ref_rows=ref_rows)


def run_cases(rank: int, world: int, cases: dict) -> dict:
    return {name: run_case(rank, world, case) for name, case in cases.items()}


# name: schedule settings (plus the scaler's start); clip 1e6 never clips but reports the norm
BITWISE = {
    "stage0_adamw": dict(stage=0),
    "stage0_sgd": dict(stage=0, **SGD),
    "stage1_adamw_accumulate": dict(stage=1, accumulate=2),
    "stage1_sgd_accumulate": dict(stage=1, accumulate=2, **SGD),
    "stage2_sgd": dict(stage=2, **SGD),
    "stage3_adamw": dict(stage=3),
    "stage3_sgd_clip_inactive": dict(stage=3, clip=1e6, **SGD),
    "stage0_sgd_scale_grows": dict(stage=0, growth_interval=2, **SGD),
    "stage2_adamw_backoff": dict(stage=2, scale=2.0 ** 20),   # overflows 3 times, then trains
}
# Clipping active (0.5 is below every step's norm): the coefficient comes from the norm, whose
# last bits differ, and an fp16 parameter one rounding apart moves the next forward. How far the
# runs drift apart depends on the CPU's kernels: measured with AVX2 / AVX512 kernels, SGD's update
# differs by 5e-6 / 1.6e-5 relative at most, AdamW's (which turns a rounding-level difference of a
# near-zero gradient into a visible fraction of lr) by 1.2e-3 / 1.2e-2, later steps' norms by
# 5.5e-5 / 6.7e-4, losses by 2.3e-7. A scale mistake gives an update off by 65,535x (gradients left
# scaled) or by about 1x (a norm left scaled: every step clipped to nothing), a norm off by 65,536x.
UPDATE_BOUND = {"sgd": 1e-4, "adamw": 5e-2}
LATER_NORM_TOLERANCE = 5e-3
CLIPPED = {
    "stage0_sgd_clip": dict(stage=0, clip=0.5, **SGD),
    "stage3_sgd_clip": dict(stage=3, clip=0.5, **SGD),
    "stage2_adamw_clip": dict(stage=2, clip=0.5),
}


@pytest.fixture(scope="module")
def results():
    return spawn(run_cases, 2, {**BITWISE, **CLIPPED})


def max_rel(mine: dict, ref: dict) -> float:
    return max(float((mine[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref)


def check_steps(rows: list[dict], ref_rows: list[dict], exact: bool = True) -> None:
    """Per step: loss, skipped, loss scale; the gradient norm to float32 rounding (the first step,
    from the same parameters, always; later ones within :data:`LATER_NORM_TOLERANCE` when clipping
    moved them apart)."""
    assert [r["skipped"] for r in rows] == [r["skipped"] for r in ref_rows]
    assert [r["loss_scale"] for r in rows] == [r["loss_scale"] for r in ref_rows]
    for step, (r, q) in enumerate(zip(rows, ref_rows)):
        if exact:
            assert r["loss"] == q["loss"], f"step {step}: loss {r['loss']}, the reference's {q['loss']}"
        else:
            assert math.isclose(r["loss"], q["loss"], rel_tol=1e-4), f"step {step}: loss {r['loss']} {q['loss']}"
        if not q["skipped"]:
            tol = 1e-5 if exact or step == 0 else LATER_NORM_TOLERANCE
            assert math.isclose(r["grad_norm"], q["grad_norm"], rel_tol=tol), \
                f"step {step}: grad_norm {r['grad_norm']}, the reference's {q['grad_norm']}"


def update_rel(mine: dict, ref: dict) -> float:
    """||update_zdsl - update_ref|| / ||update_ref||, from the initial parameters."""
    from zdsl.runtime.models.gpt import GPT
    init = {n: p.detach() for n, p in GPT(**MODEL, seed=0).named_parameters()}
    dz = torch.cat([(mine[k] - init[k]).flatten() for k in init])
    dr = torch.cat([(ref[k] - init[k]).flatten() for k in init])
    return float((dz - dr).norm() / dr.norm())


@pytest.mark.parametrize("name", sorted(BITWISE))
def test_fp16_equals_the_fp16_reference(results, name):
    for rank, by_case in enumerate(results):
        r = by_case[name]
        bad = [k for k in r["ref"] if not torch.equal(r["mine"][k], r["ref"][k])]
        assert not bad, f"rank {rank}: {bad[:3]} differ, max rel {max_rel(r['mine'], r['ref']):.3g}"
        check_steps(r["rows"], r["ref_rows"])


@pytest.mark.parametrize("name", sorted(CLIPPED))
def test_fp16_clipped_close_to_the_fp16_reference(results, name):
    for rank, by_case in enumerate(results):
        r = by_case[name]
        check_steps(r["rows"], r["ref_rows"], exact=False)
        assert all(q["grad_norm"] > 0.5 for q in r["ref_rows"] if not q["skipped"]), "clipping must be active"
        bound = UPDATE_BOUND[CLIPPED[name].get("kind", "adamw")]
        assert update_rel(r["mine"], r["ref"]) < bound, f"rank {rank}"


def test_the_cases_exercise_the_scaler(results):
    """The growth case grows, the backoff case skips steps and halves: else they test nothing."""
    rows = results[0]
    grows = [r["loss_scale"] for r in rows["stage0_sgd_scale_grows"]["rows"]]
    assert grows[-1] > grows[0]
    backoff = rows["stage2_adamw_backoff"]["rows"]
    assert backoff[0]["skipped"] and backoff[-1]["loss_scale"] < 2.0 ** 24
    assert not backoff[-1]["skipped"]


# ---------------------------------------------------------------- the scaler alone

def test_scaler_grows_after_growth_interval_clean_steps():
    s = LossScaler(enabled=True, scale=1024.0, growth_interval=3)
    scales = []
    for _ in range(7):
        s.update(overflow=False)
        scales.append(s.scale)
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0, 4096.0]


def test_scaler_backs_off_and_an_overflow_restarts_the_interval():
    s = LossScaler(enabled=True, scale=1024.0, growth_interval=2)
    s.update(overflow=False)
    s.update(overflow=True)            # halves, and the clean step before it no longer counts
    assert s.scale == 512.0 and s.overflows == 1
    s.update(overflow=False)
    assert s.scale == 512.0
    s.update(overflow=False)
    assert s.scale == 1024.0


def test_scaler_never_goes_below_its_floor():
    s = LossScaler(enabled=True, scale=4.0)
    for _ in range(5):
        s.update(overflow=True)
    assert s.scale == s.min_scale == 1.0 and s.overflows == 5


def test_scaler_disabled_stays_at_one():
    s = LossScaler(enabled=False, growth_interval=1)
    for overflow in (False, True, False):
        s.update(overflow)
    assert s.scale == 1.0 and s.overflows == 0
