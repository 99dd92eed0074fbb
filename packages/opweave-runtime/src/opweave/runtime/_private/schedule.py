"""Each rank's static per-iteration action list, compiled once from the placement.

Every rank compiles the same deterministic function of the plan, so each knows, before the first
token, exactly which messages it will receive (from whom, for which slots, under which tag) and
which it will send: no coordinator, no control round trip between stages or microbatches.

Order and deadlock freedom: actions are sorted by ``(segment, microbatch)`` (the driver's
:class:`Drive` of microbatch ``k`` first, as it feeds segment 0). A compute depends only on the
previous segment of the same microbatch, or, for segment 0, on the last segment of the previous
iteration; both come strictly earlier in the global ``(iteration, segment, microbatch)`` order, and
sends never block (``isend``), so by induction every action completes. The same order gives each
ordered pair of ranks one consistent message sequence, which NCCL (no tags) also needs.

Message pattern: a message flows between two replica groups for microbatch ``k`` exactly when
their slot ranges overlap inside the microbatch, whatever the requests are; a message may carry
zero requests, so a receiver never needs to be told whether to expect it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graph import OpRef
from .placement import DRIVER_RANK, Placement, overlap


@dataclass(frozen=True)
class Link:
    """One message of a microbatch: to or from ``peer`` (a leader, or the driver), for ``slots``."""

    peer: int
    slots: range
    tag: int


@dataclass(frozen=True)
class Drive:
    """Driver only: collect microbatch ``k``'s sampled tokens, then feed its next iteration."""

    microbatch: int
    tokens_from: tuple[Link, ...]
    inputs_to: tuple[Link, ...]


@dataclass(frozen=True)
class Compute:
    """Run one segment for one microbatch on this replica's ``slots``.

    ``sources``/``dests`` are the replica group's messages: only the leader receives and sends,
    but every TP rank knows how many parts the leader fans out.
    """

    segment: int
    microbatch: int
    slots: range
    ops: range
    sources: tuple[Link, ...]
    dests: tuple[Link, ...]
    samples: bool


Action = Drive | Compute


def tag(segment: int, microbatch: int, microbatches: int) -> int:
    """Tag of a message *into* ``segment`` (``num_segments`` = tokens back to the driver)."""
    return segment * microbatches + microbatch


def rank_ops(placement: Placement, rank: int) -> list[OpRef]:
    """The rank's operators: its owner's segments in model order (one StageModule holds them)."""
    owner = placement.ranks[rank].owner
    return [OpRef(op.layer, op.name) for seg in placement.segments_of(owner) for op in seg.ops]


def compile_schedule(placement: Placement, rank: int) -> list[Action]:
    """The actions ``rank`` runs every iteration, in execution order."""
    p, info = placement, placement.ranks[rank]
    num_seg, m = p.num_segments, p.microbatches
    keyed: list[tuple[tuple[int, int, int], Action]] = []
    if rank == DRIVER_RANK:
        last_owner = p.segments[-1].owner
        for k in range(m):
            mb = p.microbatch_slots(k)
            tokens_from = tuple(
                Link(p.leader(last_owner, j), part, tag(num_seg, k, m))
                for j, part in p.replicas_serving(last_owner, mb)
            )
            inputs_to = tuple(
                Link(p.leader(0, j), part, tag(0, k, m)) for j, part in p.replicas_serving(0, mb)
            )
            keyed.append(((0, k, 0), Drive(k, tokens_from, inputs_to)))
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
            if s == 0:
                sources: tuple[Link, ...] = (Link(DRIVER_RANK, part, tag(0, k, m)),)
            else:
                prev = p.segments[s - 1].owner
                sources = tuple(
                    Link(p.leader(prev, j), ov, tag(s, k, m))
                    for j, ov in p.replicas_serving(prev, part)
                )
            if s == num_seg - 1:
                dests: tuple[Link, ...] = (Link(DRIVER_RANK, part, tag(num_seg, k, m)),)
            else:
                nxt = p.segments[s + 1].owner
                dests = tuple(
                    Link(p.leader(nxt, j), ov, tag(s + 1, k, m))
                    for j, ov in p.replicas_serving(nxt, part)
                )
            keyed.append(((s, k, 1), Compute(s, k, part, ops, sources, dests, s == num_seg - 1)))
    keyed.sort(key=lambda item: item[0])
    return [action for _, action in keyed]


def microbatches_of(actions: list[Action]) -> set[int]:
    return {a.microbatch for a in actions}
