"""Every connection a rank will use, made before it reports ready; then its ports close.

NCCL connects lazily: a process group's communicator at its first collective, a pair of ranks'
at their first send, through listening sockets that any local process can reach. Measured on
an H100 with NCCL 2.28 (``tools/gpu/nccl_sockets.py``, two ranks): a connect-and-close flood
leaves NCCL unharmed, but silent connections held open on a rank's ports stall every connection
NCCL makes after (a new communicator hangs), and a process could hold them from the moment the
ports open. So a rank makes every connection before it reports ready: each process group it is
in runs a collective, and an all-to-all where experts are exchanged (``NCCL_RUNTIME_CONNECT=0``,
set by :func:`~.launch.rank_env`, makes NCCL connect every algorithm of a communicator then),
and each pair of ranks that exchange messages trades one; only then do its listening ports drop
new connections (:func:`~.proc.refuse_new_connections`). On the same H100, behind that guard,
all-reduces and sends of 4 KiB to 64 MiB still ran and a flood made no connection; NCCL's
NVLink and NVLS transports have not run behind it yet (``tools/gpu/two_nodes.py`` runs a whole
plan so on a lent GPU). ``NCCL_RUNTIME_CONNECT=1`` in the environment keeps the ports open.

Order: groups first, then pairs, each in one global order (TP groups, then expert groups, in
the placement's order; pairs by their lower rank, then the higher). A rank takes its own in that
order and each exchange blocks until every member took part, so the first one not yet done
always has every member waiting on it: no deadlock.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .nccl_env import NCCL_DEFAULTS
from .placement import Placement
from .schedule import compile_schedule

TAG = (1 << 30) + 1  # the warm-up's messages (no activation's or state's tag comes near)


def message_peers(placement: Placement, rank: int) -> list[int]:
    """The other ranks ``rank`` exchanges point-to-point messages with: a replica leader's
    schedule links (activations, sampled tokens) and a prefill pool's state transfers."""
    p, info = placement, placement.ranks[rank]
    peers: set[int] = set()
    if info.is_leader:  # only leaders send and receive a replica group's messages
        for action in compile_schedule(p, rank):
            links = (*action.sources, *action.dests, *action.feeds, *action.fed_by)
            peers.update(m.peer for m in links)
    pool = p.plan.prefill
    if pool is not None:
        if info.prefills:  # to every decode rank holding state at this TP position
            peers.update(
                r.rank
                for r in p.ranks[: p.decode_world]
                if p.holds_state(r.owner) and r.tp_rank % pool.tp == info.tp_rank
            )
        elif p.holds_state(info.owner):  # from the pool's ranks at this TP position
            peers.update(
                s.rank
                for replica in range(p.prefill_replicas)
                for s in p.prefill_ranks(replica)
                if s.tp_rank == info.tp_rank % pool.tp
            )
    peers.discard(rank)
    return sorted(peers)


def connect_all(
    placement: Placement,
    rank: int,
    device: torch.device,
    groups: list[tuple[tuple[int, ...], object]],
    peers: list[int],
) -> None:
    """Run one exchange in each of ``groups`` (this rank's ``(members, group)`` pairs) and
    with each of ``peers``, in the global order (module docstring)."""
    order = {g: i for i, g in enumerate([*placement.tp_groups, *placement.ep_groups])}
    for members, group in sorted(groups, key=lambda g: order[g[0]]):
        one = torch.zeros(1, device=device)
        dist.all_reduce(one, group=group)  # type: ignore[arg-type]
        if members in placement.ep_groups:  # expert exchanges send to every member
            out = torch.empty(len(members), device=device)
            dist.all_to_all_single(out, torch.zeros(len(members), device=device), group=group)  # type: ignore[arg-type]
        _sync(device)
    for peer in sorted(peers, key=lambda q: (min(q, rank), max(q, rank))):
        token = torch.zeros(1, device=device)
        if rank < peer:
            dist.send(token, dst=peer, tag=TAG)
            dist.recv(token, src=peer, tag=TAG)
        else:
            dist.recv(token, src=peer, tag=TAG)
            dist.send(token, dst=peer, tag=TAG)
        _sync(device)


def ports_may_close(device: torch.device) -> bool:
    """Whether nothing connects after the warm-up: always on CPU (gloo connects a group when
    it is made), and on CUDA unless ``NCCL_RUNTIME_CONNECT`` was set to connect lazily."""
    key = "NCCL_RUNTIME_CONNECT"
    return device.type != "cuda" or os.environ.get(key, NCCL_DEFAULTS[key]) == "0"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
