"""Where a plan's pieces run: owners, replicas and tensor-parallel ranks mapped to process ranks.

The plan says *what* runs (a stage template tiled over the model, owners round-robin over its
positions); this module fixes *where* and *for whom*, identically on every rank, so that no rank
ever has to ask another:

- ranks enumerate owners ``o``, then replicas ``j``, then TP ranks ``t``; the first TP rank of a
  replica is its **leader** (it receives and sends the replica's messages);
- a plan with a prefill pool (``plan.prefill``) has its ranks after the decode owners': its
  replicas, then their TP ranks, each running the whole model (``owner`` :data:`PREFILL`);
- the global batch is ``B = replicas_o * resident_batch_o`` slots (equal for every owner); replica
  ``j`` of owner ``o`` serves slots ``[j * b_o, (j + 1) * b_o)`` and keeps the per-request state of
  exactly those slots; microbatch ``k`` is slots ``[k * B // m, (k + 1) * B // m)``.

An owner with data-parallel attention (``dp > 1``) splits each plan replica into ``dp``
attention replicas of ``b_o / dp`` slots and ``tp`` ranks each, laid out as above (``replica``
below counts them); the ``tp x dp`` ranks of one plan replica form its expert group, over which
each MoE layer's routed experts are sharded in ``ep`` sets and whose ranks exchange rows at the
experts (:mod:`.expert_parallel`). Without data parallelism the TP group is the expert group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from opweave.costmodel import (
    ModelSpec,
    OperatorSpec,
    Owner,
    Plan,
    PrefillPool,
    Segment,
    segments,
    tp_problem,
)

from ..errors import PlanMismatchError, ShardingError
from .expert_parallel import EPComm, ExpertShard

UNQUANTISED_LABELS = ("bf16", "fp16", "fp32")  # a plan's quant for unquantised weights
PREFILL = -1  # the owner of a prefill pool's ranks


@dataclass(frozen=True)
class RankInfo:
    """One process of the deployment: which owner replica it belongs to, and its TP position."""

    rank: int
    owner: int
    replica: int
    tp_rank: int
    tp_size: int
    leader: int
    group: tuple[int, ...]
    ep_group: tuple[int, ...] = ()  # the plan replica's ranks, under data parallelism (dp > 1)
    ep: int = 1  # the owner's expert sets

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's attention replica within its plan replica (0 without data parallelism)."""
        return self.ep_group.index(self.rank) // self.tp_size if self.ep_group else 0

    def expert_exchange(self, replica: object | None, tp: object | None) -> EPComm | None:
        """This rank's expert exchange over its plan replica's process group ``replica``
        (None without data parallelism), ``tp`` its TP group."""
        if replica is None:
            return None
        shard = self.expert_shard
        return EPComm(shard.index, shard.size, replica, self.tp_size, shard, tp_group=tp)

    @property
    def expert_shard(self) -> ExpertShard:
        """The routed experts (and channels of them) this rank holds."""
        if self.ep_group:
            return ExpertShard(self.ep_group.index(self.rank), len(self.ep_group), self.ep)
        return ExpertShard(self.tp_rank, self.tp_size, self.ep)

    @property
    def prefills(self) -> bool:
        """A rank of the prefill pool: it computes prompts and hands their state on."""
        return self.owner == PREFILL


def op_label(op: OperatorSpec) -> str:
    return op.name if op.layer is None else f"L{op.layer}.{op.name}"


def segment_label(seg: Segment) -> str:
    """``L0.ffn_norm..L0.down_proj``: a segment's first and last operator."""
    first, last = op_label(seg.ops[0]), op_label(seg.ops[-1])
    return first if len(seg.ops) == 1 else f"{first}..{last}"


def _plan_replica(
    first: int, owner: int, replicas: list[int], par: Owner | PrefillPool
) -> list[RankInfo]:
    """The ranks of one plan replica of ``owner`` from rank ``first``: an attention replica of
    ``par.tp`` ranks for each entry of ``replicas`` (the replica number it is known by)."""
    tp = par.tp
    whole = tuple(range(first, first + tp * len(replicas))) if len(replicas) > 1 else ()
    ranks = []
    for d, j in enumerate(replicas):
        base = first + d * tp
        group = tuple(range(base, base + tp))
        ranks += [
            RankInfo(base + t, owner, j, t, tp, base, group, whole, par.ep) for t in range(tp)
        ]
    return ranks


class Placement:
    """A plan installed on ``world_size`` ranks: rank layout, slot ranges and segments."""

    def __init__(self, plan: Plan, model: ModelSpec) -> None:
        self.plan = plan
        self.model = model
        self.segments: list[Segment] = segments(model, plan.template, len(plan.owners))
        self.global_batch = plan.global_batch
        self.microbatches = plan.microbatches
        ranks: list[RankInfo] = []
        for o, owner in enumerate(plan.owners):
            dp = owner.dp
            for j in range(owner.replicas):  # its attention replicas count as replicas
                ranks += _plan_replica(len(ranks), o, [j * dp + d for d in range(dp)], owner)
        self.decode_world = len(ranks)
        pool = plan.prefill
        for j in range(pool.replicas if pool is not None else 0):
            assert pool is not None
            ranks += _plan_replica(len(ranks), PREFILL, [j] * pool.dp, pool)
        self.ranks = tuple(ranks)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    def prefill_ranks(self, replica: int) -> list[RankInfo]:
        """The ranks of prefill replica ``replica``: its attention replicas' TP ranks."""
        return [r for r in self.ranks if r.prefills and r.replica == replica]

    def prefill_dp_rank(self, seq: int) -> int:
        """The attention replica of a prefill replica that computes prefill ``seq`` (the
        others join its expert exchanges without rows): the replica's prompts in turn."""
        pool = self.plan.prefill
        # the replica is seq % replicas (round robin): its own prompts take turns
        return 0 if pool is None else (seq // pool.replicas) % pool.dp

    def prefill_sender(self, replica: int, seq: int, tp_rank: int) -> int:
        """The prefill rank that sends prefill ``seq``'s state to decode ranks of TP position
        ``tp_rank``: the one of that position modulo the pool's TP."""
        pool = self.plan.prefill
        assert pool is not None
        index = self.prefill_dp_rank(seq) * pool.tp + tp_rank % pool.tp
        return self.prefill_ranks(replica)[index].rank

    @property
    def prefill_replicas(self) -> int:
        return self.plan.prefill.replicas if self.plan.prefill is not None else 0

    def state_ranks(self, slot: int) -> list[RankInfo]:
        """The decode ranks holding per-request state (KV cache, recurrent state) for ``slot``:
        each owner replica serving it whose stages have a ``core_attn``; what a prefill hands
        a request's state to."""
        out = []
        for r in self.ranks[: self.decode_world]:
            if slot in self.replica_slots(r.owner, r.replica) and self.holds_state(r.owner):
                out.append(r)
        return out

    def holds_state(self, owner: int) -> bool:
        return any(op.name == "core_attn" for s in self.segments_of(owner) for op in s.ops)

    def leader(self, owner: int, replica: int) -> int:
        return next(
            r.rank for r in self.ranks if (r.owner, r.replica, r.tp_rank) == (owner, replica, 0)
        )

    def replicas(self, owner: int) -> int:
        """Replicas of ``owner`` as the runtime lays them out: data-parallel ranks count."""
        o = self.plan.owners[owner]
        return o.replicas * o.dp

    def replica_slots(self, owner: int, replica: int) -> range:
        o = self.plan.owners[owner]
        b = o.resident_batch // o.dp
        return range(replica * b, (replica + 1) * b)

    def microbatch_slots(self, k: int) -> range:
        b, m = self.global_batch, self.microbatches
        return range(k * b // m, (k + 1) * b // m)

    def segments_of(self, owner: int) -> list[Segment]:
        return [s for s in self.segments if s.owner == owner]

    def replicas_serving(self, owner: int, slots: range) -> list[tuple[int, range]]:
        """Replicas of ``owner`` holding any of ``slots``, with the overlap each holds."""
        out = []
        for j in range(self.replicas(owner)):
            part = overlap(self.replica_slots(owner, j), slots)
            if part:
                out.append((j, part))
        return out

    @cached_property
    def tp_groups(self) -> list[tuple[int, ...]]:
        """Every replica's rank group with more than one member, in rank order."""
        return sorted({r.group for r in self.ranks if r.tp_size > 1})

    @cached_property
    def ep_groups(self) -> list[tuple[int, ...]]:
        """Every plan replica's rank group under data parallelism (owners with ``dp > 1``)."""
        return sorted({r.ep_group for r in self.ranks if r.ep_group})

    def describe(self, rank: int) -> str:
        """``owner 1, replica 0: stages L0.ffn_norm..L0.down_proj, ...`` (for errors)."""
        info = self.ranks[rank]
        if info.prefills:
            where = f"prefill replica {info.replica}"
            if info.ep_group:
                where += f", dp rank {info.dp_rank} of {len(info.ep_group) // info.tp_size}"
            if info.tp_size > 1:
                where += f", tp rank {info.tp_rank} of {info.tp_size}"
            return f"{where}: the whole model's prefill"
        dp = self.plan.owners[info.owner].dp
        where = f"owner {info.owner}, replica {info.replica // dp}"
        if dp > 1:
            where += f", dp rank {info.replica % dp} of {dp}"
        if info.tp_size > 1:
            where += f", tp rank {info.tp_rank} of {info.tp_size}"
        stages = ", ".join(segment_label(s) for s in self.segments_of(info.owner)) or "none"
        return f"{where}: stages {stages}"

    def stage_labels(self, rank: int) -> list[str]:
        if self.ranks[rank].prefills:
            first, last = self.segments[0].ops[0], self.segments[-1].ops[-1]
            return [f"prefill: {op_label(first)}..{op_label(last)}"]
        return [segment_label(s) for s in self.segments_of(self.ranks[rank].owner)]


def overlap(a: range, b: range) -> range:
    """The slots two contiguous slot ranges share (empty when disjoint)."""
    return range(max(a.start, b.start), min(a.stop, b.stop)) if a.stop > b.start else range(0)


def plan_model(plan: Plan, model_dir: str | Path) -> ModelSpec:
    """The model folder's spec in the precision ``plan`` was made for: the checkpoint's weights,
    and the plan's KV-cache dtype (an FP8 cache where the plan, or the checkpoint, says so)."""
    from opweave.costmodel import load_model

    return load_model(
        model_dir, kv_cache_dtype="fp8" if plan.model.kv_cache_dtype == "fp8" else "auto"
    )


def total_ranks(plan: Plan) -> int:
    """Processes (GPUs) a plan needs: replicas x TP x DP degree, summed over its owners, and
    its prefill pool's replicas x TP x DP."""
    pool = plan.prefill
    return sum(o.replicas * o.gpus_per_replica for o in plan.owners) + (
        pool.gpus if pool is not None else 0
    )


def check_plan(plan: Plan, model: ModelSpec, world_size: int | None = None) -> None:
    """Refuse a plan made for another model, one whose owners cannot shard their operators as
    their (TP, EP, DP) asks, or a launch with the wrong number of ranks."""
    pm = plan.model
    # an unquantised cache is in the dtype the run computes in (vLLM's --dtype): a plan made
    # for bf16 serving of a float32 checkpoint runs in either; FP8 is the plan's choice
    if (pm.kv_cache_dtype == "fp8") != (model.precision.kv_cache_dtype == "fp8"):
        raise PlanMismatchError(
            f"the plan assumes a {pm.kv_cache_dtype} KV cache, the model is loaded with a "
            f"{model.precision.kv_cache_dtype} one; load it in the plan's precision (plan_model)"
        )
    stored = model.precision.quant
    if pm.quant != stored and (model.precision.quantized or pm.quant not in UNQUANTISED_LABELS):
        raise PlanMismatchError(
            f"the plan assumes {pm.quant} weights, but the checkpoint stores {stored} weights "
            "and the runtime serves them as stored; re-plan for this checkpoint (without --quant)"
        )
    facts = (
        ("family", pm.family, model.family),
        ("layers", pm.num_layers, model.num_layers),
        ("partition block layers", pm.period_layers, model.block.period_layers),
    )
    for what, planned, actual in facts:
        if planned != actual:
            raise PlanMismatchError(
                f"the plan is for model {pm.name!r} ({what} {planned}), but the model folder has "
                f"{what} {actual}; re-plan for this model (opweave plan <model dir> ...)"
            )
    if pm.config_sha256 != model.config_sha256:
        raise PlanMismatchError(
            f"the plan is for model {pm.name!r} with config sha256 {pm.config_sha256[:12]}..., "
            f"but this model folder's config hashes to {model.config_sha256[:12]}...; "
            "re-plan for this model (opweave plan <model dir> ...)"
        )
    for o, owner in enumerate(plan.owners):
        if owner.ep > 1 or owner.dp > 1:
            check_expert_parallel(plan, model, o)
        if owner.tp == 1:
            continue
        ops = [
            op
            for seg in segments(model, plan.template, len(plan.owners))
            if seg.owner == o
            for op in seg.ops
            # routed experts split over the expert sets (check_expert_parallel), not over tp
            if not (op.name == "experts" and (owner.ep > 1 or owner.dp > 1))
        ]
        problem = tp_problem(model, owner.tp, ops)
        if problem:
            raise ShardingError(
                f"plan owner {o} ({owner.gpu} x tp {owner.tp}) cannot shard {problem}; "
                "choose a tensor-parallel degree that divides it"
            )
    if plan.prefill is not None:
        check_prefill_pool(plan, model)
    needed = total_ranks(plan)
    if world_size is not None and world_size != needed:
        pool = " and its prefill pool" if plan.prefill is not None else ""
        raise PlanMismatchError(
            f"the plan needs {needed} ranks (replicas x tp x dp, summed over its owners{pool}), "
            f"got {world_size}; launch with --ranks {needed}"
        )


def check_expert_parallel(plan: Plan, model: ModelSpec, o: int) -> None:
    """Refuse an owner's (TP, EP, DP) the runtime cannot run: expert sets on a dense model, more
    sets than routed experts, or experts whose channels do not split over each set's
    ``tp x dp / ep`` GPUs; and under data parallelism, a microbatch that gives a replica's
    attention replicas unequal slots (its expert exchanges are collectives every rank joins,
    with the same shapes inside a compiled step)."""
    owner = plan.owners[o]
    what = f"plan owner {o} ({owner.gpu} tp {owner.tp} ep {owner.ep} dp {owner.dp})"
    moe = model.arch.moe
    if owner.ep > 1 and moe is None:
        raise PlanMismatchError(f"{what}: {model.name} has no routed experts; use ep 1")
    if owner.resident_batch % owner.dp:
        raise PlanMismatchError(
            f"{what}: a resident batch of {owner.resident_batch} does not split over dp "
            f"{owner.dp}; choose a batch that divides by it"
        )
    experts = [
        op
        for seg in segments(model, plan.template, len(plan.owners))
        if seg.owner == o
        for op in seg.ops
        if op.name == "experts"
    ]
    if not experts:
        return
    _check_expert_split(model, experts, owner.ep, owner.gpus_per_replica, what)
    if owner.dp == 1:
        return
    b, m, gb = owner.resident_batch // owner.dp, plan.microbatches, plan.global_batch
    for k in range(m):
        mb = range(k * gb // m, (k + 1) * gb // m)
        for j in range(owner.replicas):
            dp_ranks = range(j * owner.dp, (j + 1) * owner.dp)
            sizes = [len(overlap(range(d * b, (d + 1) * b), mb)) for d in dp_ranks]
            if any(sizes) and len(set(sizes)) > 1:
                raise PlanMismatchError(
                    f"{what}: microbatch {k} has {', '.join(map(str, sizes))} slots on the "
                    f"data-parallel ranks of replica {j}, and the expert exchange needs as many "
                    "on each; use 1 microbatch or a batch that splits evenly"
                )


def _check_expert_split(
    model: ModelSpec, experts: list[OperatorSpec], ep: int, gpus: int, what: str
) -> None:
    """Routed experts dealt to ``ep`` sets over ``gpus`` GPUs: at most one set per expert, and
    each expert's channels split over its set's ``gpus / ep`` GPUs."""
    moe = model.arch.moe
    assert moe is not None
    if moe.num_experts < ep:
        raise PlanMismatchError(
            f"{what}: {moe.num_experts} routed experts are fewer than ep {ep}; "
            "choose an ep of at most the expert count"
        )
    problem = tp_problem(model, gpus // ep, experts)
    if problem:
        raise ShardingError(
            f"{what} cannot shard {problem} (the {gpus // ep} GPUs of each expert set, "
            "tp x dp / ep); choose a larger ep"
        )


def check_prefill_pool(plan: Plan, model: ModelSpec) -> None:
    """A prefill pool the runtime runs: colocated replicas of ``tp x dp`` GPUs (experts in
    ``ep`` sets, as a decode owner's) whose operators split as their parallelism asks (the
    per-request state goes to decode ranks at any TP degree, re-cut where it differs)."""
    pool = plan.prefill
    assert pool is not None
    what = f"the plan's prefill pool (tp {pool.tp} ep {pool.ep} dp {pool.dp})"
    all_segments = segments(model, plan.template, len(plan.owners))
    all_ops = [op for s in all_segments for op in s.ops]
    if pool.ep > 1 and model.arch.moe is None:
        raise PlanMismatchError(f"{what}: {model.name} has no routed experts; use ep 1")
    split = model.arch.moe is not None and (pool.ep > 1 or pool.dp > 1)
    if split:  # experts dealt to the sets over the replica's GPUs, not over tp
        experts = [op for op in all_ops if op.name == "experts"]
        _check_expert_split(model, experts, pool.ep, pool.tp * pool.dp, what)
    if pool.tp > 1:
        problem = tp_problem(
            model, pool.tp, [op for op in all_ops if not (split and op.name == "experts")]
        )
        if problem:
            raise ShardingError(
                f"the prefill pool (tp {pool.tp}) cannot shard {problem}; "
                "choose a tensor-parallel degree that divides it"
            )
