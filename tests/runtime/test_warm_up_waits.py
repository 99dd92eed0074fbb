"""A warm-up's collectives wait for peers still compiling (up to the join deadline), an
iteration's for the run's timeout; and when two peers both fail, the failure names the one that
did not answer, not the one that lost its connection after."""

from __future__ import annotations

import time

from opweave.runtime._private.faults import RankView, diagnose
from opweave.runtime._private.messages import Error
from tests.helpers import run_gloo_pair

SHORT_S = 1.0  # the group's own timeout
LATE_S = 3.0  # how late rank 1 comes to each collective


def _rank(rank: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from opweave.runtime._private.tensor_parallel import new_groups, patient

    group = new_groups([(0, 1)], rank, SHORT_S)
    dist.barrier()
    outcomes = []
    for patient_wait in (True, False):  # a warm-up, then an iteration
        x = torch.ones(4)
        if rank == 1:
            time.sleep(LATE_S)  # compiling its step
        try:
            if patient_wait:
                with patient([group, None], 60.0, SHORT_S):
                    dist.all_reduce(x, group=group)
            else:
                dist.all_reduce(x, group=group)
            outcomes.append(f"sum {x[0].item():g}")
        except RuntimeError as exc:
            outcomes.append(str(exc).splitlines()[0])
            break
    return outcomes


def test_a_warm_up_collective_waits_for_a_late_peer_and_an_iteration_does_not():
    results = run_gloo_pair(_rank)
    # rank 0 waited 3 s within the warm-up's deadline; after it, the group's 1 s applies again
    assert results[0][0] == "sum 2"
    assert "Timed out" in results[0][1], results[0]


def _who(rank: int) -> str:
    return f"rank {rank}"


def test_the_peer_that_did_not_answer_is_named_when_both_report():
    """Rank 3 timed out waiting for rank 2, then exited; rank 2's next collective found the
    connection closed. Both are the group's peers: rank 2 is the one that stopped answering."""
    timed_out = Error("peer", "Timed out waiting 10000ms for recv operation to complete", 2)
    closed = Error("peer", "[pair.cc:561] Connection closed by peer [127.0.0.1]:20657", 3)
    views = {r: RankView(None, False) for r in range(5)}
    views[2], views[3] = RankView(closed, True), RankView(timed_out, True)
    line = diagnose(views, {}, 5, _who)
    assert line == f"rank 2 stopped responding: rank 3 reported: {timed_out.message}"


def test_an_error_of_its_own_comes_before_a_peers_lost_connection():
    """Rank 4 failed on its own; rank 2, its peer, then lost the connection: rank 4 is named."""
    closed = Error("peer", "[pair.cc:561] Connection closed by peer [127.0.0.1]:20657", 4)
    own = Error("error", "RuntimeError: shape mismatch in down_proj")
    views = {r: RankView(None, False) for r in range(5)}
    views[2], views[4] = RankView(closed, True), RankView(own, True)
    assert diagnose(views, {}, 5, _who) == f"rank 4 failed: {own.message}"
