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
    """On this machine's clock (what it measured: tools/bench/host_timing.py)."""
    from opweave.profiler import measure_idle_slowdown

    fit = measure_idle_slowdown(8 * 2**20, gaps_s=(1e-3, 20e-3), samples=5)
    assert fit.probe_bytes == 8 * 2**20
    assert [g for g, _ in fit.points] == [1e-3, 20e-3]
    assert fit.hot_s > 0 and all(math.isfinite(e) for _, e in fit.points)
    assert fit.slowdown.s_per_byte >= 0 and "ps per byte" in fit.describe()
    assert fit.wait == "block" and "blocked in select" in fit.describe()
    spun = measure_idle_slowdown(8 * 2**20, gaps_s=(1e-3,), samples=3, spin=True)
    assert spun.wait == "spin" and "spinning" in spun.describe()


TICK_S = 1e-3  # every read of the scripted clock below takes 1 ms
EXTRA_S = {1e-3: 2e-3, 20e-3: 5e-3}  # and a read right after idling a gap that much more


class _ScriptedClock:
    """``perf_counter`` for :func:`measure_idle_slowdown`: each call advances ``TICK_S``, and
    the second call after an idle (the end of the read that follows it) the gap's extra too."""

    def __init__(self) -> None:
        self.now, self.gap, self.calls_since_idle = 0.0, None, 0

    def perf_counter(self) -> float:
        self.now += TICK_S
        if self.gap is not None:
            self.calls_since_idle += 1
            if self.calls_since_idle == 2:
                self.now += EXTRA_S[self.gap]
                self.gap = None
        return self.now


class _ScriptedIdle:
    """Stands in for :class:`IdleWait`: idling only tells the clock which gap passed."""

    def __init__(self, clock: _ScriptedClock) -> None:
        self.clock = clock

    def __enter__(self) -> _ScriptedIdle:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __call__(self, gap_s: float) -> None:
        self.clock.gap, self.clock.calls_since_idle = gap_s, 0


def test_measurement_gives_hot_seconds_per_read_and_extra_seconds_per_byte(monkeypatch) -> None:
    """On a scripted clock: the hot read's time in seconds (the median of the reads taken right
    after another read), and per gap the extra time of the read after it, per probe byte."""
    from types import SimpleNamespace

    from opweave.profiler import measure_idle_slowdown
    from opweave.profiler._private import idle

    clock = _ScriptedClock()
    monkeypatch.setattr(idle, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(idle, "IdleWait", lambda spin: _ScriptedIdle(clock))
    size = 8 * 2**20
    fit = measure_idle_slowdown(size, gaps_s=tuple(EXTRA_S), samples=5)
    assert fit.probe_bytes == size
    assert fit.hot_s == pytest.approx(TICK_S)
    assert [g for g, _ in fit.points] == list(EXTRA_S)
    assert [e for _, e in fit.points] == pytest.approx([e / size for e in EXTRA_S.values()])


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
    """Spinning polls the silent socket with zero timeouts for the whole gap (keeping the core
    busy); blocking waits in one ``select`` for the gap (leaving it idle). The CPU time each
    takes: tools/bench/host_timing.py."""
    from opweave.profiler._private.idle import IdleWait

    for spin in (True, False):
        with IdleWait(spin) as idle:
            timeouts: list[float | None] = []
            select = idle._selector.select

            def recording(timeout: float | None = None, select=select, timeouts=timeouts):
                timeouts.append(timeout)
                return select(timeout)

            idle._selector.select = recording
            idle(0.2)
        if spin:
            assert len(timeouts) > 1 and set(timeouts) == {0.0}
        else:
            assert timeouts == [0.2]


def test_profile_says_how_the_gaps_were_spent() -> None:
    import torch

    from opweave.profiler._private.profile import ranks_spin

    assert not ranks_spin(torch.device("cpu"), "block")
    assert ranks_spin(torch.device("cpu"), "spin")
    assert not ranks_spin(torch.device("meta"), "spin")  # only CPU ranks spin on sockets
