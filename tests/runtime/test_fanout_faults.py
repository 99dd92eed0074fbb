"""A tensor-parallel fan-out that times out names the rank it waited on: in a pair, the leader
(whose send found nobody receiving) names the member, not itself, and the member its leader; in
a larger group, which relays the broadcast, the driver names the group's silent rank."""

from __future__ import annotations

import time

from opweave.runtime._private.faults import RankView, diagnose
from opweave.runtime._private.messages import Error
from tests.helpers import run_gloo_pair

SHORT_S = 1.0  # the groups' own timeout
AWAY_S = 4.0  # how long the other rank stays out of the collective


def _rank(rank: int) -> list:
    import torch
    import torch.distributed as dist

    from opweave.runtime._private.tensor_parallel import new_groups
    from opweave.runtime._private.transport import _broadcast
    from opweave.runtime._private.wire import PeerError

    # one group per case: a collective that timed out leaves its group unusable
    groups = [new_groups([(0, 1)], rank, SHORT_S) for _ in range(2)]
    dist.barrier()
    blamed = []
    for case, group in enumerate(groups):
        sender = case == 0  # first the leader sends to an absent member, then the reverse
        if (rank == 0) == sender:
            payload = torch.zeros(1 << 20, dtype=torch.uint8)
            try:
                _broadcast(payload, 0, group)
                blamed.append("none")
            except PeerError as exc:
                blamed.append((exc.peer, exc.suspects))
        else:
            time.sleep(AWAY_S)
            blamed.append("away")
        dist.barrier()
    return blamed


def test_a_timed_out_fan_out_names_the_rank_it_waited_on():
    results = run_gloo_pair(_rank)
    assert results[0] == [(1, (1,)), "away"]  # the leader's send timed out: 1 did not receive
    assert results[1] == ["away", (0, (0,))]  # rank 1's receive timed out: 0 did not send


def _who(rank: int) -> str:
    return f"rank {rank}"


def test_a_larger_group_names_its_own_silent_rank():
    """Two TP-4 replicas (ranks 0-3, 4-7); rank 6 stopped. Its group's fan-out relays through
    members, so ranks 4, 5 and 7 time out naming no one peer but their group: rank 6 is named,
    not rank 0, the first silent rank of the run (idle in the other replica)."""
    message = "tensor-parallel fan-out from rank 4 failed: Timed out waiting 5000ms for send"
    views = {r: RankView(None, False) for r in range(8)}
    for rank in (4, 5, 7):
        group = tuple(r for r in range(4, 8) if r != rank)
        text = message if rank == 4 else "... Timed out waiting 5000ms for recv"
        views[rank] = RankView(Error("peer", text, None, group), True)
    line = diagnose(views, {}, 8, _who)
    assert line == f"rank 6 stopped responding: rank 4 reported: {message}"
