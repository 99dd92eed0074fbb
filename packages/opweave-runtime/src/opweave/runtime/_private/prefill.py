"""A prefill pool: ranks that compute prompts and hand each request's state to the decode ranks.

A plan with a prefill pool (``plan.prefill``: replicas of the whole model, colocated, of ``tp x
dp`` ranks laid out as a decode owner's) has its ranks after the decode ranks (:mod:`.placement`).
The driver sends each new request's whole prompt to one prefill replica
(:class:`~.messages.Prefill`; round robin, a replica's prompts of one step together as a
:class:`~.messages.PrefillBatch`). Its attention replicas take those prompts in turn and run their
share in batches of at most :data:`BATCH_TOKENS` prompt tokens through every operator (the TP
leader samples the first tokens), in lock step: one with no batch left joins the others' expert
exchanges without rows (:mod:`.expert_parallel`). Each computing prefill rank then sends one
message per decode rank that holds the request's per-request state (its slot's replicas of the
owners with a ``core_attn``, at its TP position modulo the pool's; where the TP degrees differ, the
state is gathered whole over the pool's TP group and each decode rank gets its cut,
:meth:`~.ops.StatefulOperator.state_shards`): the state of that rank's layers -- keys and values of
the prompt, a linear attention layer's conv and recurrent state, an MLA layer's latent cache -- as
:meth:`~.ops.StatefulOperator.export_state` lays it out, over the runtime's transport. Every
prefill rank then tells the driver what it sent (:class:`~.messages.Prefilled`, with the token from
the leader) and frees the request.

The decode ranks never prefill: the request's first work (a decode step at the prompt's length,
:attr:`~.work.Work.imports`) admits it, and each of its state ranks receives the message
(:class:`StateInbox`) into its layers (:meth:`~.ops.StatefulOperator.import_state`). Messages from
one prefill rank arrive in the order it prefilled, which need not be the order the decode rank
imports in (microbatches advance apart), so a message names its prefill and waits in the inbox
until its work comes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import OpWeaveRuntimeError, RequestStateError
from .batch import BatchMeta, TokenBatch
from .control import ControlClient
from .expert_parallel import join_groups
from .graph import OpRef
from .kernels import KernelSet
from .messages import Prefill, PrefillBatch, Prefilled, Shutdown, Warm, Warmed
from .options import RunOptions, fault_hook
from .placement import Placement
from .proc import pin_to_core, resolve_device
from .rankcore import Clock
from .schedule import Message, rank_ops
from .stage import StageModule
from .tensor_parallel import Layout, Shard, TPComm
from .transport import Transport, as_batch
from .work import sample_rows

STATE_TAG = 1 << 30  # the tag of a prefill's state message (no activation's tag comes near)


def state_layers(placement: Placement, rank: int) -> list[int]:
    """The layers whose per-request state decode rank ``rank`` holds, in its stage order."""
    return [ref.layer for ref in rank_ops(placement, rank) if ref.name == "core_attn"]  # type: ignore[misc]


def state_message(seq: int, length: int, tensors: list[torch.Tensor]) -> TokenBatch:
    """One prefill's state for one decode rank: its tensors in layer order, named by index;
    the header names the prefill (``seq``) and the tokens it covers (``length``)."""
    meta = BatchMeta((str(seq),), (length,), (0,))
    return TokenBatch(meta, {f"{i:06d}": t for i, t in enumerate(tensors)})


class StateInbox:
    """A decode rank's received prefill states, by prefill number, until their import."""

    def __init__(self, rank: int, placement: Placement, transport: Transport) -> None:
        self.rank = rank
        self.placement = placement
        self.transport = transport
        self.tp_rank = placement.ranks[rank].tp_rank
        self._held: dict[int, TokenBatch] = {}

    def take(self, replica: int, seq: int) -> list[torch.Tensor]:
        """Prefill ``seq``'s state from prefill replica ``replica`` (receiving until it came)."""
        peer = self.placement.prefill_sender(replica, seq, self.tp_rank)
        link = Message(peer, range(0), STATE_TAG)
        while seq not in self._held:
            what = f"receiving a request's state from prefill rank {peer}"
            batch = as_batch(self.transport.recv(link, what))
            self._held[int(batch.meta.request_ids[0])] = batch
        batch = self._held.pop(seq)
        return [batch.tensors[name] for name in sorted(batch.tensors)]


# prompt tokens one prefill batch holds at most (a longer prompt runs alone): vLLM's default
# max_num_batched_tokens on GPUs of 70 GiB or more (see opweave.costmodel's workload module)
BATCH_TOKENS = 8192


def _token_batches(prompts: list[Prefill]) -> list[list[Prefill]]:
    """``prompts`` in order, cut into batches of at most :data:`BATCH_TOKENS` tokens."""
    batches: list[list[Prefill]] = []
    tokens = 0
    for p in prompts:
        if not batches or tokens + len(p.token_ids) > BATCH_TOKENS:
            batches.append([])
            tokens = 0
        batches[-1].append(p)
        tokens += len(p.token_ids)
    return batches


def _gather(comm: TPComm, local: torch.Tensor, cut: Layout) -> torch.Tensor:
    """``local`` gathered whole over ``comm``'s group (one-byte floats travel as bytes:
    gloo has no float8 type)."""
    if local.element_size() == 1 and local.is_floating_point():
        return comm.gather(local.view(torch.uint8), cut).view(local.dtype)
    return comm.gather(local, cut)


class PrefillWorker:
    """One prefill rank's loop: prefill what the driver sends, hand the state on, report."""

    def __init__(
        self,
        rank: int,
        options: RunOptions,
        control: ControlClient,
        placement: Placement,
        *,
        model_dir: str,
        local_rank: int,
        local_world_size: int,
        host: str,
        key: bytes,
    ) -> None:
        self.rank = rank
        self.options = options
        self.control = control
        self.placement = placement
        self.info = placement.ranks[rank]
        self.device = resolve_device(options.device, local_rank)
        self.group, replica_group = join_groups(
            placement.tp_groups, placement.ep_groups, rank, options.timeout_s
        )
        experts = self.info.expert_shard
        self.ep = self.info.expert_exchange(replica_group, self.group)
        own_core = self.device.type == "cpu" and pin_to_core(local_rank, local_world_size)
        self.transport = Transport(
            rank,
            self.device,
            options.timeout_s,
            host=host,
            key=key,
            spin_s=options.spin_s(own_core),
            torch_p2p=options.test_torch_p2p,
        )
        shard = Shard(self.info.tp_rank, self.info.tp_size)
        self.comm = TPComm(shard, self.group) if self.info.tp_size > 1 else None
        refs = [OpRef(op.layer, op.name) for seg in placement.segments for op in seg.ops]
        self.module = StageModule(
            model_dir,
            refs,
            device=self.device,
            dtype=None if options.dtype is None else getattr(torch, options.dtype),
            shard=shard,
            comm=self.comm,
            model=placement.model,
            kernels=KernelSet(options.kernels),
            ep=self.ep,
            experts=experts,
        )
        self._layers = {
            op.layer: op for op in self.module._stateful if op.layer is not None
        }  # layer -> its stateful operator
        # per decode rank this rank hands state to (those whose TP position is this one's,
        # modulo the pool's TP): the layers whose state it takes
        holders = [
            r for r in placement.ranks[: placement.decode_world] if placement.holds_state(r.owner)
        ]
        self._takes = {
            r.rank: state_layers(placement, r.rank)
            for r in holders
            if r.tp_rank % self.info.tp_size == self.info.tp_rank
        }
        # decode ranks at another TP degree take the state re-cut: the pool gathers it whole
        self._reshard = any(r.tp_size != self.info.tp_size for r in holders)
        self.clock = Clock()
        self.prefills = 0
        self.state_bytes = 0
        self.hooks: list[Callable[[int], None]] = []  # called with the prefill about to start
        if options.fault is not None and options.fault.rank == rank:
            self.hooks.append(fault_hook(options.fault))

    def serve(self) -> None:
        """Prefill until the driver says stop."""
        while True:
            while not self.control.poll():
                self.transport.wait_control(self.control.fileno())
            msg = self.control.recv()
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, Warm):
                self.control.send(Warmed(self.rank))
                continue
            if not isinstance(msg, PrefillBatch):
                raise OpWeaveRuntimeError(f"unexpected control message {msg!r} for a prefill rank")
            if self.clock.started is None:
                self.clock.started = time.perf_counter()
            self._prefill(msg.prompts)
        self.transport.flush()

    @torch.inference_mode()
    def _prefill(self, prompts: tuple[Prefill, ...]) -> None:
        """Run this attention replica's share of ``prompts`` in batches of at most
        :data:`BATCH_TOKENS` prompt tokens (as many rounds as the replica's busiest attention
        replica needs: one with no batch left joins the expert exchanges without rows), sample
        each first token on the TP leader, hand each request's state on, and report every
        prompt."""
        pool = self.placement.plan.prefill
        assert pool is not None  # a prefill rank's plan has its pool
        shares = [
            _token_batches([p for p in prompts if self.placement.prefill_dp_rank(p.seq) == d])
            for d in range(pool.dp)
        ]
        mine = shares[self.info.dp_rank]
        computed = {p.seq for batch in mine for p in batch}
        for i in range(len(computed)):
            for hook in self.hooks:
                hook(self.prefills + i)
        for r in range(max(len(share) for share in shares)):
            start = time.perf_counter()
            if r >= len(mine):
                self.module.idle(slice(0, len(self.module.operators)))
                self.clock.compute_s += time.perf_counter() - start
                continue
            tokens = self._run(mine[r])
            self.clock.compute_s += time.perf_counter() - start
            for p, token in zip(mine[r], tokens, strict=True):
                self._hand_on(p, token)
            self.transport.reap(before_epoch=mine[r][0].seq)
            self.prefills += len(mine[r])
        for p in prompts:
            if p.seq not in computed:
                self.control.send(Prefilled(p.seq, p.request_id, -1, 0, 0))

    def _run(self, prompts: list[Prefill]) -> list[int]:
        """The prompts through every operator but the sampler, in one batch; each one's first
        token on the TP leader (-1 elsewhere)."""
        rids = [p.request_id for p in prompts]
        for rid in rids:
            if rid in self.module.request_ids:  # a restart while its earlier prefill ran
                self.module.free(rid)
        self.module.admit(rids)
        lens = tuple(len(p.token_ids) for p in prompts)
        meta = BatchMeta(tuple(rids), lens, (0,) * len(rids), slots=tuple(p.slot for p in prompts))
        ids = torch.tensor([t for p in prompts for t in p.token_ids], device=self.device)
        out = self.module.run(TokenBatch(meta, {"token_ids": ids}), slice(0, -1))
        if not self.info.is_leader:
            return [-1] * len(prompts)
        gens = [
            None if p.params.seed is None else torch.Generator().manual_seed(int(p.params.seed))
            for p in prompts
        ]
        return sample_rows(out["logits"], [p.params for p in prompts], gens)

    def _hand_on(self, msg: Prefill, token: int) -> None:
        """Send request ``msg``'s state to the decode ranks holding its slot, free it here, and
        tell the driver."""
        rid, n = msg.request_id, len(msg.token_ids)
        sent = messages = 0
        whole = self._whole_state(rid) if self._reshard else None
        for peer in self._receivers(msg.slot):
            tensors = self._state_for(peer, rid, whole)
            sent += sum(t.numel() * t.element_size() for t in tensors)
            self.transport.send(
                Message(peer, range(0), STATE_TAG), state_message(msg.seq, n, tensors), msg.seq
            )
            messages += 1
        self.module.free(rid)
        self.state_bytes += sent
        self.control.send(Prefilled(msg.seq, rid, token, sent, messages))

    def _whole_state(self, rid: str) -> dict[int, list[torch.Tensor]]:
        """Every layer's state of request ``rid`` as one rank holding all heads would hold it,
        gathered over this rank's TP group (every TP rank of it calls this, in layer order)."""
        whole = {}
        for layer, op in sorted(self._layers.items()):
            tensors = op.export_state(rid)
            if self.comm is not None:
                tensors = [
                    t if cut is None else _gather(self.comm, t, cut)
                    for t, cut in zip(tensors, op.state_shards(), strict=True)
                ]
            whole[layer] = tensors
        return whole

    def _state_for(
        self, peer: int, rid: str, whole: dict[int, list[torch.Tensor]] | None
    ) -> list[torch.Tensor]:
        """What decode rank ``peer`` takes of request ``rid``'s state: this rank's own when
        both run at one TP degree, else ``peer``'s cut of the ``whole`` state."""
        info = self.placement.ranks[peer]
        if info.tp_size == self.info.tp_size:
            return [t for layer in self._takes[peer] for t in self._layers[layer].export_state(rid)]
        assert whole is not None
        shard = Shard(info.tp_rank, info.tp_size)
        out = []
        for layer in self._takes[peer]:
            cuts = self._layers[layer].state_shards()
            for t, cut in zip(whole[layer], cuts, strict=True):
                out.append(t if cut is None else cut.local(t, shard))
        return out

    def _receivers(self, slot: int) -> list[int]:
        """The decode ranks this rank sends ``slot``'s state to (none where the decode owners
        run at a lower TP degree than the pool and another rank of it sends)."""
        holders = self.placement.state_ranks(slot)
        if not holders:
            raise RequestStateError(f"no decode rank holds the state of slot {slot}")
        return [r.rank for r in holders if r.rank in self._takes]

    def stats(self, load_s: float) -> dict[str, Any]:
        """The figures :class:`~.results.RankStats` holds, for a prefill rank."""
        info, clock = self.info, self.clock
        loop = time.perf_counter() - clock.started if clock.started is not None else 0.0
        comm = self.transport.comm_s
        return {
            "rank": self.rank,
            "owner": info.owner,
            "replica": info.replica,
            "tp_rank": info.tp_rank,
            "tp_size": info.tp_size,
            "device": str(self.device),
            "host": socket.gethostname(),
            "stages": self.placement.stage_labels(self.rank),
            "weight_bytes_read": self.module.checkpoint.bytes_read,
            "weight_bytes": self.module.weight_bytes,
            "load_s": load_s,
            "kernels": self.module.kernels,
            "busy_s": clock.compute_s,
            "comm_s": comm,
            "loop_s": loop,
            "overhead_s": max(loop - clock.compute_s - comm, 0.0),
            "wait": "spin" if self.transport.spin_s > 0 else "block",
            "iterations": self.prefills,
            "computes_per_iteration": 1,
            "decode_step": "prefill",
            "submissions": self.module.submissions,
            "submissions_per_token": 0.0,
            "host_s_per_token": 0.0,
            "timeline": clock.timeline,
            "requests_held_at_end": len(self.module.request_ids),
            "state_bytes_at_end": self.module.state_bytes(),
            "bytes_sent": self.transport.bytes_sent,
            "messages_sent": self.transport.messages_sent,
            "pool": "prefill",
        }
