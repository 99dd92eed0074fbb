"""Each rank's static per-iteration action list, compiled once from the placement.

Every rank compiles the same deterministic function of the plan, so each knows, before the first
token, exactly which messages it will receive (from whom, for which slots, under which tag) and
which it will send: no control round trip between stages or microbatches. The driver only tells
each rank, per microbatch and iteration, which requests it runs (:class:`~.work.Work`); the first
segment takes its input from that, the last one returns the sampled tokens to the driver.

Order and deadlock freedom: actions are sorted by ``(segment, microbatch)``. A compute depends
only on the previous segment of the same microbatch, or, for segment 0, on the driver's work for
it; both come strictly earlier in the global ``(iteration, segment, microbatch)`` order, and sends
never block, so by induction every action completes. The same order gives each ordered pair of
ranks one consistent message sequence, which NCCL (no tags) also needs. A forward work's tokens
(:class:`Compute` ``feeds``) keep it: the last segment sorts last, so they are the last thing its
leaders send in an iteration, and the first segment's leaders take them first in the next.

Message pattern: a message flows between two replica groups for microbatch ``k`` exactly when
their slot ranges overlap inside the microbatch, whatever the requests are; a message may carry
zero requests, so a receiver never needs to be told whether to expect it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graph import OpRef
from .placement import Placement, overlap


@dataclass(frozen=True)
class Message:
    """One message of a microbatch: to or from the leader ``peer``, for ``slots``."""

    peer: int
    slots: range
    tag: int


@dataclass(frozen=True)
class Compute:
    """Run one segment for one microbatch on this replica's ``slots``.

    ``sources``/``dests`` are the replica group's messages: only the leader receives and sends,
    but every TP rank knows how many parts the leader fans out. The first segment has no sources
    (its input is the driver's work), the last one no destinations (its tokens go to the driver).
    ``feeds`` (the last segment's) and ``fed_by`` (the first segment's) link the two ends for a
    forward work's sampled tokens (:class:`~.work.Work`): from each last-segment leader to the
    first-segment leaders holding its slots, under the microbatch's tag into segment 0, which no
    activation uses. A peer may be the rank itself (one owner runs both ends).
    """

    segment: int
    microbatch: int
    slots: range
    ops: range
    sources: tuple[Message, ...]
    dests: tuple[Message, ...]
    first: bool
    last: bool
    feeds: tuple[Message, ...] = ()
    fed_by: tuple[Message, ...] = ()


def tag(segment: int, microbatch: int, microbatches: int) -> int:
    """Tag of a message *into* ``segment``."""
    return segment * microbatches + microbatch


def rank_ops(placement: Placement, rank: int) -> list[OpRef]:
    """The rank's operators: its owner's segments in model order (one StageModule holds them)."""
    owner = placement.ranks[rank].owner
    return [OpRef(op.layer, op.name) for seg in placement.segments_of(owner) for op in seg.ops]


def compile_schedule(placement: Placement, rank: int) -> list[Compute]:
    """The actions ``rank`` runs every iteration, in execution order."""
    p, info = placement, placement.ranks[rank]
    if info.prefills:  # a prefill pool's rank runs no decode iteration
        return []
    num_seg, m = p.num_segments, p.microbatches
    keyed: list[tuple[tuple[int, int], Compute]] = []
    mine = p.replica_slots(info.owner, info.replica)
    offset = 0
    for s, seg in enumerate(p.segments):
        if seg.owner != info.owner:
            continue
        ops = range(offset, offset + len(seg.ops))
        offset += len(seg.ops)
        for k in range(m):
            part = overlap(mine, p.microbatch_slots(k))
            if not part:
                continue
            first, last = s == 0, s == num_seg - 1
            sources = () if first else _links(p, p.segments[s - 1].owner, part, tag(s, k, m))
            dests = () if last else _links(p, p.segments[s + 1].owner, part, tag(s + 1, k, m))
            feeds = _links(p, p.segments[0].owner, part, tag(0, k, m)) if last else ()
            fed_by = _links(p, p.segments[-1].owner, part, tag(0, k, m)) if first else ()
            action = Compute(s, k, part, ops, sources, dests, first, last, feeds, fed_by)
            keyed.append(((s, k), action))
    keyed.sort(key=lambda item: item[0])
    return [action for _, action in keyed]


def _links(p: Placement, owner: int, slots: range, tag: int) -> tuple[Message, ...]:
    """A message to or from each replica leader of ``owner`` holding some of ``slots``."""
    return tuple(Message(p.leader(owner, j), ov, tag) for j, ov in p.replicas_serving(owner, slots))


def microbatches_of(actions: list[Compute]) -> set[int]:
    return {a.microbatch for a in actions}
