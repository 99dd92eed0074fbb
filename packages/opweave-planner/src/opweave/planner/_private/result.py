"""What :func:`opweave.planner.plan` returns: the best plan, the baselines and search figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opweave.costmodel import Plan
from opweave.costmodel.errors import InfeasibleError

from .search import SearchStats

BASELINES = ("colocated", "afd", "cad")


def describe_plan(plan: Plan) -> str:
    """One line: strategy, owners (GPU, TP, resident batch, replicas), microbatches."""
    owners = " | ".join(f"{o.gpu} tp{o.tp} b{o.resident_batch} x{o.replicas}" for o in plan.owners)
    return (
        f"{plan.strategy} [{len(plan.template.cuts)}-stage template, "
        f"{len(plan.owners)} owner{'s' if len(plan.owners) > 1 else ''}: {owners}; "
        f"{plan.microbatches} microbatch{'es' if plan.microbatches > 1 else ''}]"
    )


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The JSON view of a plan used by ``opweave plan --json``."""
    pred = plan.prediction
    assert pred is not None, "planner plans carry a prediction"
    return {
        "strategy": plan.strategy,
        "usd_per_million_tokens": pred.usd_per_million_tokens,
        "tpot_s": pred.tpot_s,
        "stages_per_token": pred.stages_per_token,
        "owners": [
            {"gpu": o.gpu, "tp": o.tp, "replicas": o.replicas, "resident_batch": o.resident_batch}
            for o in plan.owners
        ],
        "microbatches": plan.microbatches,
        "template_cuts": list(plan.template.cuts),
        "internode_bytes_per_token": pred.internode_bytes_per_token,
        "compute_occupancy": pred.compute_occupancy,
    }


def _usd(plan: Plan) -> float:
    assert plan.prediction is not None and plan.prediction.usd_per_million_tokens is not None
    return plan.prediction.usd_per_million_tokens


@dataclass(frozen=True)
class PlanResult:
    """Outcome of a plan search.

    ``baselines`` maps ``colocated``, ``afd``, ``cad``, ``opweave_homogeneous`` and (with two GPU
    types) ``opweave_heterogeneous`` to their best plan, or ``None`` with the cause in
    ``reasons``. ``tightest`` is the lowest-TPOT plan of the whole space when nothing meets the
    SLO (``None`` otherwise, or when nothing fits in memory).
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

    @property
    def feasible(self) -> bool:
        return self.best is not None

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
        if self.tightest is None:
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

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "best": plan_summary(self.best) if self.best is not None else None,
            "baselines": {
                name: (
                    plan_summary(plan)
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
        }
        if self.best is None:
            out["reason"] = self.message()
            out["tightest"] = plan_summary(self.tightest) if self.tightest is not None else None
        return out

    def describe(self) -> list[str]:
        """Human-readable lines: the plan, then each baseline's cost against it and why."""
        lines = [self.message()]
        best = self.best
        if best is not None:
            pred = best.prediction
            assert pred is not None
            name = self.template_names.get(best.template.cuts, "")
            lines.append(
                f"  template cuts {list(best.template.cuts)}"
                + (f" ({name})" if name else "")
                + f"; {pred.stages_per_token} stages per token, "
                f"{pred.internode_bytes_per_token / 1e3:.1f} kB inter-node per token, "
                f"compute occupancy {100 * (pred.compute_occupancy or 0):.0f}%"
            )
        for key, plan in self.baselines.items():
            if plan is None:
                lines.append(f"  {key}: infeasible: {self.reasons.get(key, '')}")
                continue
            pred = plan.prediction
            assert pred is not None
            ratio = f" = {_usd(plan) / _usd(best):.2f}x best" if best is not None else ""
            why = []
            if best is not None and best.prediction is not None:
                bp = best.prediction
                if pred.stages_per_token > bp.stages_per_token:
                    why.append(f"{pred.stages_per_token} stages per token")
                if (pred.compute_occupancy or 0) < (bp.compute_occupancy or 0) - 0.05:
                    why.append(f"{100 * (pred.compute_occupancy or 0):.0f}% compute occupancy")
                mean_b = sum(o.resident_batch * o.tp for o in plan.owners) / sum(
                    o.tp for o in plan.owners
                )
                best_b = sum(o.resident_batch * o.tp for o in best.owners) / sum(
                    o.tp for o in best.owners
                )
                if mean_b < best_b:
                    why.append(f"smaller batches (mean {mean_b:.0f} vs {best_b:.0f})")
            lines.append(
                f"  {key}: ${_usd(plan):.4g}/Mtok{ratio}, TPOT {pred.tpot_s * 1e3:.2f} ms"
                + (f" ({', '.join(why)})" if why else "")
                + f": {describe_plan(plan)}"
            )
        s = self.search
        lines.append(
            f"  search: {s.simulator_calls} simulator calls, {s.candidates} candidates, "
            f"{s.wall_s:.2f} s"
        )
        return lines
