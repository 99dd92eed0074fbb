"""A tensor-parallel fan-out that times out names the rank it waited on: a member names its
leader, and the leader (whose send found nobody receiving) names the member, not itself."""

from __future__ import annotations

import time

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
            payload = torch.zeros(16 << 20, dtype=torch.uint8)  # beyond a socket's buffers
            try:
                _broadcast(payload, 0, group)
                blamed.append("none")
            except PeerError as exc:
                blamed.append(exc.peer)
        else:
            time.sleep(AWAY_S)
            blamed.append("away")
        dist.barrier()
    return blamed


def test_a_timed_out_fan_out_names_the_rank_it_waited_on():
    results = run_gloo_pair(_rank)
    assert results[0] == [1, "away"]  # the leader's send timed out: rank 1 did not receive
    assert results[1] == ["away", 0]  # rank 1's receive timed out: rank 0 did not send
