"""A profile's tables hold medians; its stall overhead scales every operator latency looked up
from it, so a rank's expected time is what stalls make it."""

from __future__ import annotations

import numpy as np
import pytest

from opweave.costmodel import Profile, ProfiledLatency, canonical_plan, estimate_step
from opweave.planner import simulate_plan
from tests.planner.conftest import random_profile, toy_gpu


def _profiles(model, overhead: float) -> tuple[Profile, Profile]:
    base = random_profile(np.random.default_rng(7), model, toy_gpu("cpu", gpus_per_node=2))
    return base, base.model_copy(update={"stall_overhead": overhead})


def test_lookups_are_the_median_times_one_plus_the_overhead(tiny_llama) -> None:
    plain, stalled = _profiles(tiny_llama, 0.08)
    layer = tiny_llama.layers[0]
    for op in layer.ops:
        a = ProfiledLatency(plain).op_latency_s(tiny_llama, op, layer, 1, 4.0, 100.0)
        b = ProfiledLatency(stalled).op_latency_s(tiny_llama, op, layer, 1, 4.0, 100.0)
        assert b == pytest.approx(1.08 * a, rel=1e-12)


def test_a_colocated_rank_takes_that_much_longer(tiny_llama) -> None:
    """A colocated plan's iteration is its operators alone (no transfers, no host work in
    this profile), so its TPOT scales exactly; estimates scale with it."""
    plain, stalled = _profiles(tiny_llama, 0.1)
    plan = canonical_plan(tiny_llama, "colocated", gpu="cpu", batch=8, microbatches=2)
    a = simulate_plan(plan, tiny_llama, profiles=[plain]).tpot_s
    b = simulate_plan(plan, tiny_llama, profiles=[stalled]).tpot_s
    assert b == pytest.approx(1.1 * a, rel=1e-9)
    ea, eb = (
        estimate_step(tiny_llama, p.device, tp=1, batch=8, context=100, latency=ProfiledLatency(p))
        for p in (plain, stalled)
    )
    assert eb.step_latency_s == pytest.approx(1.1 * ea.step_latency_s, rel=1e-9)


def test_profiles_without_it_load_unchanged(tiny_llama) -> None:
    plain, _ = _profiles(tiny_llama, 0.0)
    doc = plain.model_dump(mode="json")
    del doc["stall_overhead"]
    assert Profile.model_validate(doc).stall_overhead == 0.0
    doc["stall_overhead"] = -0.1
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        Profile.model_validate(doc)
