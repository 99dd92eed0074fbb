"""What stalls add to the timed calls: each cell's mean beside its median, pooled."""

from __future__ import annotations

import pytest


def test_stall_overhead_pools_means_over_medians() -> None:
    """Sum of means over sum of medians, less one: a stall weighs by its length."""
    import statistics

    from opweave.profiler import Measurement, stall_overhead
    from opweave.profiler._private.timing import summarize

    samples = [1e-3] * 9 + [11e-3]  # one 10 ms stall among ten 1 ms calls
    m = summarize(samples)
    assert m.median_s == pytest.approx(1e-3)
    assert m.mean_s == pytest.approx(statistics.fmean(samples))
    quiet = summarize([4e-3] * 10)
    assert stall_overhead([m, quiet]) == pytest.approx((2e-3 + 4e-3) / (1e-3 + 4e-3) - 1)
    # never below zero (means under medians are noise), unknown means left out, none: zero
    low = Measurement(median_s=2e-3, iqr_s=0.0, repeats=5, mean_s=1.5e-3)
    assert stall_overhead([low]) == 0.0
    assert stall_overhead([Measurement(1e-3, 0.0, 5), quiet]) == pytest.approx(0.0, abs=1e-12)
    assert stall_overhead([]) == 0.0


def test_profile_records_what_stalls_add(tiny_model, quick_profile) -> None:
    run = quick_profile(tiny_model("llama"))
    # never below zero; how far above depends on the machine's load (tools/bench/host_timing.py)
    assert run.profile.stall_overhead >= 0
    note = run.profile.provenance.settings["stalls"]
    assert f"{run.profile.stall_overhead:.1%}" in note and "above their median" in note
