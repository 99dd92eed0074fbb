"""The slowdown after idling: its fit, its measurement, and its place in the profile."""

from __future__ import annotations

import math

import pytest


def _curve(per_byte: float, tau: float, gaps: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    return tuple((g, per_byte * (1 - math.exp(-g / tau))) for g in gaps)


def test_fit_recovers_a_known_curve() -> None:
    from opweave.profiler import fit_idle_slowdown
    from opweave.profiler._private.idle import GAPS_S

    got = fit_idle_slowdown(_curve(50e-12, 8e-3, GAPS_S))
    assert got.s_per_byte == pytest.approx(50e-12, rel=0.05)
    assert got.time_constant_s == pytest.approx(8e-3, rel=0.08)
    assert fit_idle_slowdown(tuple((g, 0.0) for g in GAPS_S)).s_per_byte == 0.0
    faster = fit_idle_slowdown(tuple((g, -1e-12) for g in GAPS_S))  # noise: never a speed-up
    assert faster.s_per_byte == 0.0


def test_fit_does_not_reach_past_the_longest_gap() -> None:
    """Points still rising at the longest gap fit the steepest curve that levels off there,
    not a near-straight line that charges a second of idling ten times what was measured."""
    from opweave.profiler import fit_idle_slowdown
    from opweave.profiler._private.idle import GAPS_S

    rising = _curve(500e-12, 0.5, GAPS_S)  # 48 ps per byte at 50 ms and still climbing
    got = fit_idle_slowdown(rising)
    assert got.time_constant_s <= max(GAPS_S)
    assert got.extra_s(1.0, 1.0) < 2 * rising[-1][1]
    assert got.extra_s(1.0, max(GAPS_S)) == pytest.approx(rising[-1][1], rel=0.25)


def test_measurement_reads_the_probe_hot_and_after_each_gap() -> None:
    from opweave.profiler import measure_idle_slowdown

    fit = measure_idle_slowdown(8 * 2**20, gaps_s=(1e-3, 20e-3), samples=5)
    assert fit.probe_bytes == 8 * 2**20
    assert [g for g, _ in fit.points] == [1e-3, 20e-3]
    assert 0.2e9 < fit.probe_bytes / fit.hot_s < 1e12  # a plausible read bandwidth
    assert all(abs(e) < 1e-9 for _, e in fit.points)  # seconds per byte, not per read
    assert fit.slowdown.s_per_byte >= 0 and "ps per byte" in fit.describe()
    assert fit.wait == "block" and "blocked in select" in fit.describe()
    spun = measure_idle_slowdown(8 * 2**20, gaps_s=(1e-3,), samples=3, spin=True)
    assert spun.wait == "spin" and "spinning" in spun.describe()


def test_profile_carries_it_with_provenance(tiny_model, quick_profile) -> None:
    import os

    run = quick_profile(tiny_model("llama"), idle=True)
    assert run.idle is not None
    # the profiler times on one pinned core, but ranks get a core each: they spin if they can
    spins = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1
    assert run.idle.wait == ("spin" if spins else "block")
    assert run.profile.idle_slowdown == run.idle.slowdown
    assert run.profile.provenance.settings["idle_slowdown"] == run.idle.describe()
    off = quick_profile(tiny_model("llama"))
    assert off.profile.idle_slowdown is None
    assert off.profile.provenance.settings["idle_slowdown"] == "not measured (skipped)"


def test_not_measured_where_operators_were_timed_cold() -> None:
    import torch

    from opweave.profiler._private.profile import _idle_unavailable

    why = _idle_unavailable(torch.device("cpu"), 1e13)
    assert why is not None and "exceed the caches" in why and "timed cold" in why
    assert _idle_unavailable(torch.device("cpu"), 1e6) is None


def test_the_probe_idles_as_ranks_wait() -> None:
    """Spinning keeps the core busy for the gap (CPU time about the wall time); blocking
    leaves it idle (no CPU time to speak of)."""
    import time

    from opweave.profiler._private.idle import IdleWait

    for spin in (True, False):
        with IdleWait(spin) as idle:
            wall, cpu = time.perf_counter(), time.process_time()
            idle(0.2)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert 0.2 <= wall < 1.0
        if spin:
            assert cpu > 0.5 * wall
        else:
            assert cpu < 0.05


def test_profile_says_how_the_gaps_were_spent(monkeypatch) -> None:
    import torch

    from opweave.profiler._private.profile import ranks_spin

    monkeypatch.setenv("OPWEAVE_WAIT", "block")
    assert not ranks_spin(torch.device("cpu"))
    monkeypatch.setenv("OPWEAVE_WAIT", "spin")
    assert ranks_spin(torch.device("cpu"))
    assert not ranks_spin(torch.device("meta"))  # only CPU ranks spin on sockets
