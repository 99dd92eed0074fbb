"""The serving loop's host time, measured from the runtime's own loop into the profile."""

from __future__ import annotations

import random
import statistics

import pytest

from opweave.costmodel import Owner, Plan, colocated_template, load_model, plan_model


@pytest.fixture(scope="module")
def fit(tiny_model):
    from opweave.profiler import measure_orchestration

    return measure_orchestration(tiny_model("llama"))


def test_fit_reproduces_its_points(fit) -> None:
    """Two microbatch sizes, an affine fit through them (exact unless a slope clips at 0)."""
    loop = fit.profile
    assert [p[0] for p in fit.points] == [1, 8]
    assert loop.stage_s > 0 and loop.drive_s > 0
    for requests, stage, drive in fit.points:
        assert 0 < stage < 5e-3 and 0 < drive < 5e-3  # seconds: tens to hundreds of us
        if loop.stage_per_request_s > 0:
            assert loop.stage(requests) == pytest.approx(stage, rel=1e-6)
        if loop.drive_per_request_s > 0:
            assert loop.drive(requests) == pytest.approx(drive, rel=1e-6)
    assert "per stage" in fit.describe() and "driver per microbatch" in fit.describe()


def test_fit_predicts_another_runs_loop_time(fit, tiny_model) -> None:
    """A colocated run at another size (4 requests per microbatch, three microbatches): its
    measured host time per iteration outside operators and transfers, against M (stage(u) +
    drive(u)) from the fit. Generous bounds (a shared machine), tight enough for a unit or a
    double count."""
    from opweave.runtime import Request, RunOptions, run_plan

    model_dir = tiny_model("llama")
    spec = load_model(model_dir)
    m, u, tokens = 3, 4, 24
    plan = Plan(
        strategy="colocated",
        model=plan_model(spec),
        context_tokens=32,
        template=colocated_template(spec),
        owners=(Owner(gpu="cpu", tp=1, replicas=1, resident_batch=m * u),),
        microbatches=m,
    )
    rng = random.Random(1)
    reqs = [
        Request(tuple(rng.randrange(spec.vocab_size) for _ in range(6)), tokens, stop_token_ids=())
        for _ in range(m * u)
    ]
    result = run_plan(plan, model_dir, reqs, RunOptions(device="cpu", timeout_s=120))
    assert result is not None
    line = result.ranks[0].timeline
    host = [
        (line.end_s[i] - line.end_s[i - 1])
        - (line.busy_s[i] - line.busy_s[i - 1])
        - (line.comm_s[i] - line.comm_s[i - 1])
        for i in range(8, tokens)
    ]
    measured = statistics.median(host)
    predicted = m * (fit.profile.stage(u) + fit.profile.drive(u))
    assert predicted / 3 < measured < predicted * 3


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
