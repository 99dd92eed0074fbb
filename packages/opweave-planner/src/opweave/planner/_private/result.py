"""What :func:`opweave.planner.plan` returns: the best plan, the baselines and search figures,
as JSON (``opweave plan --json``) and in plain words (``opweave plan``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opweave.costmodel import (
    BALANCED_BASIS,
    ModelSpec,
    Parallelism,
    Plan,
    ProfiledLatency,
    check_runs,
    copies_in_inventory,
    memory_bytes_per_gpu,
    plan_nodes,
    segments,
)
from opweave.costmodel.errors import InfeasibleError

from .devices import Device
from .search import SearchStats

BASELINES = ("colocated", "afd", "cad")

# What each baseline is, in words.
BASELINE_WORDS = {
    "colocated": "colocated (the whole model on one device group)",
    "afd": "AFD (attention-FFN disaggregation: attention and FFN/MoE on separate owners)",
    "cad": "CAD (core-attention disaggregation: core attention alone, the rest elsewhere)",
    "opweave_homogeneous": "OpWeave on one GPU type",
    "opweave_heterogeneous": "OpWeave mixing GPU types",
}
KIND_WORDS = {"full": "full-attention", "sliding": "sliding-window", "linear": "linear-attention"}
KIND_OF_STRATEGY = {"afd": "attention-FFN disaggregation", "cad": "core-attention disaggregation"}


def plan_kind(plan: Plan) -> str:
    """What shape of plan this is, in words: ``colocated``, ``attention-FFN disaggregation``,
    ``core-attention disaggregation``, ``layer pipeline`` (whole layer blocks alternate between
    the owners) or ``operator split`` (a layer's operators run on different owners)."""
    if len(plan.owners) == 1 or plan.strategy == "colocated":
        return "colocated"
    if plan.strategy in ("afd", "cad"):
        return KIND_OF_STRATEGY[plan.strategy]
    if plan.template.cuts == (0,):
        return "layer pipeline"
    return "operator split"


def plan_title(plan: Plan) -> str:
    """``OpWeave operator split over 2 owners``, ``colocated (the whole model on one device
    group)``: the plan's strategy and shape, in words."""
    kind = plan_kind(plan)
    if plan.strategy != "opweave" or kind == "colocated":
        return BASELINE_WORDS.get(plan.strategy if plan.strategy != "opweave" else kind, kind)
    n = len(plan.owners)
    same = "identical " if all(o == plan.owners[0] for o in plan.owners) else ""
    return f"OpWeave {kind} over {n} {same}owners"


def nodes_text(nodes: Sequence[Mapping[str, Any]]) -> str:
    """``19 nodes: 3 x 8 h100-sxm, 16 x 8 a100-sxm-80gb`` (nodes of the same size and GPU
    counted together, in order)."""
    counts: dict[tuple[str, int], int] = {}
    for n in nodes:
        counts[(n["gpu"], n["gpus"])] = counts.get((n["gpu"], n["gpus"]), 0) + 1
    total = len(nodes)
    parts = ", ".join(f"{k} x {gpus} {gpu}" for (gpu, gpus), k in counts.items())
    return f"{total} node{'s' if total > 1 else ''}: {parts}"


def owner_words(owner: Any) -> str:
    """``3 replicas of 8 x h100-sxm (TP8, EP8) holding 3,072 requests each``."""
    n = owner.replicas
    each = " each" if n > 1 else ""
    return (
        f"{n} replica{'s' if n > 1 else ''} of {owner.tp * owner.dp} x {owner.gpu} "
        f"({parallelism_words(owner.tp, owner.ep, owner.dp)}) holding "
        f"{owner.resident_batch:,} request{'s' if owner.resident_batch != 1 else ''}{each}"
    )


def parallelism_words(tp: int, ep: int, dp: int) -> str:
    """``TP2``, ``TP8, EP8``, ``DP16 x TP2, EP32`` or ``DP4 x TP1, FFN TP4``: with
    data-parallel attention and no EP the FFN (experts included) is tensor-parallel over the
    whole group, each GPU holding its share."""
    out = f"TP{tp}" if dp == 1 else f"DP{dp} x TP{tp}"
    if ep > 1:
        return f"{out}, EP{ep}"
    return f"{out}, FFN TP{tp * dp}" if dp > 1 else out


def describe_plan(plan: Plan) -> str:
    """One line in plain words: what shape of plan, which GPUs in which groups, how many
    requests each holds, and the microbatches a pipeline needs."""
    joint = ": " if len(plan.owners) == 1 else " over "
    return f"{plan_kind(plan)}{joint}{groups_text(plan)}"


def groups_text(plan: Plan) -> str:
    """The owners of :func:`describe_plan`: ``1 replica of 8 x a100 (TP8) holding 48
    requests`` or ``2 owners: ...; 3 microbatches``."""
    owners = plan.owners
    if len(owners) == 1:
        text = owner_words(owners[0])
    elif all(o == owners[0] for o in owners):
        text = f"{len(owners)} identical owners, each {owner_words(owners[0])}"
    else:
        text = f"{len(owners)} owners: " + "; ".join(owner_words(o) for o in owners)
    m = plan.microbatches
    return text + (f"; {m} microbatches" if m > 1 else "")


def gpus_used(plan: Plan) -> dict[str, int]:
    """GPUs of each type one deployment of the plan uses: ``sum(replicas * tp * dp)``."""
    out: dict[str, int] = {}
    for o in plan.owners:
        out[o.gpu] = out.get(o.gpu, 0) + o.replicas * o.gpus_per_replica
    return out


def placement(plan: Plan, model: ModelSpec) -> list[dict[str, Any]]:
    """Which operators run on which owner: per owner, its operators by name and layer kind
    (``layer_kind`` null for the model's first and last operators), with the number of layers
    in which the owner runs each, in model order."""
    segs = segments(model, plan.template, len(plan.owners))
    out = []
    for j, owner in enumerate(plan.owners):
        seen: dict[tuple[str, str | None], set[int]] = {}
        for seg in segs:
            if seg.owner != j:
                continue
            for op in seg.ops:
                kind = None if op.layer is None else model.layers[op.layer].attention.value
                seen.setdefault((op.name, kind), set())
                if op.layer is not None:
                    seen[(op.name, kind)].add(op.layer)
        out.append(
            {
                "owner": j,
                "gpu": owner.gpu,
                "tp": owner.tp,
                "ep": owner.ep,
                "dp": owner.dp,
                "quant": model.precision.quant,
                "replicas": owner.replicas,
                "operators": [
                    {"name": name, "layer_kind": kind, "layers": len(layers) if kind else None}
                    for (name, kind), layers in seen.items()
                ],
            }
        )
    return out


def plan_summary(
    plan: Plan,
    model: ModelSpec,
    devices: Sequence[Device],
    inventory: Mapping[str, int | None] | None = None,
) -> dict[str, Any]:
    """The JSON view of a plan used by ``opweave plan --json`` (one deployment of it: every
    figure is for the plan's replicas as written).

    ``devices`` price the GPUs and give their usable memory and node size; with ``inventory``
    (GPU id -> count, ``None`` unbounded) ``replica_sets`` says how many independent
    deployments of the plan the inventory holds.
    """
    pred = plan.prediction
    assert pred is not None and pred.tokens_per_s_per_replica_set is not None
    by_id = {d.id: d for d in devices}
    segs = segments(model, plan.template, len(plan.owners))
    owners = []
    for j, o in enumerate(plan.owners):
        ops = [op for s in segs if s.owner == j for op in s.ops]
        owners.append(
            {
                "gpu": o.gpu,
                "tp": o.tp,
                "ep": o.ep,
                "dp": o.dp,
                "quant": model.precision.quant,
                "kv_cache_dtype": model.precision.kv_cache_dtype,
                "replicas": o.replicas,
                "resident_batch": o.resident_batch,
                "gpus": o.replicas * o.gpus_per_replica,
                "memory_bytes_per_gpu": memory_bytes_per_gpu(
                    ops, o.parallelism, o.resident_batch, plan.context_tokens
                ),
                "memory_capacity_bytes_per_gpu": by_id[o.gpu].hardware.usable_memory_bytes,
            }
        )
    per_node = {d.id: d.hardware.gpus_per_node for d in devices}
    nodes = [(n.gpu, n.gpus) for n in plan_nodes(plan, per_node)]
    return {
        "strategy": plan.strategy,
        "usd_per_million_tokens": pred.usd_per_million_tokens,
        "tpot_s": pred.tpot_s,
        "tokens_per_s": pred.tokens_per_s_per_replica_set,
        "usd_per_hour": sum(
            o.replicas * o.gpus_per_replica * by_id[o.gpu].usd_per_hour for o in plan.owners
        ),
        "gpus_used": gpus_used(plan),
        "nodes": [{"gpu": g, "gpus": n} for g, n in nodes],
        "replica_sets": copies_in_inventory(nodes, inventory or {}, per_node),
        "stages_per_token": pred.stages_per_token,
        "owners": owners,
        "placement": placement(plan, model),
        "microbatches": plan.microbatches,
        "global_batch": plan.global_batch,
        "template_cuts": list(plan.template.cuts),
        "internode_bytes_per_token": pred.internode_bytes_per_token,
        "compute_occupancy": pred.compute_occupancy,
    }


def _usd(plan: Plan) -> float:
    assert plan.prediction is not None and plan.prediction.usd_per_million_tokens is not None
    return plan.prediction.usd_per_million_tokens


def _gpus_text(counts: Mapping[str, int]) -> str:
    return " + ".join(f"{n} x {gpu}" for gpu, n in counts.items())


@dataclass(frozen=True)
class PlanResult:
    """Outcome of a plan search.

    ``baselines`` maps ``colocated``, ``afd``, ``cad``, ``opweave_homogeneous`` and (with two GPU
    types) ``opweave_heterogeneous`` to their best plan, or ``None`` with the cause in
    ``reasons``. ``tightest`` is the lowest-TPOT plan of the whole space when nothing meets the
    SLO (``None`` otherwise, or when nothing fits in memory). ``inventory`` maps each GPU type to
    its count (``None``: unbounded); when it is too small for every plan meeting the SLO,
    ``smallest`` is the plan with the fewest GPUs that meets it without the bound.
    """

    model: str
    gpus: tuple[str, ...]
    context_tokens: int
    tpot_slo_s: float
    best: Plan | None
    baselines: dict[str, Plan | None]
    reasons: dict[str, str]
    search: SearchStats
    tightest: Plan | None = None
    template_names: dict[tuple[int, ...], str] = field(default_factory=dict, repr=False)
    inventory: dict[str, int | None] = field(default_factory=dict)
    smallest: Plan | None = None
    spec: ModelSpec | None = field(default=None, repr=False, compare=False)
    devices: tuple[Device, ...] = field(default=(), repr=False, compare=False)
    expert_skew: float = 1.0
    fewest_microbatches: int = 1  # the search's smallest microbatch count

    @property
    def feasible(self) -> bool:
        return self.best is not None

    @property
    def bounded(self) -> bool:
        return any(v is not None for v in self.inventory.values())

    def inventory_text(self) -> str:
        return ", ".join(g if n is None else f"{g}:{n}" for g, n in self.inventory.items())

    def message(self) -> str:
        """One line: the best plan, or why there is none and what to do."""
        slo_ms = self.tpot_slo_s * 1e3
        if self.best is not None:
            pred = self.best.prediction
            assert pred is not None
            return (
                f"best: {plan_title(self.best)}, ${_usd(self.best):.4g} per million tokens, "
                f"TPOT {pred.tpot_s * 1e3:.2f} ms (SLO {slo_ms:g} ms)"
            )
        if self.smallest is not None:
            need = gpus_used(self.smallest)
            within = ""
            if self.tightest is not None and self.tightest.prediction is not None:
                within = (
                    f" (within it the tightest TPOT is "
                    f"{self.tightest.prediction.tpot_s * 1e3:.2f} ms)"
                )
            return (
                f"no plan that fits the inventory {self.inventory_text()} meets the {slo_ms:g} "
                f"ms TPOT SLO{within}; the smallest plan that meets it needs "
                f"{_gpus_text(need)}: {describe_plan(self.smallest)}; raise the counts in --gpus "
                "or relax --tpot-slo-ms"
            )
        if self.tightest is None:
            if self.bounded:
                return (
                    f"{self.model} does not fit the inventory {self.inventory_text()} at context "
                    f"{self.context_tokens}, and no plan meets the {slo_ms:g} ms TPOT SLO on "
                    "any number of these GPUs either; add a GPU type with more memory, shorten "
                    "the context or relax --tpot-slo-ms"
                )
            m = self.fewest_microbatches
            if m > 1:  # each owner holds a request per microbatch at least
                return (
                    f"{self.model} does not fit on {', '.join(self.gpus)} at context "
                    f"{self.context_tokens} with {m} microbatches: no owner configuration "
                    f"holds its weights and the state of {m} requests; lower --microbatches, "
                    "add a GPU type with more memory or shorten the context"
                )
            return (
                f"{self.model} does not fit on {', '.join(self.gpus)} at context "
                f"{self.context_tokens}: no owner configuration holds its weights and state; "
                "add a GPU type with more memory or shorten the context"
            )
        pred = self.tightest.prediction
        assert pred is not None
        return (
            f"no plan meets the {slo_ms:g} ms TPOT SLO; the tightest TPOT found is "
            f"{pred.tpot_s * 1e3:.2f} ms by {describe_plan(self.tightest)}; relax "
            f"--tpot-slo-ms to at least {pred.tpot_s * 1e3:.2f} or add faster GPUs"
        )

    def raise_if_infeasible(self) -> None:
        if self.best is None:
            raise InfeasibleError(self.message())

    def summary(self, plan: Plan) -> dict[str, Any]:
        """:func:`plan_summary` of one of this result's plans."""
        assert self.spec is not None, "PlanResult built by plan() carries its model"
        return plan_summary(plan, self.spec, self.devices, self.inventory)

    def assumptions(self) -> list[str]:
        """What every figure of the result assumes, in words."""
        return [
            "decode only: prefill is not modelled",
            f"every request is at the {self.context_tokens}-token context",
            "every replica's resident batch is full (requests always waiting)",
            "prices are on-demand list prices per GPU-hour, dated in `opweave gpus` and "
            "overridable with --hardware; cost counts only the GPUs a plan uses",
            *(
                [
                    "GPU counts with no given number are unbounded (cost per token does not "
                    "depend on the number of replica sets)"
                ]
                if not self.inventory or None in self.inventory.values()
                else []
            ),
            *self._precision(),
            *self._profiled(),
            *(self._expert_load() if self._uses_ep() else []),
            *(self._extrapolated(self.best) if self.best is not None else []),
        ]

    def _precision(self) -> list[str]:
        """The precision every figure assumes, the GEMM path each GPU type takes, and the
        model's notes (what a multimodal checkpoint's figures leave out, the sizes its config
        left to transformers' defaults)."""
        if self.spec is None:
            return []
        precision = self.spec.precision
        paths = [
            f"{d.id}: {check_runs(precision, d.hardware)}"
            for d in self.devices
            if not isinstance(d.latency, ProfiledLatency)
        ]
        return [
            f"precision: {precision.describe()}"
            + (f"; quantised GEMMs on {', '.join(paths)}" if precision.quantized and paths else ""),
            *self.spec.notes,
        ]

    def _profiled(self) -> list[str]:
        """Which GPU types' latencies come from a profile (measured, imported or synthesised)
        rather than the roofline, and where that profile's figures come from."""
        return [
            f"{d.id} latencies: {d.latency.profile.describe()}"
            for d in self.devices
            if isinstance(d.latency, ProfiledLatency)
        ]

    def _uses_ep(self) -> bool:
        plans = [self.best, *self.baselines.values()]
        return any(o.ep > 1 for p in plans if p is not None for o in p.owners)

    def _expert_load(self) -> list[str]:
        """What the expert-parallel plans assume of the router's load."""
        if self.expert_skew == 1.0:
            return [f"expert-parallel load: {BALANCED_BASIS}"]
        return [
            f"expert-parallel load: measured skew {self.expert_skew:g} (busiest over mean "
            "expected load of the expert GPUs, given) times the expected maximum of uniform "
            "routing"
        ]

    def _extrapolated(self, plan: Plan) -> list[str]:
        """Where ``plan`` looks a profile up outside the batches or contexts it measured."""
        out = []
        for o in {(o.gpu, o.tp): o for o in plan.owners if o.parallelism.plain}.values():
            dev = next((d for d in self.devices if d.id == o.gpu), None)
            if dev is None or not isinstance(dev.latency, ProfiledLatency):
                continue
            tables = [t for t in dev.latency.profile.ops if t.tp == o.tp]
            batch = -(-o.resident_batch // plan.microbatches)
            lo_b = max(t.batches[0] for t in tables)
            hi_b = min(t.batches[-1] for t in tables)
            beyond = []
            if not lo_b <= batch <= hi_b:
                beyond.append(f"microbatches of {batch} requests (measured {lo_b}-{hi_b})")
            by_context = [t for t in tables if len(t.contexts) > 1]
            if by_context:
                lo_c = max(t.contexts[0] for t in by_context)
                hi_c = min(t.contexts[-1] for t in by_context)
                if not lo_c <= plan.context_tokens <= hi_c:
                    beyond.append(f"context {plan.context_tokens} (measured {lo_c}-{hi_c} tokens)")
            if beyond:
                out.append(
                    f"{o.gpu} tp{o.tp} latencies are extrapolated beyond its profile's grid: "
                    f"{' and '.join(beyond)}; profile --batches/--contexts covering them"
                )
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tpot_slo_s": self.tpot_slo_s,
            "context_tokens": self.context_tokens,
            "inventory": dict(self.inventory),
            "best": self.summary(self.best) if self.best is not None else None,
            "baselines": {
                name: (
                    self.summary(plan)
                    if plan is not None
                    else {"plan": None, "reason": self.reasons.get(name, "infeasible")}
                )
                for name, plan in self.baselines.items()
            },
            "search": {
                "simulator_calls": self.search.simulator_calls,
                "candidates": self.search.candidates,
                "wall_s": self.search.wall_s,
            },
            "assumptions": self.assumptions(),
        }
        if self.best is None:
            out["reason"] = self.message()
            out["tightest"] = self.summary(self.tightest) if self.tightest is not None else None
            if self.bounded:
                out["smallest"] = self.summary(self.smallest) if self.smallest is not None else None
        return out

    # -- plain words ---------------------------------------------------------------------------
    def _owner_lines(self, plan: Plan, indent: str) -> list[str]:
        doc = self.summary(plan)
        assert self.spec is not None, "PlanResult built by plan() carries its model"
        moe = self.spec.arch.moe is not None
        lines = []
        for o, place in zip(doc["owners"], doc["placement"], strict=True):
            layout = Parallelism(tp=o["tp"], ep=o["ep"], dp=o["dp"])
            reps = f"{o['replicas']} replica{'s' if o['replicas'] > 1 else ''}"
            used, cap = o["memory_bytes_per_gpu"] / 1e9, o["memory_capacity_bytes_per_gpu"] / 1e9
            each = " each" if o["replicas"] > 1 else ""
            lines.append(
                f"{indent}owner {place['owner']}: {reps} of {o['tp'] * o['dp']} x {o['gpu']} "
                f"({layout.describe(moe)}), {o['quant']} weights, "
                f"{o['resident_batch']:,} request{'' if o['resident_batch'] == 1 else 's'}"
                f"{each}, {used:.1f} of {cap:.1f} GB per GPU"
            )
            lines.append(f"{indent}  runs {_operators_text(place['operators'])}")
        return lines

    def _headline(self, plan: Plan) -> str:
        doc = self.summary(plan)
        return (
            f"${doc['usd_per_million_tokens']:.4g} per million tokens, TPOT "
            f"{doc['tpot_s'] * 1e3:.2f} ms, {doc['tokens_per_s']:,.0f} tokens/s, "
            f"${doc['usd_per_hour']:.2f}/hour on {_gpus_text(doc['gpus_used'])}"
        )

    def _schedule_line(self, plan: Plan) -> str | None:
        """How tokens move between the owners and how the batch is pipelined (None for a
        single owner without microbatches: nothing moves)."""
        pred = plan.prediction
        assert pred is not None
        if len(plan.owners) == 1 and plan.microbatches == 1:
            return None
        m = plan.microbatches
        batch = (
            f"the {plan.global_batch:,} requests in flight move in {m} microbatches"
            if m > 1
            else f"the {plan.global_batch:,} requests in flight move as one batch"
        )
        return (
            f"  a token passes {pred.stages_per_token} stages in turn on the owners, "
            f"{pred.internode_bytes_per_token / 1e3:.1f} kB per token between nodes; {batch}, "
            f"keeping the GPUs {100 * (pred.compute_occupancy or 0):.0f}% busy"
        )

    def describe(self) -> list[str]:
        """Human-readable lines: the plan in plain words (which operators run where, what it
        costs), each baseline against it and why, and the assumptions behind the figures."""
        lines = [self.message()]
        best = self.best
        if best is not None:
            doc = self.summary(best)
            lines.append(
                f"  {doc['tokens_per_s']:,.0f} tokens/s for ${doc['usd_per_hour']:.2f}/hour on "
                f"{_gpus_text(doc['gpus_used'])} ({nodes_text(doc['nodes'])})"
            )
            lines += self._owner_lines(best, "  ")
            schedule = self._schedule_line(best)
            if schedule is not None:
                lines.append(schedule)
            if doc["replica_sets"] is not None:
                k = doc["replica_sets"]
                lines.append(
                    f"  the inventory {self.inventory_text()} holds {k} such deployment"
                    f"{'s' if k > 1 else ''} ({k * doc['tokens_per_s']:,.0f} tokens/s at "
                    f"${k * doc['usd_per_hour']:.2f}/hour)"
                )
        others = {k: p for k, p in self.baselines.items() if p is None or p != best}
        if others:
            lines.append(
                "baselines on the same GPU types"
                + (" and inventory" if self.bounded else "")
                + (", cost per token against the best plan's:" if best is not None else ":")
            )
        said: dict[str, Plan] = {}
        for key, plan in others.items():
            label = BASELINE_WORDS.get(key, key.replace("_", " "))
            if plan is None:
                lines.append(f"  {label}: infeasible: {self.reasons.get(key, '')}")
                continue
            same = next((k for k, p in said.items() if p == plan), None)
            if same is not None:
                short = BASELINE_WORDS.get(same, same).split(" (")[0]
                lines.append(f"  {label}: the same plan as {short}")
                continue
            said[key] = plan
            ratio = f"{_usd(plan) / _usd(best):.2f}x: " if best is not None else ""
            lines.append(f"  {label}: {ratio}{self._headline(plan)}")
            why = self._why(plan)
            lines.append(f"    {groups_text(plan)}" + (f"; costs more: {why}" if why else ""))
        lines.append("assumptions:")
        lines += [f"  - {a}" for a in self.assumptions()]
        s = self.search
        lines.append(
            f"search: {s.simulator_calls:,} simulator calls, {s.candidates:,} candidates, "
            f"{s.wall_s:.2f} s"
        )
        return lines

    def _why(self, plan: Plan) -> str:
        best = self.best
        if best is None or best.prediction is None or plan.prediction is None:
            return ""
        pred, bp = plan.prediction, best.prediction
        why = []
        if pred.stages_per_token > bp.stages_per_token:
            why.append(f"{pred.stages_per_token} stages per token")
        if (pred.compute_occupancy or 0) < (bp.compute_occupancy or 0) - 0.05:
            why.append(f"{100 * (pred.compute_occupancy or 0):.0f}% compute occupancy")
        mean_b = _mean_batch(plan)
        best_b = _mean_batch(best)
        if mean_b < best_b:
            why.append(
                f"smaller batches ({mean_b:.0f} vs {best_b:.0f} requests per replica, "
                "mean over GPUs)"
            )
        return ", ".join(why)


def _mean_batch(plan: Plan) -> float:
    """Resident batch of the plan's owners, weighted by their GPUs per replica."""
    gpus = [o.gpus_per_replica for o in plan.owners]
    return sum(o.resident_batch * g for o, g in zip(plan.owners, gpus, strict=True)) / sum(gpus)


def _operators_text(operators: Sequence[Mapping[str, Any]]) -> str:
    """``embed; in 52 sliding-window layers: attn_norm, qkv_proj; ...`` in model order."""
    parts: list[tuple[str, list[str]]] = []
    for op in operators:
        if op["layer_kind"] is None:
            where = "once"
        else:
            n = op["layers"]
            where = f"in {n} {KIND_WORDS.get(op['layer_kind'], op['layer_kind'])} layer"
            where += "s" if n > 1 else ""
        if parts and parts[-1][0] == where:
            parts[-1][1].append(op["name"])
        else:
            parts.append((where, [op["name"]]))
    return "; ".join(
        ", ".join(names) if where == "once" else f"{where}: {', '.join(names)}"
        for where, names in parts
    )
