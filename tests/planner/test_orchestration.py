"""The serving loop's host work (CPU ranks): per stage and, by the driver, per microbatch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opweave.costmodel import (
    OrchestrationProfile,
    Profile,
    canonical_plan,
    segments,
)
from opweave.planner import NO_HOST, HostModel, simulate_plan
from tests.planner.conftest import random_profile, toy_gpu

LOOP = OrchestrationProfile(
    stage_s=40e-6, stage_per_request_s=3e-6, drive_s=90e-6, drive_per_request_s=11e-6
)


def _profiles(model, seed: int) -> tuple[Profile, Profile]:
    base = random_profile(np.random.default_rng(seed), model, toy_gpu("cpu", gpus_per_node=2))
    return base, base.model_copy(update={"orchestration": LOOP})


def test_affine_in_requests() -> None:
    assert LOOP.stage(4) == pytest.approx(40e-6 + 4 * 3e-6)
    assert LOOP.drive(8) == pytest.approx(90e-6 + 8 * 11e-6)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        OrchestrationProfile(drive_s=-1e-6)


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_colocated_pays_the_loop_once_per_microbatch(tiny_llama, microbatches) -> None:
    """One rank runs every microbatch's one stage and drives it: M (stage(u) + drive(u))."""
    plain, looped = _profiles(tiny_llama, 1)
    plan = canonical_plan(tiny_llama, "colocated", gpu="cpu", batch=8, microbatches=microbatches)
    a = simulate_plan(plan, tiny_llama, profiles=[plain])
    b = simulate_plan(plan, tiny_llama, profiles=[looped])
    u = 8 / microbatches
    assert b.tpot_s - a.tpot_s == pytest.approx(microbatches * (LOOP.stage(u) + LOOP.drive(u)))


@pytest.mark.parametrize("strategy", ["afd", "cad"])
def test_one_microbatch_pays_every_stage_and_the_driver(tiny_llama, strategy) -> None:
    """With one microbatch the period is the token's path: every segment's loop work plus the
    driver's, which handles the whole global batch."""
    plain, looped = _profiles(tiny_llama, 2)
    plan = canonical_plan(tiny_llama, strategy, gpu="cpu", batch=4, microbatches=1)
    a = simulate_plan(plan, tiny_llama, profiles=[plain])
    b = simulate_plan(plan, tiny_llama, profiles=[looped])
    segs = segments(tiny_llama, plan.template, len(plan.owners))
    global_batch = math.lcm(*(o.resident_batch for o in plan.owners))
    batch_of = [plan.owners[s.owner].resident_batch for s in segs]
    expected = sum(LOOP.stage(b) for b in batch_of) + LOOP.drive(global_batch)
    assert len(segs) > 2
    assert b.tpot_s - a.tpot_s == pytest.approx(expected, rel=1e-9)


def test_gpus_and_old_profiles_have_no_loop_cost(tiny_llama) -> None:
    plain, _ = _profiles(tiny_llama, 3)
    old = Profile.model_validate_json(
        plain.model_dump_json(exclude={"orchestration", "idle_slowdown"})
    )
    assert old.orchestration is None and old.idle_slowdown is None
    assert HostModel.of(old).orchestration is None
    assert HostModel.of(None) == NO_HOST  # a roofline device
    restored = Profile.model_validate_json(_profiles(tiny_llama, 3)[1].model_dump_json())
    assert restored.orchestration == LOOP
