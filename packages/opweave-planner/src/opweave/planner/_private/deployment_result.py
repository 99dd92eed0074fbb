"""What :func:`opweave.planner.plan_deployment` returns: whole deployments (their pools, TTFT,
TPOT, cost), as JSON (``opweave plan --isl ... --json``) and in plain words."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from opweave.costmodel import Plan, Workload, fits_inventory, node_layout, plan_groups

from .engines import EngineOption, Slos
from .result import PlanResult, describe_plan, gpus_used, parallelism_words

Role = Literal["aggregated", "prefill", "decode"]
# Deployment kinds: the contract's baselines, then P/D with OpWeave's best decode plan.
KINDS = ("aggregated", "pd", "afd", "cad", "opweave")
SHORT = {
    "aggregated": "aggregated",
    "pd": "P/D",
    "afd": "P/D + AFD",
    "cad": "P/D + CAD",
    "opweave": "P/D + OpWeave",
}
KIND_WORDS = {
    "aggregated": "aggregated (prefill and decode in one engine, chunked prefill)",
    "pd": "P/D (a prefill pool and a pool of colocated decode replicas)",
    "afd": "P/D + AFD (decode attention and FFN/MoE on separate owners)",
    "cad": "P/D + CAD (decode core attention on its own owner)",
    "opweave": "P/D + OpWeave (the cheapest operator-disaggregated decode plan)",
}


@dataclass(frozen=True)
class Pool:
    """GPUs of one role: ``replicas`` engines of ``engine``'s shape (aggregated, prefill), or
    ``replicas`` replica sets of a decode ``plan``."""

    role: Role
    replicas: int
    usd_per_hour: float
    engine: EngineOption | None = None
    plan: Plan | None = None

    @classmethod
    def of_engine(cls, role: Role, option: EngineOption, replicas: int) -> Pool:
        return cls(role, replicas, option.usd_per_hour * replicas, engine=option)

    @classmethod
    def of_plan(cls, plan: Plan, sets: int, prices: Mapping[str, float]) -> Pool:
        per_set = sum(n * prices[gpu] for gpu, n in gpus_used(plan).items())
        return cls("decode", sets, per_set * sets, plan=plan)

    @property
    def gpus_by_type(self) -> dict[str, int]:
        if self.engine is not None:
            return {self.engine.device.id: self.engine.gpus * self.replicas}
        assert self.plan is not None
        return {gpu: n * self.replicas for gpu, n in gpus_used(self.plan).items()}

    @property
    def gpus_used(self) -> int:
        return sum(self.gpus_by_type.values())

    @property
    def gpu(self) -> str:
        """The GPU type, or the types joined by ``+`` (a heterogeneous decode plan)."""
        return "+".join(self.gpus_by_type)

    @property
    def parallelism(self) -> str:
        """``tp4`` (an engine), or each decode owner's ``gpu parallelism`` joined by `` | ``."""
        if self.engine is not None:
            return str(self.engine.par)
        assert self.plan is not None
        if len(self.plan.owners) == 1:
            return str(self.plan.owners[0].parallelism)
        return " | ".join(f"{o.gpu} {o.parallelism}" for o in self.plan.owners)

    def groups(self) -> list[tuple[str, int]]:
        """``(gpu, tp)`` of every tensor-parallel group, in rank order."""
        if self.engine is not None:
            par = self.engine.par
            return [(self.engine.device.id, par.tp)] * (par.dp * self.replicas)
        assert self.plan is not None
        return plan_groups(self.plan) * self.replicas

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gpu": self.gpu,
            "parallelism": self.parallelism,
            "replicas": self.replicas,
            "gpus_used": self.gpus_used,
            "gpus_by_type": self.gpus_by_type,
            "usd_per_hour": self.usd_per_hour,
        }
        if self.engine is not None:
            par = self.engine.par
            out |= {"tp": par.tp, "ep": par.ep, "dp": par.dp}
        if self.plan is not None:
            p = self.plan
            out |= {
                "strategy": p.strategy,
                "owners": [
                    {
                        "gpu": o.gpu,
                        "tp": o.tp,
                        "ep": o.ep,
                        "dp": o.dp,
                        "replicas": o.replicas,
                        "resident_batch": o.resident_batch,
                    }
                    for o in p.owners
                ],
                "microbatches": p.microbatches,
                "global_batch": p.global_batch,
                "template_cuts": list(p.template.cuts),
            }
        return out

    def words(self) -> str:
        n = self.replicas
        if self.engine is not None:
            what = "engine" if self.role == "aggregated" else f"{self.role} engine"
            return (
                f"{n} {what}{'s' if n > 1 else ''} of {self.engine.gpus} x "
                f"{self.engine.device.id} ({_parallelism_words(self.engine.par)})"
            )
        assert self.plan is not None
        return f"{n} cop{'ies, each' if n > 1 else 'y,'} {describe_plan(self.plan)}"


@dataclass(frozen=True)
class Deployment:
    """One whole deployment serving the workload, and what it achieves."""

    kind: str
    pools: tuple[Pool, ...]
    ttft_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_s: float
    tpot_p90_s: float
    tpot_p99_s: float
    tokens_per_s: float
    requests_per_s: float
    kv_transfer_s: float | None = None
    handoff_s: float | None = None  # P/D: from the prefill to the first token, the transfer in it

    @property
    def usd_per_hour(self) -> float:
        return sum(p.usd_per_hour for p in self.pools)

    @property
    def usd_per_million_tokens(self) -> float:
        return self.usd_per_hour / 3600 / self.tokens_per_s * 1e6

    @property
    def gpus_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pool in self.pools:
            for gpu, n in pool.gpus_by_type.items():
                out[gpu] = out.get(gpu, 0) + n
        return out

    @property
    def gpus_used(self) -> int:
        return sum(self.gpus_by_type.values())

    def pool(self, role: Role) -> Pool | None:
        return next((p for p in self.pools if p.role == role), None)

    def nodes(self, gpus_per_node: Mapping[str, int], copies: int = 1) -> list[tuple[str, int]]:
        """``(gpu, gpus)`` of every node of ``copies`` deployments, laid out as ``opweave
        deploy`` places a plan's ranks (:func:`opweave.costmodel.plan_nodes`): the decode
        groups, then the prefill pool's, filling each node before the next, so a small P/D
        deployment shares one node; copies of a pool share nodes as the replicas of one do."""
        pools = sorted(self.pools, key=lambda p: p.role == "prefill")
        groups = [g for pool in pools for g in pool.groups() * copies]
        return [(gpu, n) for gpu, _, n in node_layout(groups, gpus_per_node)]

    def on_one_node(self, gpus_per_node: Mapping[str, int]) -> bool:
        """Whether the whole deployment lies on one node (its pools share it)."""
        return len(self.nodes(gpus_per_node)) == 1

    def copies_in(
        self, inventory: Mapping[str, int | None], gpus_per_node: Mapping[str, int]
    ) -> int:
        """How many copies of this deployment the inventory holds (its bounded types)."""
        bounded = {g: n for g, n in inventory.items() if n is not None}
        used = self.gpus_by_type
        k = min((n // used[g] for g, n in bounded.items() if g in used), default=0)
        while k > 0 and not fits_inventory(self.nodes(gpus_per_node, k), bounded, gpus_per_node):
            k -= 1
        return k

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.kind,
            "ttft_s": self.ttft_s,
            "ttft_p90_s": self.ttft_p90_s,
            "ttft_p99_s": self.ttft_p99_s,
            "tpot_s": self.tpot_s,
            "tpot_p90_s": self.tpot_p90_s,
            "tpot_p99_s": self.tpot_p99_s,
            "tokens_per_s": self.tokens_per_s,
            "requests_per_s": self.requests_per_s,
            "usd_per_hour": self.usd_per_hour,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "gpus_used": self.gpus_used,
            "gpus_by_type": self.gpus_by_type,
            "kv_transfer_s": self.kv_transfer_s,
            "handoff_s": self.handoff_s,
            "pools": {p.role: p.to_json() for p in self.pools},
        }

    def headline(self, statistic: str = "p90") -> str:
        """One line of figures: the means, and beside them the tail the SLOs bound (``p99``
        when they bound it, else the p90)."""
        tail = "p99" if statistic == "p99" else "p90"
        ttft_tail, tpot_tail = getattr(self, f"ttft_{tail}_s"), getattr(self, f"tpot_{tail}_s")
        return (
            f"${self.usd_per_million_tokens:.4g} per million tokens, TTFT "
            f"{_ms(self.ttft_s)} ({tail} {_ms(ttft_tail)}), TPOT {_ms(self.tpot_s)} "
            f"({tail} {_ms(tpot_tail)}), {self.tokens_per_s:,.0f} tokens/s, "
            f"${self.usd_per_hour:.2f}/hour on {self.gpus_used} "
            f"GPU{'s' if self.gpus_used > 1 else ''}"
        )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


@dataclass(frozen=True)
class Fleet:
    """What a bounded inventory serves: copies of the best deployment and the GPUs left."""

    deployments: int
    tokens_per_s: float
    usd_per_hour: float
    gpus_left: dict[str, int]
    second: DeploymentResult | None = None  # the leftover GPUs' own plan (closed loop)
    second_copies: int = 0
    idle_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        second = None
        if self.second is not None and self.second.best is not None:
            second = self.second.best.to_json() | {"deployments": self.second_copies}
        return {
            "deployments": self.deployments,
            "tokens_per_s": self.tokens_per_s,
            "usd_per_hour": self.usd_per_hour,
            "gpus_left": self.gpus_left,
            "leftover_deployment": second,
            "idle_reason": self.idle_reason,
        }


@dataclass(frozen=True)
class DeploymentResult:
    """Outcome of :func:`~.deployment.plan_deployment`: the cheapest deployment meeting the
    SLOs (``best``), each kind's cheapest (``baselines``; ``None`` with the cause in
    ``reasons``), the decode plan search behind the P/D kinds, and with a bounded inventory
    what the fleet serves."""

    model: str
    gpus: tuple[str, ...]
    workload: Workload
    slos: Slos
    best: Deployment | None
    baselines: dict[str, Deployment | None]
    reasons: dict[str, str]
    decode: PlanResult
    inventory: dict[str, int | None]
    assumptions: tuple[str, ...]
    simulations: int = 0
    wall_s: float = 0.0
    fleet: Fleet | None = field(default=None)

    def message(self) -> str:
        if self.best is not None:
            return f"best: {KIND_WORDS[self.best.kind]}: {self.best.headline(self.slos.statistic)}"
        why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        return f"no deployment meets the SLOs ({self.slo_words()}): {why}"

    def slo_words(self) -> str:
        s = self.slos
        out = f"TPOT {s.tpot_s * 1e3:g} ms"
        if s.ttft_s is not None:
            out += f", TTFT {s.ttft_s * 1e3:g} ms"
        return f"{out}, {s.statistic}"

    def to_json(self) -> dict[str, Any]:
        s = self.slos
        return {
            "model": self.model,
            "gpus": list(self.gpus),
            "workload": self.workload.model_dump(mode="json", exclude_none=True),
            "tpot_slo_s": s.tpot_s,
            "ttft_slo_s": s.ttft_s,
            "slo_statistic": s.statistic,
            "inventory": dict(self.inventory),
            "best": None if self.best is None else self.best.to_json(),
            "baselines": {
                kind: (
                    dep.to_json()
                    if dep is not None
                    else _infeasible(kind, self.reasons.get(kind, "infeasible"))
                )
                for kind, dep in self.baselines.items()
            },
            "fleet": None if self.fleet is None else self.fleet.to_json(),
            "search": {"simulations": self.simulations, "wall_s": self.wall_s},
            "assumptions": list(self.assumptions),
            **({} if self.best is not None else {"reason": self.message()}),
        }

    def describe(self) -> list[str]:
        lines = [self.message()]
        best = self.best
        if best is not None:
            lines += [f"  {p.role} pool: {p.words()}" for p in best.pools]
            if best.kv_transfer_s is not None:
                line = f"  KV transfer per request: {_ms(best.kv_transfer_s)}"
                if best.handoff_s is not None:
                    line += (
                        f"; prefill to first token at the decode pool: "
                        f"{_ms(best.handoff_s)} (its step boundaries)"
                    )
                lines.append(line)
        if self.fleet is not None:
            lines += self._fleet_lines(self.fleet)
        shown = {
            k: d
            for k, d in self.baselines.items()
            if d is None or best is None or d.pools != best.pools
        }
        left_out = "; those that are the best deployment are left out" if best else ""
        if shown:
            lines.append(f"deployments compared ({self.slo_words()}){left_out}:")
        said: dict[str, tuple[Pool, ...]] = {}
        for kind, dep in shown.items():
            if dep is None:
                lines.append(f"  {kind}: infeasible: {self.reasons.get(kind, '')}")
                continue
            same = next((k for k, pools in said.items() if pools == dep.pools), None)
            if same is not None:
                lines.append(f"  {KIND_WORDS[kind]}: the same deployment as {SHORT[same]}")
                continue
            said[kind] = dep.pools
            ratio = ""
            if best is not None:
                ratio = f"{dep.usd_per_million_tokens / best.usd_per_million_tokens:.2f}x: "
            lines.append(f"  {KIND_WORDS[kind]}: {ratio}{dep.headline(self.slos.statistic)}")
            lines += [f"    {p.role}: {p.words()}" for p in dep.pools]
        lines.append("assumptions:")
        lines += [f"  - {a}" for a in self.assumptions]
        lines.append(f"search: {self.simulations:,} engine simulations, {self.wall_s:.2f} s")
        return lines

    def _fleet_lines(self, fleet: Fleet) -> list[str]:
        inv = ", ".join(f"{g}:{n}" for g, n in self.inventory.items() if n is not None)
        lines = [
            f"  the inventory ({inv}) holds {fleet.deployments} such deployment"
            f"{'s' if fleet.deployments > 1 else ''}: {fleet.tokens_per_s:,.0f} tokens/s at "
            f"${fleet.usd_per_hour:.2f}/hour"
        ]
        if self.workload.rate_per_s is not None:
            lines.append(
                f"    headroom: up to {fleet.deployments * self.workload.rate_per_s:g} "
                "requests/s with as many copies"
            )
        left = {g: n for g, n in fleet.gpus_left.items() if n > 0}
        if not left:
            return lines
        left_text = " + ".join(f"{n} x {g}" for g, n in left.items())
        second = fleet.second
        if second is not None and second.best is not None and fleet.second_copies > 0:
            lines.append(
                f"    the {left_text} left over run {fleet.second_copies} more: "
                f"{KIND_WORDS[second.best.kind]}: {second.best.headline(self.slos.statistic)}"
            )
            rest = (
                {g: n for g, n in second.fleet.gpus_left.items() if n > 0} if second.fleet else {}
            )
            if rest:
                lines.append(
                    "    idle: "
                    + " + ".join(f"{n} x {g}" for g, n in rest.items())
                    + " (too few for another deployment meeting the SLOs)"
                )
        else:
            lines.append(f"    idle: {left_text}: {fleet.idle_reason}")
        return lines


def _parallelism_words(par: Any) -> str:
    return parallelism_words(par.tp, par.ep, par.dp)


def _infeasible(kind: str, reason: str) -> dict[str, Any]:
    keys = (
        "ttft_s", "ttft_p90_s", "ttft_p99_s", "tpot_s", "tpot_p90_s", "tpot_p99_s",
        "tokens_per_s", "requests_per_s", "usd_per_hour", "usd_per_million_tokens",
        "gpus_used", "gpus_by_type", "kv_transfer_s", "handoff_s", "pools",
    )  # fmt: skip
    return {"strategy": kind, **dict.fromkeys(keys), "reason": reason}
