"""What :func:`opweave.planner.plan` returns: the best plan, the baselines and search figures,
as JSON (``opweave plan --json``) and in plain words (``opweave plan``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opweave.costmodel import (
    BALANCED_BASIS,
    ModelSpec,
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

# What each strategy is, in words (spelled out once in the text output).
STRATEGY_WORDS = {
    "colocated": "colocated (the whole model on one device group)",
    "afd": "AFD (attention-FFN disaggregation: attention modules and FFN/MoE on separate owners)",
    "cad": "CAD (core-attention disaggregation: core attention alone, everything else elsewhere)",
    "opweave": "OpWeave (the cheapest operator partition of the searched space)",
}
KIND_WORDS = {"full": "full-attention", "sliding": "sliding-window", "linear": "linear-attention"}


def describe_plan(plan: Plan) -> str:
    """One line: strategy, owners (GPU, parallelism, resident batch, replicas), microbatches."""
    owners = " | ".join(
        f"{o.gpu} {o.parallelism} b{o.resident_batch} x{o.replicas}" for o in plan.owners
    )
    return (
        f"{plan.strategy} [{len(plan.template.cuts)}-stage template, "
        f"{len(plan.owners)} owner{'s' if len(plan.owners) > 1 else ''}: {owners}; "
        f"{plan.microbatches} microbatch{'es' if plan.microbatches > 1 else ''}]"
    )


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
                f"best: {describe_plan(self.best)} at ${_usd(self.best):.4g} per million "
                f"tokens, TPOT {pred.tpot_s * 1e3:.2f} ms (SLO {slo_ms:g} ms)"
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
            "GPU counts with no given number are unbounded (cost per token does not depend on "
            "the number of replica sets)",
            *self._precision(),
            *self._imported(),
            *(self._expert_load() if self._uses_ep() else []),
            *(self._extrapolated(self.best) if self.best is not None else []),
        ]

    def _precision(self) -> list[str]:
        """The precision every figure assumes, and the GEMM path each GPU type takes."""
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
            + (f"; quantised GEMMs on {', '.join(paths)}" if precision.quantized and paths else "")
        ]

    def _imported(self) -> list[str]:
        """Which GPU types' latencies come from an imported (not measured) profile."""
        out = []
        for d in self.devices:
            if not isinstance(d.latency, ProfiledLatency):
                continue
            prof = d.latency.profile
            if prof.provenance.source != "aiconfigurator":
                continue
            settings = prof.provenance.settings
            roofline = sum((t.source or "").startswith("roofline") for t in prof.ops)
            out.append(
                f"{d.id} latencies: imported from NVIDIA's silicon database "
                f"({settings.get('database', '?')}, {settings.get('system', '?')}, "
                f"{settings.get('engine', '?')} {settings.get('engine_version', '?')}); "
                f"{len(prof.ops) - roofline} of {len(prof.ops)} operator tables from its "
                f"kernels, the rest roofline"
                + "".join(
                    f"; {kind.replace('all', 'all-')} measured ({source})"
                    for kind, source in dict.fromkeys((c.kind, c.source) for c in prof.collectives)
                )
            )
        return out

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
    def _owner_lines(self, plan: Plan) -> list[str]:
        doc = self.summary(plan)
        lines = []
        for o, place in zip(doc["owners"], doc["placement"], strict=True):
            reps = f"{o['replicas']} replica{'s' if o['replicas'] > 1 else ''}"
            used, cap = o["memory_bytes_per_gpu"] / 1e9, o["memory_capacity_bytes_per_gpu"] / 1e9
            layout = _layout_words(o["tp"], o["ep"], o["dp"])
            lines.append(
                f"    owner {place['owner']}: {reps} of {o['tp'] * o['dp']} x {o['gpu']} "
                f"({layout}, {o['quant']} weights), {o['resident_batch']} requests each, "
                f"{used:.1f} of {cap:.1f} GB per GPU"
            )
            lines.append(f"      runs {_operators_text(place['operators'])}")
        return lines

    def _headline(self, plan: Plan) -> str:
        doc = self.summary(plan)
        return (
            f"${doc['usd_per_million_tokens']:.4g} per million tokens, TPOT "
            f"{doc['tpot_s'] * 1e3:.2f} ms, {doc['tokens_per_s']:,.0f} tokens/s, "
            f"${doc['usd_per_hour']:.2f}/hour on {_gpus_text(doc['gpus_used'])}"
        )

    def describe(self) -> list[str]:
        """Human-readable lines: the plan in plain words (which operators run where, what it
        costs), each baseline against it and why, and the assumptions behind the figures."""
        lines = [self.message()]
        best = self.best
        if best is not None:
            pred = best.prediction
            assert pred is not None
            doc = self.summary(best)
            lines.append(f"  {STRATEGY_WORDS[best.strategy]}: {self._headline(best)}")
            lines += self._owner_lines(best)
            name = self.template_names.get(best.template.cuts, "")
            lines.append(
                f"    template cuts {list(best.template.cuts)}"
                + (f" ({name})" if name else "")
                + f"; {best.microbatches} microbatch{'es' if best.microbatches > 1 else ''} of "
                f"the global batch of {best.global_batch}; {pred.stages_per_token} stages per "
                f"token, {pred.internode_bytes_per_token / 1e3:.1f} kB inter-node per token, "
                f"compute occupancy {100 * (pred.compute_occupancy or 0):.0f}%"
            )
            nodes = ", ".join(f"{n['gpus']} x {n['gpu']}" for n in doc["nodes"])
            lines.append(f"    nodes: {len(doc['nodes'])} ({nodes})")
            if doc["replica_sets"] is not None:
                k = doc["replica_sets"]
                lines.append(
                    f"    the inventory {self.inventory_text()} holds {k} such deployment"
                    f"{'s' if k > 1 else ''} ({k * doc['tokens_per_s']:,.0f} tokens/s at "
                    f"${k * doc['usd_per_hour']:.2f}/hour)"
                )
        lines.append("  baselines (same GPU types" + (" and inventory)" if self.bounded else ")"))
        said: set[str] = set()
        for key, plan in self.baselines.items():
            word = key.split("_")[0]
            label = key.replace("_", " ")
            if word in STRATEGY_WORDS and word not in said and word != "opweave":
                label = STRATEGY_WORDS[word]
                said.add(word)
            if plan is None:
                lines.append(f"    {label}: infeasible: {self.reasons.get(key, '')}")
                continue
            pred = plan.prediction
            assert pred is not None
            ratio = f" = {_usd(plan) / _usd(best):.2f}x best" if best is not None else ""
            lines.append(f"    {label}: {self._headline(plan)}{ratio}{self._why(plan)}")
            lines.append(f"      {describe_plan(plan)}")
        lines.append("  assumptions: " + "; ".join(self.assumptions()))
        s = self.search
        lines.append(
            f"  search: {s.simulator_calls} simulator calls, {s.candidates} candidates, "
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
            why.append(f"smaller batches (mean {mean_b:.0f} vs {best_b:.0f})")
        return f" ({', '.join(why)})" if why else ""


def _layout_words(tp: int, ep: int, dp: int) -> str:
    """``TP2``, or ``4 DP ranks of TP2, experts over EP8`` (how a replica lays out its GPUs)."""
    if ep == dp == 1:
        return f"TP{tp}"
    gpus = tp * dp
    if ep == 1:
        experts = f"experts tensor-parallel over all {gpus}"
    elif ep == gpus:
        experts = f"experts over EP{ep}"
    else:
        experts = f"experts over EP{ep}, each TP{gpus // ep}"
    return f"{dp} DP rank{'s' if dp > 1 else ''} of TP{tp}, {experts}"


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
