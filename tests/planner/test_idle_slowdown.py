"""Operators slow down after their rank idled: the schedule and the durations at a fixed point."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opweave.costmodel import IdleSlowdown, canonical_plan, segments
from opweave.planner import simulate_plan
from tests.planner.conftest import random_profile, toy_gpu

COLD = IdleSlowdown(s_per_byte=50e-12, time_constant_s=4e-3)


def _profiles(model, seed: int, cold: IdleSlowdown = COLD):
    base = random_profile(np.random.default_rng(seed), model, toy_gpu("cpu", gpus_per_node=2))
    return base, base.model_copy(update={"idle_slowdown": cold})


def test_the_curve() -> None:
    assert COLD.extra_s(1e6, 0.0) == 0.0 and COLD.extra_s(1e6, -1.0) == 0.0
    assert COLD.extra_s(1e6, 4e-3) == pytest.approx(1e6 * 50e-12 * (1 - math.exp(-1)))
    assert COLD.extra_s(2e6, 10.0) == pytest.approx(2e6 * 50e-12)
    with pytest.raises(ValueError, match="greater than 0"):
        IdleSlowdown(s_per_byte=1e-12, time_constant_s=0.0)


def test_a_rank_that_never_waits_is_not_slowed(tiny_llama) -> None:
    plain, cold = _profiles(tiny_llama, 1)
    plan = canonical_plan(tiny_llama, "colocated", gpu="cpu", batch=8, microbatches=2)
    a = simulate_plan(plan, tiny_llama, profiles=[plain])
    b = simulate_plan(plan, tiny_llama, profiles=[cold])
    assert b.tpot_s == pytest.approx(a.tpot_s, rel=1e-12)


@pytest.mark.parametrize("strategy", ["afd", "cad"])
def test_one_microbatch_matches_the_fixed_point_by_hand(tiny_llama, strategy) -> None:
    """With one microbatch the token walks the chain alone: each owner idles TPOT - busy_o
    between two runs of any of its segments, so its operators take bytes_o * s_per_byte *
    (1 - exp(-idle / tau)) longer (bytes_o: what its operators touch per token, from the
    operator specs), and TPOT is the chain's sum. Solved here by plain iteration."""
    plain, cold = _profiles(tiny_llama, 2, IdleSlowdown(s_per_byte=3e-9, time_constant_s=4e-3))
    plan = canonical_plan(tiny_llama, strategy, gpu="cpu", batch=4, microbatches=1)
    hot = simulate_plan(plan, tiny_llama, profiles=[plain])
    busy_hot = [v for k, v in hot.busy_s.items() if k.endswith("compute")]
    touched = [0.0] * len(plan.owners)
    for seg in segments(tiny_llama, plan.template, len(plan.owners)):
        touched[seg.owner] += sum(float(op.bytes_moved(4.0, plan.context_tokens)) for op in seg.ops)
    extra = [0.0] * len(plan.owners)
    for _ in range(500):
        tpot = hot.tpot_s + sum(extra)
        extra = [
            cold.idle_slowdown.extra_s(b, tpot - (busy + e))
            for b, busy, e in zip(touched, busy_hot, extra, strict=True)
        ]
    tpot = hot.tpot_s + sum(extra)
    got = simulate_plan(plan, tiny_llama, profiles=[cold]).tpot_s
    assert got > hot.tpot_s * 1.01
    assert got == pytest.approx(tpot, rel=2e-3)


def test_no_slowdown_per_byte_no_change(tiny_llama) -> None:
    plain, flat = _profiles(tiny_llama, 3, IdleSlowdown(s_per_byte=0.0, time_constant_s=1e-3))
    plan = canonical_plan(tiny_llama, "afd", gpu="cpu", batch=4, microbatches=2)
    a = simulate_plan(plan, tiny_llama, profiles=[plain])
    b = simulate_plan(plan, tiny_llama, profiles=[flat])
    assert b.tpot_s == pytest.approx(a.tpot_s, rel=1e-12)
