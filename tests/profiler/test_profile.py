"""Measured profiles of tiny models: schema, coverage, lookups and the roofline fit."""

from __future__ import annotations

import math

import pytest
import torch

from opweave.costmodel import (
    Profile,
    ProfiledLatency,
    fit_efficiency,
    load_model,
    profile_key,
    profile_operators,
)

# The stated accuracy of the fitted roofline on a tiny model on CPU: half the measured points
# within this factor. Tiny operators cost tens of microseconds of Python and dispatch each, which
# one per-kernel overhead describes only roughly (see the package README).
MEDIAN_FIT_FACTOR = 4.0


def _keys(model) -> set[str]:
    return {key for key, _, _ in profile_operators(model)}


def test_profile_of_a_tiny_model_round_trips_and_covers_every_operator(
    tiny_model, quick_profile, tmp_path
) -> None:
    from opweave.profiler import load_profile, save_profile

    folder = tiny_model("llama")
    run = quick_profile(folder)
    profile = run.profile
    model = load_model(folder)
    assert {t.op for t in profile.ops} == _keys(model)
    assert all(t.tp == 1 for t in profile.ops)
    assert profile.model == model.name and profile.config_sha256 == model.config_sha256
    assert profile.dtype == "float32" and profile.provenance.source == "measured"
    # a CPU rank's per-step host work is its loop's (orchestration), not a GPU engine's gap
    assert profile.device.step_overhead_s == 0.0
    assert not profile.device.side_streams  # a CPU rank runs shared experts inline

    path = save_profile(profile, tmp_path / "p.json")
    again = load_profile(path)
    assert again == profile
    assert Profile.model_validate_json(path.read_text()) == profile

    for table in profile.ops:
        assert table.batches == (1, 4)
        context_dependent = table.op.startswith("core_attn")
        assert table.contexts == ((16, 64) if context_dependent else (16,))
        assert table.spread_s is not None
        for row, spread in zip(table.latency_s, table.spread_s, strict=True):
            assert all(v > 0 and math.isfinite(v) for v in row)
            assert all(s >= 0 for s in spread)
            # interpolation at a measured grid point returns the measured median
        for b, row in zip(table.batches, table.latency_s, strict=True):
            for s, v in zip(table.contexts, row, strict=True):
                assert table(b, s) == pytest.approx(v, rel=1e-9)


def test_provenance_names_device_versions_and_settings(tiny_model, quick_profile) -> None:
    prov = quick_profile(tiny_model("llama")).profile.provenance
    assert prov.device_name and prov.date
    assert {"python", "torch", "opweave-runtime", "opweave-costmodel"} <= set(prov.versions)
    settings = prov.settings
    assert settings["batches"] == [1, 4] and settings["contexts"] == [16, 64]
    # one torch thread on one core, as every CPU rank of the runtime runs
    assert settings["weights"] == "checkpoint" and settings["threads"] == 1
    assert len(settings["cores"]) == 1
    assert settings["state_fill"] == "direct" and settings["aliased_state"] == []
    assert "perf_counter" in str(settings["timer"])
    assert settings["timing"] == "chain"  # the CPU default: decode order


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_isolated_timing_covers_the_same_tables(family, tiny_model, quick_profile) -> None:
    folder = tiny_model(family)
    chain = quick_profile(folder).profile
    isolated = quick_profile(folder, timing_mode="isolated").profile
    assert isolated.provenance.settings["timing"] == "isolated"
    assert [(t.op, t.batches, t.contexts) for t in chain.ops] == [
        (t.op, t.batches, t.contexts) for t in isolated.ops
    ]
    for table in isolated.ops:
        assert all(v > 0 and math.isfinite(v) for row in table.latency_s for v in row)


def test_chain_timing_of_selected_operators(tiny_model, quick_profile) -> None:
    folder = tiny_model("qwen3_next")
    ops = ("core_attn@full", "lm_head")
    profile = quick_profile(folder, ops=ops).profile
    assert {t.op for t in profile.ops} == set(ops)
    assert profile.provenance.settings["timing"] == "chain"


def test_profile_drives_the_planner_latency_model(tiny_model, quick_profile) -> None:
    folder = tiny_model("llama")
    profile = quick_profile(folder).profile
    model = load_model(folder)
    latency = ProfiledLatency(profile)
    assert latency.hardware.id == "cpu" and latency.hardware.usd_per_hour > 0
    layer_of = {op.key: layer for layer in model.layers for op in layer.ops}
    for op in model.operators:
        for batch, context in ((1, 16), (3, 40), (64, 4096)):
            t = latency.op_latency_s(model, op, layer_of.get(op.key), 1, batch, context)
            assert t > 0 and math.isfinite(t)


def test_fitted_roofline_is_sane_and_close(tiny_model, quick_profile) -> None:
    folder = tiny_model("llama")
    run = quick_profile(folder)
    fit = run.fit
    assert fit is not None and fit.points == sum(
        len(t.batches) * len(t.contexts) for t in run.profile.ops
    )
    for eta in (fit.hardware.memory_efficiency, fit.hardware.compute_efficiency):
        assert 0 < eta <= 1
    assert fit.hardware.kernel_overhead_s > 0
    assert 1.0 <= fit.median_error_factor < MEDIAN_FIT_FACTOR
    assert fit.median_error_factor <= fit.p90_error_factor <= fit.max_error_factor
    # A CPU's peaks are measured here, so the profile's device carries the fitted factors.
    assert run.profile.device == fit.hardware
    assert fit_efficiency(run.profile, load_model(folder)) == pytest.approx(fit.hardware)


@pytest.mark.parametrize(
    ("family", "shared", "kinds"),
    [
        ("gemma3_text", "gate_up_proj@full=gate_up_proj@sliding", {"sliding", "full"}),
        ("qwen3_next", "experts@full=experts@linear", {"linear", "full"}),
    ],
)
def test_random_weights_from_a_config_alone(
    family, shared, kinds, tiny_model, quick_profile, write_config
) -> None:
    """No checkpoint: operators get random weights of the config's shapes."""
    import json

    config = json.loads((tiny_model(family) / "config.json").read_text())
    folder = write_config(config, f"{family}-config-only")
    run = quick_profile(folder)
    profile = run.profile
    model = load_model(folder)
    assert {t.op for t in profile.ops} == _keys(model)
    assert profile.provenance.settings["weights"] == "random"
    assert shared in profile.provenance.settings["shared_tables"]
    attention = {t.op.split("@")[1] for t in profile.ops if t.op.startswith("core_attn")}
    assert attention == kinds
    by_key = {t.op: t for t in profile.ops}
    left, right = shared.split("=")
    assert by_key[left].latency_s == by_key[right].latency_s
    if family == "qwen3_next":  # linear attention state does not grow with context
        assert by_key["core_attn@linear"].contexts == (16,)
        assert by_key["core_attn@full"].contexts == (16, 64)


def test_only_some_operators(tiny_model, quick_profile) -> None:
    keys = ("core_attn@full", "lm_head")
    run = quick_profile(tiny_model("llama"), ops=keys)
    assert tuple(t.op for t in run.profile.ops) == keys
    with pytest.raises(Exception, match="no latencies for embed"):
        run.profile.table(profile_key(load_model(tiny_model("llama")).pre_ops[0], None), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["gemma-3-27b", "qwen3-next-80b-a3b"])
def test_full_size_block_on_cuda_from_config_alone(name) -> None:
    """One partition block (+ embed/head) of a real model, random bf16 weights, on a GPU."""
    from opweave.profiler import profile_model

    run = profile_model(
        name, device="cuda", batches=(1, 16), contexts=(1024, 8192), transfer=False,
        progress=False,
    )  # fmt: skip
    profile = run.profile
    assert {t.op for t in profile.ops} == _keys(load_model(name))
    assert profile.dtype == "bfloat16" and profile.provenance.settings["weights"] == "random"
    assert "cuda" in profile.provenance.versions
    # timed at every point of the grid (how latency grows over it: tools/bench/profile_attention.py)
    full = next(t for t in profile.ops if t.op == "core_attn@full")
    assert (full.batches, full.contexts) == ((1, 16), (1024, 8192))
    assert [len(row) for row in full.latency_s] == [2, 2]


def test_a_static_decode_step_profile_times_the_steps_a_rank_runs(tiny_model) -> None:
    """``--decode-step static``: each operator timed as the static decode step a rank's rows
    runner calls, over the same tables as the per-request profile; the profile says which it
    timed, and a mode that cannot time it is refused in one line."""
    from opweave.profiler import ProfilerError, profile_model

    kwargs = dict(
        batches=(2,),
        contexts=(16,),
        transfer=False,
        orchestration=False,
        idle=False,
        fit=False,
        progress=False,
    )
    model = tiny_model("llama")
    static = profile_model(model, decode_step="static", **kwargs)
    plain = profile_model(model, **kwargs)
    assert static.profile.provenance.settings["decode_step"] == "static"
    assert plain.profile.provenance.settings["decode_step"] == "per-request"
    assert [t.op for t in static.profile.ops] == [t.op for t in plain.profile.ops]
    assert all(t.latency_s[0][0] > 0 for t in static.profile.ops)
    with pytest.raises(ProfilerError, match="decode order only: use --timing chain"):
        profile_model(model, decode_step="static", timing_mode="isolated", **kwargs)
    with pytest.raises(ProfilerError, match="--decode-step fast: choose one of per-request"):
        profile_model(model, decode_step="fast", **kwargs)
