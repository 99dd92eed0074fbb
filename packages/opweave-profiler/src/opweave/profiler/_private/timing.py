"""Timing one operator call: warm-up, repeats, median and interquartile range.

Two clocks, because the two devices need different ones:

* CPU: ``time.perf_counter_ns`` (monotonic, nanosecond resolution) around the call, with torch's
  intra-op thread count pinned and the process bound to the same number of cores, so that the
  scheduler neither adds threads nor migrates them between repeats.
* CUDA: a pair of CUDA events around the call, read after one synchronisation at the end. The
  device is synchronised before every repeat so each call starts on an idle stream: the events
  then include the host's launch overhead when the GPU waits for it, which is what one eager
  operator of the runtime costs.

The number of repeats adapts to the operator: at least ``repeats``, more for fast operators
until ``cell_budget_s`` is spent (at most ``10 * repeats``), so microsecond operators get enough
samples for a stable median without millisecond ones taking minutes. Two passes over the grid
(the CPU default) guard against stalls caused by other processes; see
:attr:`TimingSettings.passes`.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

Step = Callable[[int], object]


@dataclass(frozen=True)
class TimingSettings:
    """How hard to look at each (operator, batch, context) cell."""

    warmup: int = 2
    repeats: int = 5
    cell_budget_s: float = 0.03
    # Whole-grid passes, seconds apart; each cell is the median of its passes' medians (two:
    # their mean), so a stall or a slow spell of the machine in one pass counts for half.
    passes: int = 2

    @property
    def max_repeats(self) -> int:
        return 10 * self.repeats


@dataclass(frozen=True)
class Measurement:
    """Median, interquartile range and mean of the timed repeats of one cell, in seconds."""

    median_s: float
    iqr_s: float
    repeats: int
    mean_s: float | None = None  # None: not known (the median stands in)


def summarize(samples: list[float]) -> Measurement:
    """Median and IQR, both robust to the odd preempted repeat, and the mean, which is not
    (what the stalls add in expectation: see :func:`stall_overhead`)."""
    values = np.asarray(samples, dtype=np.float64)
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    return Measurement(
        median_s=float(med),
        iqr_s=float(q3 - q1),
        repeats=len(samples),
        mean_s=float(values.mean()),
    )


def stall_overhead(measurements: Iterable[Measurement]) -> float:
    """The summed means of ``measurements`` over their summed medians, less one (at least 0):
    how much longer, in expectation, calls take than the medians say. Pooled over many cells,
    so one stall weighs by its length, as it does in a serving run's mean time per token."""
    pairs = [(m.mean_s, m.median_s) for m in measurements if m.mean_s is not None]
    medians = sum(med for _, med in pairs)
    if medians <= 0:
        return 0.0
    return max(sum(mean for mean, _ in pairs) / medians - 1.0, 0.0)


class Timer:
    """Times ``step(i)`` for repeat ``i``; ``setup(i)`` runs before it, outside the clock."""

    name = "timer"

    def __init__(self, settings: TimingSettings) -> None:
        self.settings = settings

    def measure(self, step: Step, setup: Step | None = None) -> Measurement:
        s = self.settings
        calls = 0
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            started = time.perf_counter()
            for _ in range(s.warmup):
                if setup is not None:
                    setup(calls)
                step(calls)
                calls += 1
            self._sync()
            per_call = (time.perf_counter() - started) / max(s.warmup, 1)
            extra = math.floor(s.cell_budget_s / per_call) if per_call > 0 else s.max_repeats
            repeats = max(s.repeats, min(s.max_repeats, extra))
            samples = self._timed(step, setup, calls, repeats)
        finally:
            if gc_was_enabled:
                gc.enable()
        return summarize(samples)

    def _sync(self) -> None:
        pass

    def _timed(self, step: Step, setup: Step | None, first: int, repeats: int) -> list[float]:
        raise NotImplementedError


class CpuTimer(Timer):
    """Monotonic wall clock around each call (threads pinned by :func:`pinned_cpu`)."""

    name = "cpu: time.perf_counter_ns, pinned threads"

    def _timed(self, step: Step, setup: Step | None, first: int, repeats: int) -> list[float]:
        samples = []
        for i in range(first, first + repeats):
            if setup is not None:
                setup(i)
            t0 = time.perf_counter_ns()
            step(i)
            samples.append((time.perf_counter_ns() - t0) * 1e-9)
        return samples


class CudaTimer(Timer):
    """CUDA events around each call, on an idle stream."""

    name = "cuda: torch.cuda.Event pairs, synchronised before each repeat"

    def __init__(self, settings: TimingSettings, device: torch.device) -> None:
        super().__init__(settings)
        self.device = device

    def _sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def _timed(self, step: Step, setup: Step | None, first: int, repeats: int) -> list[float]:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for i, (start, end) in zip(range(first, first + repeats), events, strict=True):
            if setup is not None:
                setup(i)
            torch.cuda.synchronize(self.device)
            start.record()
            step(i)
            end.record()
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) * 1e-3 for start, end in events]


def make_timer(device: torch.device, settings: TimingSettings) -> Timer:
    if device.type == "cuda":
        return CudaTimer(settings, device)
    return CpuTimer(settings)


def available_cores() -> list[int]:
    """Cores this process may run on (all of them where affinity is not supported)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@contextmanager
def pinned_cpu(threads: int | None) -> Iterator[list[int]]:
    """Pin torch to ``threads`` intra-op threads on as many cores, restoring both afterwards.

    Yields the cores used. Without ``sched_setaffinity`` (macOS) only the thread count is set.
    """
    cores = available_cores()
    threads = len(cores) if threads is None else threads
    if threads < 1:
        raise ValueError("threads must be at least 1")
    old_threads = torch.get_num_threads()
    use = cores[:threads] if threads <= len(cores) else cores
    # Only touch what changes: re-setting torch's (already equal) thread count re-initialises
    # its OpenMP pool in a mode whose tiny parallel regions stall for a scheduler tick
    # (~16 ms on a 2-core VM) whenever another process holds a core.
    set_threads = threads != old_threads
    pin = hasattr(os, "sched_setaffinity") and use != cores
    if set_threads:
        torch.set_num_threads(threads)
    if pin:
        os.sched_setaffinity(0, use)
    try:
        yield use
    finally:
        if set_threads:
            torch.set_num_threads(old_threads)
        if pin:
            os.sched_setaffinity(0, cores)
