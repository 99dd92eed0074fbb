"""From owner choices to a schedule, a cost per token and a Plan (paper §4, appendix B.4-B.5).

Cost per token. Owner ``o`` runs ``replicas_o`` replicas of ``n_o = tp_o x dp_o`` GPUs, each
holding ``b_o`` requests; every owner serves the same global batch ``G = replicas_o * b_o``,
which produces ``G`` tokens per iteration (TPOT). So

    USD per token = TPOT * sum_o replicas_o * n_o * price_o / 3600 / G
                  = TPOT * sum_o n_o * price_o / b_o / 3600,

in which ``G`` cancels (scale invariance, B.5). Replica counts are the smallest integers that
balance the owners: ``G = lcm(b_o)`` and ``replicas_o = G / b_o``.

Microbatches. Each replica splits its resident batch into ``M`` equal microbatches of ``b_o / M``
requests, each spread over the replica's ``dp`` DP ranks (whose leaders send and receive their
own slices at stage boundaries). Plans from the planner always have ``b_o`` divisible by ``M``
and microbatches divisible by ``dp``; a hand-written plan whose batch is not divisible is
simulated with fractional microbatches (the mean size), the busiest DP rank taking the ceiling.

Host work. A schedule's durations are its operators' and transfers'; where a device's profile
measured its host (CPU ranks), the host effects of :mod:`.host` lengthen them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from opweave.costmodel import (
    HardwareCatalog,
    ModelSpec,
    Owner,
    Parallelism,
    Plan,
    Prediction,
    Profile,
    RooflineLatency,
    afd_template,
    boundary_transfer_s,
    cad_template,
    hardware_drift,
    intra_node_link,
    max_replica_batch,
    memory_bytes_per_gpu,
    parallelism_problem,
    plan_model,
    planned_catalog,
    replica_counts,
    segments,
    usd_per_hour_per_request,
)
from opweave.costmodel import usd_per_million_tokens as usd_per_mtok
from opweave.costmodel.errors import ConfigError, InfeasibleError

from .devices import Device, resolve_devices
from .host import Draft, cools, host_effects, host_time, with_cold_caches
from .simulator import Pipeline, TraceEvent, cycle_time, simulate_events, steady_window
from .structure import OpTables, Structure, build_structure, owner_ops


@dataclass(frozen=True)
class OwnerChoice:
    """One owner's configuration."""

    device: Device
    tp: int
    resident_batch: int
    ep: int = 1
    dp: int = 1

    @property
    def par(self) -> Parallelism:
        return Parallelism(tp=self.tp, ep=self.ep, dp=self.dp)

    @property
    def gpus(self) -> int:
        """GPUs of one replica: ``tp x dp``."""
        return self.tp * self.dp


def owner_name(j: int, ch: OwnerChoice) -> str:
    """``owner 0 (h100-sxm, TP4, EP4)``: how simulations, Gantt charts and `opweave simulate`
    name an owner's resources."""
    from .result import parallelism_words

    return f"owner {j} ({ch.device.id}, {parallelism_words(ch.tp, ch.ep, ch.dp)})"


def build_pipeline(
    st: Structure,
    tables: OpTables,
    owners: Sequence[OwnerChoice],
    microbatches: int,
    *,
    cold_caches: bool = True,
    global_batch: int | None = None,
) -> tuple[Pipeline, tuple[str, ...]]:
    """The schedule of a plan, and the link kind of every boundary (``""`` when not crossing).

    Durations are the operators' and the transfers', plus the host effects the owners'
    profiles hold (:mod:`.host`; none on GPUs). ``cold_caches=False`` leaves out the slowdown
    after idling (a lower bound on the period: it only lengthens durations). ``global_batch``
    (default: the smallest that balances the owners, ``lcm`` of their resident batches) sizes
    the driver's work."""
    m = microbatches
    us = [ch.resident_batch / m for ch in owners]
    ops = np.zeros(st.num_segments)  # operators, per microbatch
    for j, ch in enumerate(owners):
        ops[list(st.owner_segs[j])] = owner_ops(st, tables, j, ch.device, ch.par, [us[j]])[:, 0]
    transfer = [0.0] * st.num_segments
    kinds = [""] * st.num_segments
    total = st.num_segments
    pair_kind: dict[tuple[int, int], str] = {}
    memo: dict[tuple[int, int, float], float] = {}
    for s in range(total):
        a, b = st.seg_owner[s], st.seg_owner[(s + 1) % total]
        if a == b:
            continue
        src, dst = owners[a], owners[b]
        kind = pair_kind.get((a, b))
        if kind is None:
            kind = pair_kind[(a, b)] = link_kind(src, dst)
        kinds[s] = kind
        key = (a, b, st.beta[s])
        if key not in memo:
            memo[key] = float(
                boundary_transfer_s(
                    st.beta[s],
                    us[a] / src.dp,  # each DP rank's leader sends its own slice
                    us[b] / dst.dp,
                    dst.tp,
                    src.device.link(kind).coeffs,
                    dst.device.link(kind).coeffs,
                    dst.device.intra.coeffs,
                )
            )
        transfer[s] = memo[key]
    hosts = tuple(ch.device.host for ch in owners)
    draft = Draft(
        hosts=hosts,
        seg_owner=st.seg_owner,
        requests=tuple(us),
        link_kinds=tuple(kinds),
        driven_requests=(global_batch or math.lcm(*(ch.resident_batch for ch in owners))) / m,
    )
    host = host_time(draft, host_effects(hosts))
    pipe = Pipeline(
        owner_names=tuple(owner_name(j, ch) for j, ch in enumerate(owners)),
        seg_owner=st.seg_owner,
        compute_s=tuple((ops + host).tolist()),
        transfer_s=tuple(transfer),
        microbatches=m,
        seg_labels=st.labels,
        period_hint=st.period_hint,
        host_s=tuple(host.tolist()),
    )
    if cold_caches and cools(hosts):
        touched = np.zeros(st.num_segments)  # bytes each segment's operators touch
        for j, ch in enumerate(owners):
            if ch.device.host.idle_slowdown is not None:
                moved = tables.bytes_moved(ch.tp, [us[j]])
                touched[list(st.owner_segs[j])] = (st.counts[j] @ moved)[:, 0]
        pipe = with_cold_caches(pipe, touched, [h.idle_slowdown for h in hosts])
    return pipe, tuple(kinds)


def link_kind(src: OwnerChoice, dst: OwnerChoice) -> str:
    """The link between two owners' replicas (:func:`opweave.costmodel.intra_node_link`)."""
    intra = intra_node_link(
        src.device.id == dst.device.id,
        src.gpus,
        src.resident_batch,
        dst.gpus,
        dst.resident_batch,
        src.device.hardware.gpus_per_node,
    )
    return "intra_node" if bool(intra) else "network"


def cost_rate(owners: Sequence[OwnerChoice]) -> float:
    """USD per hour per request of a plan's owners, summed (times TPOT: cost per token)."""
    return float(
        sum(
            usd_per_hour_per_request(ch.gpus, ch.device.usd_per_hour, ch.resident_batch)
            for ch in owners
        )
    )


def usd_per_million_tokens(tpot_s: float, owners: Sequence[OwnerChoice]) -> float:
    return float(usd_per_mtok(tpot_s, cost_rate(owners)))


@dataclass(frozen=True)
class Evaluation:
    """Predicted figures of one plan."""

    tpot_s: float
    usd_per_million_tokens: float
    stages_per_token: int
    internode_bytes_per_token: float
    compute_occupancy: float
    busy_s: dict[str, float]
    pipeline: Pipeline = field(repr=False)
    link_kinds: tuple[str, ...] = field(repr=False, default=())

    def prediction(self, global_batch: int) -> Prediction:
        return Prediction(
            tpot_s=self.tpot_s,
            usd_per_million_tokens=self.usd_per_million_tokens,
            tokens_per_s_per_replica_set=global_batch / self.tpot_s,
            stages_per_token=self.stages_per_token,
            internode_bytes_per_token=self.internode_bytes_per_token,
            compute_occupancy=self.compute_occupancy,
        )


def evaluate(
    st: Structure,
    tables: OpTables,
    owners: Sequence[OwnerChoice],
    microbatches: int,
    *,
    global_batch: int | None = None,
) -> Evaluation:
    pipe, kinds = build_pipeline(st, tables, owners, microbatches, global_batch=global_batch)
    tpot = cycle_time(pipe)
    busy = pipe.busy_s()
    names = pipe.resource_names()
    weights = [ch.gpus / ch.resident_batch for ch in owners]  # GPUs per request of each owner
    # a share: at most 1 (an owner busy all cycle can come out a rounding above it)
    occ = min(1.0, float(sum(w * busy[j] / tpot for j, w in enumerate(weights)) / sum(weights)))
    internode = float(sum(st.beta[s] for s, k in enumerate(kinds) if k == "network"))
    return Evaluation(
        tpot_s=tpot,
        usd_per_million_tokens=usd_per_million_tokens(tpot, owners),
        stages_per_token=st.num_segments,
        internode_bytes_per_token=internode,
        compute_occupancy=occ,
        busy_s=dict(zip(names, busy.tolist(), strict=True)),
        pipeline=pipe,
        link_kinds=kinds,
    )


def strategy_of(model: ModelSpec, st: Structure) -> str:
    """The plan's strategy label: a baseline's name when its template is that baseline's."""
    if st.n == 1:
        return "colocated"
    if st.n == 2 and st.template == afd_template(model):
        return "afd"
    if st.n == 2 and st.template == cad_template(model):
        return "cad"
    return "opweave"


def make_plan(
    model: ModelSpec,
    st: Structure,
    tables: OpTables,
    owners: Sequence[OwnerChoice],
    microbatches: int,
    *,
    tpot_slo_s: float | None,
    evaluation: Evaluation | None = None,
) -> Plan:
    ev = evaluation or evaluate(st, tables, owners, microbatches)
    reps = replica_counts([ch.resident_batch for ch in owners])
    plan_owners = tuple(
        Owner(
            gpu=ch.device.id,
            tp=ch.tp,
            ep=ch.ep,
            dp=ch.dp,
            replicas=r,
            resident_batch=ch.resident_batch,
        )
        for ch, r in zip(owners, reps, strict=True)
    )
    provenance = tuple(dict.fromkeys(ch.device.provenance for ch in owners))
    return Plan(
        strategy=strategy_of(model, st),  # type: ignore[arg-type]
        model=plan_model(model),
        context_tokens=tables.context,
        tpot_slo_s=tpot_slo_s,
        template=st.template,
        owners=plan_owners,
        microbatches=microbatches,
        prediction=ev.prediction(reps[0] * owners[0].resident_batch),
        profiles=provenance,
        hardware=tuple({ch.device.id: ch.device.hardware for ch in owners}.values()),
    )


# -- re-simulating a plan --------------------------------------------------------------------------
@dataclass(frozen=True)
class SimResult:
    """A plan re-simulated: steady-state TPOT, cost, occupancy and one iteration's trace."""

    plan: Plan
    tpot_s: float
    usd_per_million_tokens: float
    stages_per_token: int
    internode_bytes_per_token: float
    compute_occupancy: float
    busy_s: dict[str, float]
    occupancy: dict[str, float]
    trace: tuple[TraceEvent, ...]
    window_s: tuple[float, float]
    memory_bytes_per_gpu: tuple[float, ...]
    memory_capacity_bytes: tuple[float, ...]
    event_periods_s: tuple[float, ...]
    pipeline: Pipeline = field(repr=False)
    # where the specs or latencies simulated differ from those the plan was made with
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "tpot_s": self.tpot_s,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "stages_per_token": self.stages_per_token,
            "internode_bytes_per_token": self.internode_bytes_per_token,
            "compute_occupancy": self.compute_occupancy,
            "busy_s": self.busy_s,
            "occupancy": self.occupancy,
            "memory_bytes_per_gpu": list(self.memory_bytes_per_gpu),
            "memory_capacity_bytes": list(self.memory_capacity_bytes),
            "notes": list(self.notes),
            "trace": [
                {
                    "resource": e.resource,
                    "start_s": e.start_s - self.window_s[0],
                    "end_s": e.end_s - self.window_s[0],
                    "label": e.label,
                }
                for e in self.trace
            ],
        }


def _owner_choices(
    plan: Plan, model: ModelSpec, catalog: HardwareCatalog | None, profiles: Sequence[Profile]
) -> tuple[list[OwnerChoice], tuple[str, ...]]:
    """The plan's owners as devices, and where those differ from what the plan was made with."""
    problem = plan.model.config_problem(model)
    if problem is not None:
        raise ConfigError(f"plan {problem}")
    cat = planned_catalog(plan, catalog)
    by_name = {
        name: resolve_devices([name], model, catalog=cat, profiles=profiles)[0]
        for name in dict.fromkeys(o.gpu for o in plan.owners)
    }
    notes: list[str] = []
    for dev in by_name.values():
        source = next((p for p in plan.profiles if p.startswith(f"{dev.id}:")), None)
        if source is not None and source != dev.provenance:
            if dev.provenance.endswith(":roofline"):
                raise ConfigError(
                    f"the plan's {dev.id} latencies come from a measured profile "
                    f"({source.removeprefix(dev.id + ':')}); pass that profile with --profile"
                )
            notes.append(f"{dev.id} latencies: {source} -> {dev.provenance}")
        drift = hardware_drift(plan, dev.hardware)
        if drift is not None:
            notes.append(drift)
    segs = segments(model, plan.template, len(plan.owners))
    for j, o in enumerate(plan.owners):
        dev = by_name[o.gpu]
        if o.tp not in dev.tps:
            if isinstance(dev.latency, RooflineLatency):  # a TP group spans one node
                per_node = dev.hardware.gpus_per_node
                if o.tp > per_node:
                    raise ConfigError(
                        f"plan owner {j} ({o.gpu}) has tp {o.tp}, but each {o.gpu} node holds "
                        f"{per_node} GPUs and a TP group spans one node; plan again for nodes "
                        "of that size"
                    )
                raise ConfigError(
                    f"plan owner {j} ({o.gpu}) has tp {o.tp}, which {model.name} does not "
                    f"split over on {o.gpu} (it takes tp {', '.join(map(str, dev.tps))})"
                )
            raise ConfigError(
                f"owner {o.gpu} has tp={o.tp}, which its latency profile does "
                f"not cover ({dev.tps}); re-profile with that TP"
            )
        ops = [op for s in segs if s.owner == j for op in s.ops]
        problem = parallelism_problem(model, o.parallelism, dev.hardware, ops)
        if problem is not None:
            raise ConfigError(f"plan owner {j} ({o.gpu} {o.parallelism}): {problem}")
        if not o.parallelism.plain and not isinstance(dev.latency, RooflineLatency):
            raise ConfigError(
                f"plan owner {j} ({o.gpu} {o.parallelism}): a measured profile holds "
                "tensor-parallel latencies only; simulate it without --profile"
            )
    pool = plan.prefill
    if pool is not None:  # its GPU type is known and the model splits as the pool says
        dev = by_name.get(pool.gpu) or resolve_devices([pool.gpu], model, catalog=cat)[0]
        par = Parallelism(tp=pool.tp, ep=pool.ep, dp=pool.dp)
        problem = parallelism_problem(model, par, dev.hardware)
        if problem is not None:
            raise ConfigError(f"the plan's prefill pool ({pool.gpu} {par}): {problem}")
    choices = [
        OwnerChoice(by_name[o.gpu], o.tp, o.resident_batch, ep=o.ep, dp=o.dp) for o in plan.owners
    ]
    return choices, tuple(notes)


def simulate_plan(
    plan: Plan,
    model: ModelSpec,
    *,
    catalog: HardwareCatalog | None = None,
    profiles: Sequence[Profile] = (),
    check_memory: bool = True,
    iterations: int = 6,
) -> SimResult:
    """Re-simulate a plan: exact steady-state TPOT, cost, occupancy, one iteration's trace.

    Without ``catalog`` the plan's GPU types have the specs it was made with (``plan.hardware``);
    with one, that catalog's (a what-if). ``notes`` of the result say where the specs or
    latency sources simulated differ from the plan's; a plan made from a measured profile needs
    a profile of that device in ``profiles``.

    Raises :class:`InfeasibleError` when an owner's replica does not fit in memory (pass
    ``check_memory=False`` to simulate it anyway).
    """
    owners, notes = _owner_choices(plan, model, catalog, profiles)
    tables = OpTables(model, plan.context_tokens)
    st = build_structure(model, tables, plan.template, len(owners))
    mem, cap = [], []
    for j, ch in enumerate(owners):
        ops = list(st.owner_ops[j])
        need = memory_bytes_per_gpu(ops, ch.par, ch.resident_batch, plan.context_tokens)
        mem.append(need)
        cap.append(ch.device.hardware.usable_memory_bytes)
        fits = max_replica_batch(ops, ch.par, ch.device.hardware, plan.context_tokens)
        if check_memory and ch.resident_batch > fits:
            raise InfeasibleError(
                f"owner {j} ({ch.device.id} {ch.par}, resident batch {ch.resident_batch}) needs "
                f"{need / 1e9:.1f} GB per GPU but has {cap[-1] / 1e9:.1f} GB usable; lower its "
                "resident_batch or raise its tp or dp"
            )
    ev = evaluate(st, tables, owners, plan.microbatches, global_batch=plan.global_batch)
    run = simulate_events(ev.pipeline, iterations)
    t0, t1, window = steady_window(run, ev.tpot_s)
    occ = {k: v / ev.tpot_s for k, v in ev.busy_s.items()}
    return SimResult(
        plan=plan,
        tpot_s=ev.tpot_s,
        usd_per_million_tokens=ev.usd_per_million_tokens,
        stages_per_token=ev.stages_per_token,
        internode_bytes_per_token=ev.internode_bytes_per_token,
        compute_occupancy=ev.compute_occupancy,
        busy_s=ev.busy_s,
        occupancy=occ,
        trace=tuple(window),
        window_s=(t0, t1),
        memory_bytes_per_gpu=tuple(mem),
        memory_capacity_bytes=tuple(cap),
        event_periods_s=tuple(run.periods_s()),
        pipeline=ev.pipeline,
        notes=notes,
    )
