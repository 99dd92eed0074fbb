"""How much slower a rank's operators run after it sat idle (CPU ranks).

A pipeline stage waits for its input between runs of its operators. While it waits, other work
on the machine (other ranks, other processes, other tenants of a VM's host) evicts the stage's
weights and state from the caches it shares with them, and its next run fetches them again.
The profile's operator tables are timed back to back, hot, so a stage that waits runs slower
than they say, by an amount that grows with the bytes it touches and with how long it waited.

Measured on the two-core VM this was built on, reading a buffer with one thread: hot, 21 GB/s
for 8-64 MB; after idling 10 ms, every byte cost about 50 ps more (46 ps for 8 MB, 53 ps for 32
and 64 MB), the same as a 37 MB chain of decode GEMMs (48 ps per weight byte); a 128 MB buffer,
past what the VM keeps cached, read at 12.5 GB/s hot and lost only 11 ps per byte.

So the profiler reads a buffer (the operator chain's weight bytes, at most ``PROBE_BYTES``)
hot and, right after, again after waiting ``g`` the way a waiting rank waits, and fits the
median extra time per byte with ``s_per_byte * (1 - exp(-g / time_constant))``
(:class:`~opweave.costmodel.IdleSlowdown`). A rank with a core of its own busy-polls its
sockets (``select`` with a zero timeout) and one that shares cores blocks in ``select`` (see
``opweave.runtime``'s wire); the probe does the same on a socket pair that stays silent. The
numbers above were taken while ranks still blocked; a spinning wait keeps the core awake, and
what it loses is only what the other cores evict meanwhile.
"""

from __future__ import annotations

import gc
import selectors
import socket
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from opweave.costmodel import IdleSlowdown

GAPS_S = (1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3)
PROBE_BYTES = 32 * 2**20
SAMPLES = 25  # (hot, after idling) pairs per gap


@dataclass(frozen=True)
class IdleFit:
    """The fitted slowdown and the measured points behind it."""

    slowdown: IdleSlowdown
    points: tuple[tuple[float, float], ...]  # (idle seconds, median extra seconds per byte)
    probe_bytes: int
    hot_s: float  # one hot read of the probe
    wait: str = "block"  # how the gaps were spent: "spin" or "block", as ranks wait

    def describe(self) -> str:
        s = self.slowdown
        tau_ms = s.time_constant_s * 1e3
        pts = ", ".join(f"{e * 1e12:.0f} after {g * 1e3:g} ms" for g, e in self.points)
        waited = "spinning on" if self.wait == "spin" else "blocked in"
        return (
            f"after idling, memory reads are slower: up to {s.s_per_byte * 1e12:.1f} ps per "
            f"byte touched, 63% of that after {tau_ms:.2f} ms idle (the time constant) and "
            f"nearly all of it after a few times that; a {self.probe_bytes / 2**20:.0f} MiB "
            f"read ({self.hot_s * 1e3:.2f} ms when hot) cost these ps per byte more: {pts} "
            f"(waiting {waited} select, as ranks wait)"
        )


class IdleWait:
    """Idles as a waiting rank does, on a socket pair that stays silent: polling it with zero
    timeouts (``spin``) or blocked in ``select`` on it. A context manager (it owns the pair)."""

    def __init__(self, spin: bool) -> None:
        self.spin = spin
        self._quiet, self._other = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._quiet, selectors.EVENT_READ)

    def __call__(self, gap_s: float) -> None:
        if not self.spin:
            self._selector.select(timeout=gap_s)
            return
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            self._selector.select(timeout=0.0)

    def __enter__(self) -> IdleWait:
        return self

    def __exit__(self, *exc: object) -> None:
        self._selector.close()
        self._quiet.close()
        self._other.close()


def measure_idle_slowdown(
    num_bytes: int = PROBE_BYTES,
    gaps_s: tuple[float, ...] = GAPS_S,
    samples: int = SAMPLES,
    *,
    spin: bool = False,
) -> IdleFit:
    """Read ``num_bytes`` hot and after each idle gap; fit the extra time per byte.

    Every sample is a pair taken back to back (a hot read right after another read, then a
    read after idling the gap, spinning or blocked as ``spin`` says), so the machine's own
    drift, which moves a hot read by 2x within minutes on a shared VM, cancels in the pair's
    difference; the gaps take turns."""
    probe = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32)
    size = probe.numel() * 4

    def read() -> float:
        t0 = time.perf_counter()
        probe.sum()
        return time.perf_counter() - t0

    extra: dict[float, list[float]] = {g: [] for g in gaps_s}
    hot = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with IdleWait(spin) as idle:
            read()  # first touch
            for _ in range(samples):
                for gap in gaps_s:
                    read()
                    warm = read()
                    idle(gap)
                    extra[gap].append((read() - warm) / size)
                    hot.append(warm)
    finally:
        if gc_was_enabled:
            gc.enable()
    points = tuple((g, statistics.median(e)) for g, e in extra.items())
    fit = fit_idle_slowdown(points).model_copy(update={"max_bytes": float(size)})
    return IdleFit(fit, points, size, statistics.median(hot), "spin" if spin else "block")


def fit_idle_slowdown(points: tuple[tuple[float, float], ...]) -> IdleSlowdown:
    """Least squares of ``extra = s_per_byte (1 - exp(-g / tau))`` over a log grid of ``tau``
    (for each, ``s_per_byte`` in closed form, clipped at zero: idling never speeds up).

    ``tau`` is at most the longest gap measured: the curve is known only that far, and points
    still rising there would otherwise fit a near-straight line (500 ps per byte over 470 ms,
    in one profile) that charges idles past the probe's far more than it ever measured."""
    gaps = np.asarray([g for g, _ in points], dtype=np.float64)
    extra = np.asarray([e for _, e in points], dtype=np.float64)
    best: tuple[float, float, float] | None = None
    for tau in np.geomspace(0.2e-3, float(np.max(gaps)), 160):
        shape = -np.expm1(-gaps / tau)
        per_byte = max(float(shape @ extra / (shape @ shape)), 0.0)
        err = float(np.sum((per_byte * shape - extra) ** 2))
        if best is None or err < best[0]:
            best = (err, per_byte, float(tau))
    assert best is not None
    return IdleSlowdown(s_per_byte=best[1], time_constant_s=best[2])
