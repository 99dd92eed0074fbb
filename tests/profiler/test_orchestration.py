"""The serving loop's host time, measured from the runtime's own loop into the profile."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def fit(tiny_model):
    from opweave.profiler import measure_orchestration

    return measure_orchestration(tiny_model("llama"))


def test_fit_reproduces_its_points(fit) -> None:
    """Two microbatch sizes, an affine fit through them: exact unless noise made the line clip
    at zero (a falling slope, or a rise steep enough to take the intercept below zero; on a
    busy machine one point can take several times its time). How well the fit predicts another
    run's loop on this machine: tools/bench/host_timing.py."""
    loop = fit.profile
    assert [p[0] for p in fit.points] == [1, 8]
    assert loop.stage_s >= 0 and loop.drive_s >= 0
    for requests, stage, drive in fit.points:
        assert stage > 0 and drive > 0  # seconds (what they are: tools/bench/host_timing.py)
        if loop.stage_s > 0 and loop.stage_per_request_s > 0:
            assert loop.stage(requests) == pytest.approx(stage, rel=1e-6)
        if loop.drive_s > 0 and loop.drive_per_request_s > 0:
            assert loop.drive(requests) == pytest.approx(drive, rel=1e-6)
    assert "per stage" in fit.describe() and "driver per microbatch" in fit.describe()


def test_the_fit_is_the_least_squares_line_clipped_at_zero() -> None:
    from opweave.profiler._private.orchestration import _affine

    assert _affine([(1, 3e-4), (8, 1e-3)]) == pytest.approx((2e-4, 1e-4))  # 3 = a + b, 10 = a + 8b
    assert _affine([(1, 3e-4), (8, 2e-4)]) == pytest.approx((2.5e-4, 0.0))  # falling: the mean
    steep = _affine([(1, 1e-4), (8, 1.6e-3)])  # the line crosses zero before one request
    assert steep == pytest.approx((0.0, 1.5e-3 / 7))


def test_profile_carries_it_with_provenance(tiny_model, quick_profile) -> None:
    run = quick_profile(tiny_model("llama"), orchestration=True)
    assert run.orchestration is not None
    assert run.profile.orchestration == run.orchestration.profile
    assert run.profile.provenance.settings["orchestration"] == run.orchestration.describe()


def test_not_measured_without_weights(tiny_model, quick_profile) -> None:
    run = quick_profile(tiny_model("llama"), orchestration=True, random_weights=True)
    assert run.orchestration is None and run.profile.orchestration is None
    why = run.profile.provenance.settings["orchestration"]
    assert isinstance(why, str) and why.startswith("not measured") and "weights" in why
