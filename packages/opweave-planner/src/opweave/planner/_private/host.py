"""Host-side execution effects: what a rank's host costs beside its operators and transfers.

On a GPU the host enqueues a token's work ahead of the device, so none of it is on the critical
path: a schedule is its operator and transfer durations, and nothing here applies. Where a
device's profile measured its host instead (CPU ranks, whose one thread runs the schedule, packs
every message and shares caches with its neighbours), these effects lengthen the segments'
compute. Each is a small pure function of a :class:`Draft` (the schedule before host effects)
that returns the seconds it adds to each segment; :func:`host_effects` selects the ones the
devices' profiles hold, none by default; :func:`with_cold_caches` is the one effect that depends
on the schedule itself, and is iterated to a fixed point over it.

The effects (each documented on the profile field it reads):

- :func:`stage_loop`: the rank's loop around each stage (``OrchestrationProfile.stage_s``);
- :func:`message_handling`: a host-driven transport's send and receive on the compute stream
  (``TransferProfile.host_send_s`` / ``host_recv_s``);
- :func:`driver_bookkeeping`: the driver's work per microbatch before segment 0
  (``OrchestrationProfile.drive_s``);
- :func:`with_cold_caches`: operators slowed by the bytes that went cold while their rank idled
  (:class:`~opweave.costmodel.IdleSlowdown`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from opweave.costmodel import IdleSlowdown, OrchestrationProfile, Profile

from .simulator import Pipeline, TraceEvent, simulate_events


@dataclass(frozen=True)
class HostModel:
    """What a device's profile measured of its host; everything absent (a GPU) by default.

    ``messages``: per link kind, the compute-stream seconds one message costs its sender and its
    receiver."""

    messages: tuple[tuple[str, float, float], ...] = ()
    orchestration: OrchestrationProfile | None = None
    idle_slowdown: IdleSlowdown | None = None

    @classmethod
    def of(cls, profile: Profile | None) -> HostModel:
        if profile is None:
            return NO_HOST
        loop = profile.orchestration
        return cls(
            messages=tuple(
                (t.link, t.host_send_s, t.host_recv_s)
                for t in profile.transfers
                if t.host_send_s or t.host_recv_s
            ),
            orchestration=None if loop is None or loop == OrchestrationProfile() else loop,
            idle_slowdown=profile.idle_slowdown,
        )

    def message_s(self, kind: str) -> tuple[float, float]:
        """(sender, receiver) compute-stream seconds of one message over link ``kind``."""
        return next(((s, r) for k, s, r in self.messages if k == kind), (0.0, 0.0))


NO_HOST = HostModel()


@dataclass(frozen=True)
class Draft:
    """A schedule before host effects, as the effects read it.

    ``hosts``: each owner's :class:`HostModel`; ``seg_owner``: each segment's owner;
    ``requests``: each owner's requests per microbatch; ``link_kinds``: per segment the link its
    output crosses to the next segment's owner (``""``: the same owner); ``driven_requests``: the
    requests of one microbatch of the global batch, which the driver handles before segment 0."""

    hosts: tuple[HostModel, ...]
    seg_owner: tuple[int, ...]
    requests: tuple[float, ...]
    link_kinds: tuple[str, ...]
    driven_requests: float

    def zeros(self) -> np.ndarray:
        return np.zeros(len(self.seg_owner))


Effect = Callable[[Draft], np.ndarray]


def stage_loop(draft: Draft) -> np.ndarray:
    """Each segment's rank loop around its operators, for its owner's microbatch."""
    out = draft.zeros()
    for s, o in enumerate(draft.seg_owner):
        loop = draft.hosts[o].orchestration
        if loop is not None:
            out[s] = loop.stage(draft.requests[o])
    return out


def message_handling(draft: Draft) -> np.ndarray:
    """A message between owners occupies both ranks' compute streams where the transport is
    host-driven: the sender's after its segment, the receiver's before the next."""
    out = draft.zeros()
    total = len(draft.seg_owner)
    for s, kind in enumerate(draft.link_kinds):
        if kind:
            nxt = (s + 1) % total
            out[s] += draft.hosts[draft.seg_owner[s]].message_s(kind)[0]
            out[nxt] += draft.hosts[draft.seg_owner[nxt]].message_s(kind)[1]
    return out


def driver_bookkeeping(draft: Draft) -> np.ndarray:
    """The driver (on the first segment's owner) collects and feeds every request of the
    microbatch before segment 0 runs it."""
    out = draft.zeros()
    loop = draft.hosts[draft.seg_owner[0]].orchestration
    if loop is not None:
        out[0] = loop.drive(draft.driven_requests)
    return out


def host_effects(hosts: Sequence[HostModel]) -> tuple[Effect, ...]:
    """The additive effects the owners' profiles hold data for (none for GPUs)."""
    effects: list[Effect] = []
    loops = any(h.orchestration is not None for h in hosts)
    if loops:
        effects.append(stage_loop)
    if any(h.messages for h in hosts):
        effects.append(message_handling)
    if loops:
        effects.append(driver_bookkeeping)
    return tuple(effects)


def host_time(draft: Draft, effects: Sequence[Effect]) -> np.ndarray:
    """Seconds the effects add to each segment's compute."""
    out = draft.zeros()
    for effect in effects:
        out += effect(draft)
    return out


def cools(hosts: Sequence[HostModel]) -> bool:
    """Whether any owner's operators slow down after idling (the schedule then decides the
    durations: see :func:`with_cold_caches`)."""
    return any(h.idle_slowdown is not None for h in hosts)


def with_cold_caches(
    pipe: Pipeline,
    touched: np.ndarray,
    slowdowns: Sequence[IdleSlowdown | None],
    *,
    rounds: int = 24,
    tolerance: float = 1e-4,
) -> Pipeline:
    """``pipe`` with every segment's operators slowed by the bytes they touch (``touched``)
    that went cold while their rank idled since it last ran that segment; ``slowdowns`` per
    owner. The idle times come from the schedule and the schedule from the durations, so the
    two are iterated to a fixed point: each segment steps to its new target, by half as much
    again every time its step changes direction, until no segment's target is further than
    ``tolerance`` of the total hot compute."""
    hot = np.asarray(pipe.compute_s, dtype=float)
    extra = np.zeros(len(hot))
    current = pipe
    damping = np.ones(len(hot))
    previous = np.zeros(len(hot))
    limit = tolerance * float(np.sum(hot))
    for _ in range(rounds):
        idle = idle_since_last_run(current)
        target = np.array(
            [
                0.0
                if (cold := slowdowns[o]) is None
                else np.mean([cold.extra_s(b, x) for x in row])
                for o, b, row in zip(pipe.seg_owner, touched, idle, strict=True)
            ]
        )
        residual = target - extra
        if float(np.max(np.abs(residual))) <= limit:
            break
        damping[residual * previous < 0] *= 0.5  # overshot: go half as far from now on
        previous = damping * residual
        extra = np.maximum(extra + previous, 0.0)
        current = dataclasses.replace(pipe, compute_s=tuple((hot + extra).tolist()))
    return current


def idle_since_last_run(pipe: Pipeline, iterations: int = 6) -> np.ndarray:
    """``S x M``: how long each segment's rank sat idle between its previous run of that segment
    (the previous microbatch, or the previous iteration) and its run for each microbatch, in a
    steady-state iteration of the event simulation."""
    run = simulate_events(pipe, iterations)
    steady = iterations - 2
    idle = np.zeros((pipe.num_segments, pipe.microbatches))
    streams: dict[str, list[TraceEvent]] = {}
    for ev in run.events:
        if ev.kind == "compute":
            streams.setdefault(ev.resource, []).append(ev)
    for events in streams.values():
        events.sort(key=lambda e: e.start_s)
        waited = 0.0  # idle time on this stream so far
        last_end = events[0].start_s
        seen: dict[int, float] = {}  # segment -> idle time so far when it last ended
        for ev in events:
            waited += max(ev.start_s - last_end, 0.0)
            if ev.iteration == steady and ev.segment in seen:
                idle[ev.segment, ev.microbatch] = waited - seen[ev.segment]
            seen[ev.segment] = waited
            last_end = ev.end_s
    return idle
