"""Schedule simulator of the steady-state decode iteration (paper §4, appendix B.3).

The schedule. A plan's token path is a chain of ``S`` segments (stage instances along the model),
each run by one owner. One representative replica per owner is simulated: replicas of an owner are
identical and serve disjoint slices of the global batch, so they run in lock step. Every owner has
three resources: its compute stream, its send link and its receive link. Each iteration, each of
``M`` microbatches runs segment 0, 1, ..., S-1; between segments of different owners its
activations cross a link (the transfer occupies the sender's send link and the receiver's receive
link at once); after the last segment the sampled token id returns to the first segment's owner,
and only then may that microbatch start its next iteration.

Every resource executes its work in a fixed order (iteration, then position along the model, then
microbatch), as the runtime's compiled per-token schedule does (paper §6.2). A task starts once
its dependencies have finished and every resource it uses has finished the task before it in that
order, so computation overlaps communication only where two different resources are involved.

Two evaluations of the same schedule:

* :func:`simulate_events`: a discrete-event simulation (heap keyed by ``(time, sequence)``) of
  a few iterations; it gives the trace behind Gantt charts and occupancy.
* :func:`cycle_time`: the exact steady-state period. With a fixed order, finish times follow a
  max-plus linear recurrence ``x(i+1) = A ⊗ x(i)`` over the state (resource free times, microbatch
  ready times); the period is the max-plus eigenvalue of ``A`` (its maximum cycle mean, Karp's
  algorithm). The event simulation's iteration-to-iteration period converges to it (tested), and
  it is monotone in every duration, which the per-owner frontiers rely on. ``A`` is composed
  segment by segment; identical repeated blocks of segments are composed once and raised to a
  power (regularity), so the cost grows with the block size, not with the model depth.

Everything here is a pure function of its inputs; there is no global state.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .bounds import tpot_lower_bound

NEG = -np.inf


@dataclass(frozen=True)
class Pipeline:
    """The schedule problem: who runs each segment, for how long, and what crosses links.

    ``transfer_s[s]`` is the duration of the transfer after segment ``s`` (to segment ``s + 1``,
    or for the last segment the token-id return to segment 0); it is ignored when both ends are
    the same owner. Durations are per microbatch (all microbatches are the same size).
    """

    owner_names: tuple[str, ...]
    seg_owner: tuple[int, ...]
    compute_s: tuple[float, ...]
    transfer_s: tuple[float, ...]
    microbatches: int
    seg_labels: tuple[str, ...] = ()
    period_hint: int | None = field(default=None, compare=False)
    host_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        s = len(self.seg_owner)
        if s == 0 or len(self.compute_s) != s or len(self.transfer_s) != s:
            raise ValueError("seg_owner, compute_s and transfer_s must have one entry per segment")
        if self.host_s and len(self.host_s) != s:
            raise ValueError("host_s must be empty or have one entry per segment")
        if self.microbatches < 1:
            raise ValueError("microbatches must be >= 1")
        if min(self.seg_owner) < 0 or max(self.seg_owner) >= len(self.owner_names):
            raise ValueError("seg_owner refers to an unknown owner")

    @property
    def num_owners(self) -> int:
        return len(self.owner_names)

    @property
    def num_segments(self) -> int:
        return len(self.seg_owner)

    def crosses(self, s: int) -> bool:
        """Whether the transfer after segment ``s`` changes owner."""
        nxt = self.seg_owner[(s + 1) % self.num_segments]
        return nxt != self.seg_owner[s]

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        owner = np.asarray(self.seg_owner, dtype=np.int64)
        nxt = np.roll(owner, -1)
        comp = np.asarray(self.compute_s, dtype=np.float64)
        xfer = np.asarray(self.transfer_s, dtype=np.float64)
        return owner, nxt, owner != nxt, comp, xfer

    def resource_names(self) -> list[str]:
        """Compute, send and receive resource of each owner (indices 0..3n-1)."""
        names = [f"{o} compute" for o in self.owner_names]
        names += [f"{o} send" for o in self.owner_names]
        names += [f"{o} recv" for o in self.owner_names]
        return names

    def work_s(self) -> np.ndarray:
        """Work of one microbatch on every resource (compute, send, receive of each owner)."""
        n = self.num_owners
        owner, nxt, cross, comp, xfer = self._arrays
        work = np.zeros(3 * n)
        work[:n] = np.bincount(owner, weights=comp, minlength=n)
        work[n : 2 * n] = np.bincount(owner[cross], weights=xfer[cross], minlength=n)
        work[2 * n :] = np.bincount(nxt[cross], weights=xfer[cross], minlength=n)
        return work

    def busy_s(self) -> np.ndarray:
        """Work per iteration on every resource (all microbatches)."""
        return self.microbatches * self.work_s()

    def chain_s(self) -> float:
        """One microbatch's round trip: every segment and crossing transfer, no waiting."""
        _, _, cross, comp, xfer = self._arrays
        return float(comp.sum() + xfer[cross].sum())


def lower_bound(p: Pipeline) -> float:
    """Optimistic period: the busiest resource's serialized work, or one microbatch's cycle
    (:func:`~.bounds.tpot_lower_bound`, the bound branch-and-bound prunes with)."""
    n = p.num_owners
    _, _, cross, _, xfer = p._arrays
    work = p.work_s()
    return float(
        tpot_lower_bound(p.microbatches, list(work[:n]), list(work[n:]), xfer[cross].sum())
    )


# -- exact steady state: max-plus composition ----------------------------------------------------
def _serial_step(ready: np.ndarray, free: np.ndarray, duration: float) -> np.ndarray:
    """All microbatches pass one serial resource in order; returns their finish rows.

    Row ``m`` of ``ready`` is microbatch m's ready time as a max-plus form of the initial state;
    ``free`` the resource's. Finish ``t_m = (m+1)d + max(free, max_{k<=m} (r_k - k d))``.
    """
    m = ready.shape[0]
    if m == 1:
        return np.maximum(ready, free) + duration
    steps = np.arange(m, dtype=np.float64) * duration
    z = ready - steps[:, None]
    z[0] = np.maximum(z[0], free)
    np.maximum.accumulate(z, axis=0, out=z)
    return z + (steps + duration)[:, None]


def _apply_segments(p: Pipeline, state: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Apply segments ``lo..hi-1`` (compute, then the transfer after it) to a symbolic state."""
    n = p.num_owners
    r = 3 * n
    state = state.copy()
    for s in range(lo, hi):
        o = p.seg_owner[s]
        fin = _serial_step(state[r:], state[o], p.compute_s[s])
        state[r:] = fin
        state[o] = fin[-1]
        if p.crosses(s):
            o2 = p.seg_owner[(s + 1) % p.num_segments]
            links = np.maximum(state[n + o], state[2 * n + o2])
            fin = _serial_step(state[r:], links, p.transfer_s[s])
            state[r:] = fin
            state[n + o] = fin[-1]
            state[2 * n + o2] = fin[-1]
    return state


def _mp_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Max-plus matrix product ``(a ⊗ b)[i, j] = max_k a[i, k] + b[k, j]``."""
    return np.max(a[:, :, None] + b[None, :, :], axis=1)


def _mp_pow(a: np.ndarray, q: int) -> np.ndarray:
    out = None
    base = a
    while q:
        if q & 1:
            out = base if out is None else _mp_mul(base, out)
        q >>= 1
        if q:
            base = _mp_mul(base, base)
    assert out is not None
    return out


def _periodic_run(p: Pipeline) -> tuple[int, int, int] | None:
    """``(start, period, copies)`` of the longest run of identical segment blocks, if any."""
    period = p.period_hint
    s_total = p.num_segments
    if not period or period < 1 or 2 * period > s_total:
        return None
    owner, nxt, _, comp, xfer = p._arrays
    same = (
        (owner[:-period] == owner[period:])
        & (nxt[:-period] == nxt[period:])
        & (comp[:-period] == comp[period:])
        & (xfer[:-period] == xfer[period:])
    )
    if not same.any():
        return None
    # longest run of consecutive matches: segments [start, end) equal those one period later
    edges = np.diff(np.concatenate(([0], same.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    k = int(np.argmax(ends - starts))
    start, end = int(starts[k]), int(ends[k])
    copies = (end + period - start) // period
    return (start, period, copies) if copies >= 2 else None


def iteration_matrix(p: Pipeline) -> np.ndarray:
    """Max-plus matrix ``A`` of one iteration over the state (3n resources, then M microbatches)."""
    d = 3 * p.num_owners + p.microbatches
    ident = np.full((d, d), NEG)
    np.fill_diagonal(ident, 0.0)
    run = _periodic_run(p)
    if run is None:
        return _apply_segments(p, ident, 0, p.num_segments)
    start, period, copies = run
    state = _apply_segments(p, ident, 0, start)
    block = _apply_segments(p, ident, start, start + period)
    state = _mp_mul(_mp_pow(block, copies), state)
    return _apply_segments(p, state, start + period * copies, p.num_segments)


def max_cycle_mean(a: np.ndarray) -> float:
    """Maximum cycle mean of the graph with edge ``j -> i`` of weight ``a[i, j]`` (Karp).

    Every node starts walks (a zero-weight super source), which makes the formula valid for
    graphs that are not strongly connected.
    """
    d = a.shape[0]
    walks = np.empty((d + 1, d))
    walks[0] = 0.0
    for k in range(1, d + 1):
        walks[k] = np.max(a + walks[k - 1][None, :], axis=1)
    best = -math.inf
    for v in range(d):
        if walks[d, v] == NEG:
            continue
        ratios = [(walks[d, v] - walks[k, v]) / (d - k) for k in range(d) if walks[k, v] != NEG]
        if ratios:
            best = max(best, float(min(ratios)))
    return best


def cycle_time(p: Pipeline) -> float:
    """Exact steady-state period (TPOT) of the schedule.

    Clamped below by :func:`lower_bound` (which it equals whenever the bound is tight) so that
    rounding in the eigenvalue computation can never make it fall under a provable bound.
    """
    return float(max(max_cycle_mean(iteration_matrix(p)), lower_bound(p)))


# -- discrete-event simulation -------------------------------------------------------------------
@dataclass(frozen=True)
class TraceEvent:
    """One task of the simulated schedule on one resource."""

    resource: str
    start_s: float
    end_s: float
    label: str
    iteration: int
    microbatch: int
    segment: int
    kind: str  # "compute", "transfer" or "return"


@dataclass(frozen=True)
class EventRun:
    """Result of :func:`simulate_events`: every task of ``iterations`` iterations."""

    events: tuple[TraceEvent, ...]
    iteration_end_s: tuple[float, ...]
    iteration_start_s: tuple[float, ...]

    def periods_s(self) -> list[float]:
        ends = self.iteration_end_s
        return [b - a for a, b in itertools.pairwise(ends)]


def simulate_events(p: Pipeline, iterations: int = 6) -> EventRun:
    """Discrete-event simulation of ``iterations`` decode iterations from an idle start.

    Deterministic: events are processed in ``(time, sequence number)`` order and tasks are
    created in the fixed per-resource order described in the module docstring.
    """
    n, m_count, s_count = p.num_owners, p.microbatches, p.num_segments
    names = p.resource_names()
    labels = p.seg_labels or tuple(f"seg{s}" for s in range(s_count))
    durs: list[float] = []
    res: list[tuple[int, ...]] = []
    preds: list[list[int]] = []
    meta: list[tuple[int, int, int, str]] = []
    last_on: dict[int, int] = {}
    arrive: dict[int, int] = {}  # microbatch -> task its next segment waits for

    def add(
        resources: tuple[int, ...], dur: float, deps: list[int], info: tuple[int, int, int, str]
    ) -> int:
        tid = len(durs)
        pre = list(deps)
        for r in resources:
            if r in last_on:
                pre.append(last_on[r])
            last_on[r] = tid
        durs.append(dur)
        res.append(resources)
        preds.append(pre)
        meta.append(info)
        return tid

    for it in range(iterations):
        for s in range(s_count):
            o = p.seg_owner[s]
            for mb in range(m_count):
                dep = [arrive[mb]] if mb in arrive else []
                arrive[mb] = add((o,), p.compute_s[s], dep, (it, mb, s, "compute"))
            if p.crosses(s):
                o2 = p.seg_owner[(s + 1) % s_count]
                kind = "return" if s == s_count - 1 else "transfer"
                for mb in range(m_count):
                    arrive[mb] = add(
                        (n + o, 2 * n + o2), p.transfer_s[s], [arrive[mb]], (it, mb, s, kind)
                    )

    count = len(durs)
    succs: list[list[int]] = [[] for _ in range(count)]
    waiting = [0] * count
    for tid, pre in enumerate(preds):
        unique = set(pre)
        waiting[tid] = len(unique)
        for q in unique:
            succs[q].append(tid)
    start = [0.0] * count
    finish = [0.0] * count
    heap: list[tuple[float, int, int]] = []
    seq = 0
    for tid in range(count):
        if waiting[tid] == 0:
            heap.append((durs[tid], seq, tid))
            seq += 1
    heapq.heapify(heap)
    while heap:
        time, _, tid = heapq.heappop(heap)
        finish[tid] = time
        for nxt in succs[tid]:
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                begin = max(finish[q] for q in preds[nxt])
                start[nxt] = begin
                heapq.heappush(heap, (begin + durs[nxt], seq, nxt))
                seq += 1

    events = []
    it_end = [0.0] * iterations
    it_start = [math.inf] * iterations
    for tid in range(count):
        it, mb, s, kind = meta[tid]
        it_end[it] = max(it_end[it], finish[tid])
        if kind == "compute" and s == 0:
            it_start[it] = min(it_start[it], start[tid])
        label = (
            f"m{mb} {labels[s]}"
            if kind == "compute"
            else (f"m{mb} token" if kind == "return" else f"m{mb} {labels[s]}->")
        )
        for r in res[tid]:
            events.append(TraceEvent(names[r], start[tid], finish[tid], label, it, mb, s, kind))
    return EventRun(tuple(events), tuple(it_end), tuple(it_start))


def steady_window(run: EventRun, period: float) -> tuple[float, float, list[TraceEvent]]:
    """Tasks of one steady-state iteration: the window of one period from the start of the
    second-to-last simulated iteration, every task overlapping it clipped to it."""
    k = max(len(run.iteration_start_s) - 2, 0)
    t0 = run.iteration_start_s[k]
    t1 = t0 + period
    out = []
    for ev in run.events:
        if ev.end_s > t0 and ev.start_s < t1 and ev.end_s > ev.start_s:
            out.append(
                TraceEvent(
                    ev.resource,
                    max(ev.start_s, t0),
                    min(ev.end_s, t1),
                    ev.label,
                    ev.iteration,
                    ev.microbatch,
                    ev.segment,
                    ev.kind,
                )
            )
    return t0, t1, out
