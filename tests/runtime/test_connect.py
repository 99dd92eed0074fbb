"""Every connection a rank uses is made before it reports ready (runtime/_private/connect.py).

NCCL connects lazily through listening ports that a rank closes once it has joined, so the
peers a rank connects to beforehand must be exactly those it exchanges messages with, on both
sides of every pair (else the warm-up deadlocks or a later message finds no connection). The
torch point-to-point seam runs CUDA's path on CPU (gloo): the transport refuses a message to a
peer it did not connect to, so a wrong peer set fails these runs with that error.
"""

from __future__ import annotations

import pytest

from opweave.costmodel import Plan, PrefillPool, canonical_plan, load_model
from opweave.runtime import Cluster, OfflineDriver, Request, RunOptions, run_plan
from opweave.runtime._private import join
from opweave.runtime._private.connect import message_peers
from opweave.runtime._private.placement import Placement, plan_model
from opweave.runtime._private.schedule import compile_schedule
from opweave.runtime.errors import RunFailedError

MAX_NEW_TOKENS = 16  # as the other runtime tests, so hf_greedy's cache is shared


def _plans(tiny_model) -> dict[str, tuple[Plan, str]]:
    llama, moe, mla = tiny_model("llama"), tiny_model("qwen3_moe"), tiny_model("deepseek_v3")
    afd = canonical_plan(load_model(llama), "afd", gpu="cpu", batch=4, microbatches=2, tp=2)
    cad = canonical_plan(load_model(llama), "cad", gpu="cpu", batch=4, microbatches=2)
    two = cad.model_copy(
        update={"owners": [o.model_copy(update={"replicas": 2}) for o in cad.owners]}
    )
    ep = canonical_plan(load_model(mla), "colocated", gpu="cpu", batch=4, tp=2, ep=4, dp=2)
    afd_moe = canonical_plan(load_model(moe), "afd", gpu="cpu", batch=4, microbatches=1)
    ffn = afd_moe.owners[1].model_copy(update={"ep": 2, "dp": 2})
    return {
        "afd-tp2": (afd, llama),
        "cad-two-replicas": (two, llama),
        "afd-tp2-prefill-tp1": (
            afd.model_copy(update={"prefill": PrefillPool(gpu="cpu", tp=1, replicas=2)}),
            llama,
        ),
        "ep-dp-prefill": (
            ep.model_copy(update={"prefill": PrefillPool(gpu="cpu", tp=2, ep=4, dp=2, replicas=1)}),
            mla,
        ),
        "afd-ep-ffn-prefill": (
            afd_moe.model_copy(
                update={
                    "owners": [afd_moe.owners[0], ffn],
                    "prefill": PrefillPool(gpu="cpu", tp=1, replicas=1),
                }
            ),
            moe,
        ),
    }


@pytest.mark.parametrize(
    "name",
    ["afd-tp2", "cad-two-replicas", "afd-tp2-prefill-tp1", "ep-dp-prefill", "afd-ep-ffn-prefill"],
)
def test_every_rank_connects_to_the_peers_that_connect_to_it(name, tiny_model):
    plan, model_dir = _plans(tiny_model)[name]
    placement = Placement(plan, plan_model(plan, model_dir))
    peers = {r: set(message_peers(placement, r)) for r in range(placement.world_size)}
    for rank, mine in peers.items():
        for peer in mine:
            assert rank in peers[peer], (name, rank, peer)
    # a leader connects to every other leader its schedule sends to or receives from
    for rank in range(placement.decode_world):
        for action in compile_schedule(placement, rank):
            if placement.ranks[rank].is_leader:
                links = (*action.sources, *action.dests, *action.feeds, *action.fed_by)
                assert {m.peer for m in links} - {rank} <= peers[rank]
    if plan.prefill is not None:  # the pool's senders, by the placement's own routing
        pool = set(range(placement.decode_world, placement.world_size))
        seqs = range(4 * plan.prefill.replicas * plan.prefill.dp)
        for r in placement.ranks[: placement.decode_world]:
            senders = set()
            if placement.holds_state(r.owner):
                senders = {
                    placement.prefill_sender(replica, seq, r.tp_rank)
                    for replica in range(plan.prefill.replicas)
                    for seq in seqs
                }
            assert peers[r.rank] & pool == senders, (name, r.rank)


def test_a_deepseek_style_pd_run_connects_every_pair_before_it_starts(
    tiny_model, hf_greedy, prompts
):
    """Decode on TP 2 x DP 2 with experts over four ranks, a prefill replica laid out the
    same way, through the point-to-point seam: the groups (an all-to-all in each expert group)
    and every pair connect first, then the run serves transformers' tokens."""
    plan, model_dir = _plans(tiny_model)["ep-dp-prefill"]
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    options = RunOptions(timeout_s=20.0, test_torch_p2p=True)
    result = run_plan(plan, model_dir, requests, options)
    assert result is not None
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
    assert result.transfer is not None and result.transfer.messages == 2 * len(prompts)


def test_a_peer_left_out_of_the_warm_up_is_an_error_naming_both_ranks(
    monkeypatch, tiny_model, prompts
):
    """The transport checks every message against the peers connected beforehand: a warm-up
    that missed the prefill pool fails the run with that error (forked ranks share the patch)."""
    plan, model_dir = _plans(tiny_model)["afd-tp2-prefill-tp1"]
    decode = Placement(plan, plan_model(plan, model_dir)).decode_world

    def without_the_pool(placement, rank):
        return [p for p in message_peers(placement, rank) if p < decode and rank < decode]

    monkeypatch.setattr(join, "message_peers", without_the_pool)
    options = RunOptions(timeout_s=20.0, test_torch_p2p=True)
    model = load_model(model_dir)
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    cluster = Cluster(plan, model, model_dir, options, start_method="fork")
    try:
        with pytest.raises(RunFailedError, match="which it did not connect to before the run"):
            OfflineDriver(cluster, requests, model.arch.eos_token_ids).run()
    finally:
        cluster.close()
