"""Roofline-synthesised profiles, and fitting efficiency factors back from a profile."""

from __future__ import annotations

import pytest

from opweave.costmodel import (
    ConfigError,
    ProfiledLatency,
    RooflineLatency,
    default_catalog,
    fit_efficiency,
    fit_efficiency_report,
    load_model,
    profile_operators,
    synthesize_profile,
)


@pytest.mark.parametrize("name", ["gemma-3-27b", "qwen3-next-80b-a3b"])
def test_synthesised_profile_matches_the_roofline(name) -> None:
    model, hw = load_model(name), default_catalog().get("h100")
    profile = synthesize_profile(model, hw, tp_degrees=(1, 2), batches=(1, 16), contexts=(1024,))
    keys = {key for key, _, _ in profile_operators(model)}
    assert {t.op for t in profile.ops} == keys and {t.tp for t in profile.ops} == {1, 2}
    assert profile.provenance.source == "roofline" and profile.config_sha256 == model.config_sha256
    roof, prof = RooflineLatency(hw), ProfiledLatency(profile)
    layer_of = {op.key: layer for layer in model.layers for op in layer.ops}
    for op in model.operators:
        layer = layer_of.get(op.key)
        for tp in (1, 2):
            expected = roof.op_latency_s(model, op, layer, tp, 16, 1024)
            assert prof.op_latency_s(model, op, layer, tp, 16, 1024) == pytest.approx(expected)
    for link in ("intra_node", "network"):
        assert prof.transfer_s(link, 1e6) == pytest.approx(roof.transfer_s(link, 1e6))


def test_fit_recovers_the_factors_a_profile_was_made_with() -> None:
    model = load_model("llama-3.3-70b")
    truth = (
        default_catalog()
        .get("a100")
        .model_copy(
            update={"memory_efficiency": 0.6, "compute_efficiency": 0.45, "kernel_overhead_s": 4e-6}
        )
    )
    profile = synthesize_profile(
        model, truth, batches=(1, 4, 64, 512, 2048), contexts=(1024, 32768)
    )
    start = profile.model_copy(update={"device": default_catalog().get("a100")})
    report = fit_efficiency_report(start, model)
    assert report.hardware.memory_efficiency == pytest.approx(0.6, rel=1e-3)
    assert report.hardware.compute_efficiency == pytest.approx(0.45, rel=1e-3)
    assert report.hardware.kernel_overhead_s == pytest.approx(4e-6, rel=1e-2)
    assert report.max_error_factor < 1.01 and report.points > 0
    assert fit_efficiency(start, model) == report.hardware


def test_fit_recovers_them_where_shared_experts_run_beside_the_routed_ones() -> None:
    """A synthesised profile of Qwen3-Next holds its shared experts without launches at decode
    batches (beside the routed experts, [SHARED-STREAM]) and with them above 256 tokens a GPU;
    the fit counts them alike, so it recovers the factors."""
    model = load_model("qwen3-next-80b-a3b")
    truth = (
        default_catalog()
        .get("h200")
        .model_copy(update={"memory_efficiency": 0.7, "kernel_overhead_s": 5e-6})
    )
    profile = synthesize_profile(model, truth, batches=(1, 16, 512), contexts=(4096,))
    start = profile.model_copy(update={"device": default_catalog().get("h200")})
    report = fit_efficiency_report(start, model)
    assert report.hardware.memory_efficiency == pytest.approx(0.7, rel=1e-3)
    assert report.hardware.kernel_overhead_s == pytest.approx(5e-6, rel=1e-2)
    assert report.max_error_factor < 1.01


def test_fit_rejects_a_profile_of_another_model() -> None:
    hw = default_catalog().get("h100")
    profile = synthesize_profile(load_model("qwen3-30b-a3b"), hw, batches=(1,), contexts=(1024,))
    with pytest.raises(ConfigError, match="which model llama-3.3-70b lacks"):
        fit_efficiency(profile, load_model("llama-3.3-70b"))
