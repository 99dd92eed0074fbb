"""``opweave plan`` with a workload: whole deployments (aggregated, P/D with a colocated, AFD,
CAD or OpWeave decode pool) compared, and what a bounded fleet serves."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import typer

from ._common import catalog, emit_json, load_spec, output_file, workload_from_flags


def plan_serving(
    model: str,
    names: list[str],
    inventory: dict[str, int],
    slos_ms: list[float],
    serving: dict[str, Any],
    statistic: str,
    *,
    refused: dict[str, Any],
    profile: list[Path] | None,
    output: Path | None,
    max_owners: int,
    json_out: bool,
    hardware: Path | None,
    quant: str | None,
    kv_cache_dtype: str,
) -> None:
    from opweave.costmodel import InfeasibleError
    from opweave.planner import plan_deployment

    from ._progress import SearchProgress
    from .planning import load_profiles

    if refused:
        given = [flag for flag, value in serving.items() if value is not None]
        if statistic != "p90":
            given.append("--slo-statistic")
        raise typer.BadParameter(
            f"{' and '.join(refused)} (decode-only planning at --context) cannot be combined "
            f"with {' and '.join(given)} (a whole deployment for a workload: --isl --osl "
            "with --concurrency or --rate); give one or the other"
        )
    if len(slos_ms) > 1:
        raise typer.BadParameter(
            "a workload is planned for one --tpot-slo-ms; run one plan per SLO to compare"
        )
    if statistic not in ("mean", "p90", "p99"):
        raise typer.BadParameter(f"--slo-statistic takes mean, p90 or p99, got {statistic!r}")
    ttft_ms = serving["--ttft-slo-ms"]
    if ttft_ms is not None and not ttft_ms > 0:
        raise typer.BadParameter(f"--ttft-slo-ms must be a positive number of ms, got {ttft_ms}")
    output_file(output, "-o")
    profiles = load_profiles(profile)
    spec = load_spec(model, quant, kv_cache_dtype, profiles)
    workload = workload_from_flags(
        spec,
        serving["--isl"],
        serving["--osl"],
        serving["--concurrency"],
        serving["--rate"],
        workload_file=serving["--workload"],
        scheduling=serving["--scheduling"],
        engine=serving["--engine"],
        scheduler_recv_interval=serving["--scheduler-recv-interval"],
        memory_fraction=serving["--memory-fraction"],
    )
    progress = SearchProgress(not json_out)
    try:
        result = plan_deployment(
            spec,
            names,
            workload=workload,
            tpot_slo_s=slos_ms[0] / 1e3,
            ttft_slo_s=None if ttft_ms is None else ttft_ms / 1e3,
            statistic=statistic,  # type: ignore[arg-type]
            catalog=catalog(hardware),
            profiles=profiles,
            inventory=inventory,
            max_owners=max_owners,
            progress=progress,
        )
    finally:
        progress.close()
    if result.best is None:
        raise InfeasibleError(result.message())
    if output is not None:
        written = deployable_plan(result, spec)
        output.write_text(written.model_dump_json(indent=2) + "\n")
    if json_out:
        emit_json(result.to_json())
        return
    typer.echo("\n".join(result.describe()))
    if output is not None:
        typer.echo(f"plan written to {output} ({_written_words(result)})")


def deployable_plan(result: Any, spec: Any):  # -> Plan
    """The best deployment as one plan file: a P/D deployment's decode plan with its replica
    sets as replicas and its prefill pool; an aggregated deployment's engines as a colocated
    plan (each replica prefills its own requests)."""
    from opweave.costmodel import Plan, Prediction, PrefillPool, canonical_plan

    best = result.best
    decode = best.pool("decode")
    if decode is None:
        pool = best.pool("aggregated")
        engine = pool.engine
        est_batch = max(
            1,
            math.ceil(best.requests_per_s * best.tpot_s * result.workload.osl.mean / pool.replicas),
        )
        batch = max(engine.par.dp, engine.par.dp * math.ceil(est_batch / engine.par.dp))
        plan = canonical_plan(
            spec,
            "colocated",
            gpu=engine.device.id,
            batch=batch,
            context_tokens=max(1, round(result.workload.mean_decode_context)),
            tp=engine.par.tp,
            ep=engine.par.ep,
            dp=engine.par.dp,
            replicas=pool.replicas,
        )
        return plan.model_copy(
            update={
                "tpot_slo_s": result.slos.tpot_s,
                "hardware": (engine.device.hardware,),
                "prediction": Prediction(
                    tpot_s=best.tpot_s,
                    usd_per_million_tokens=best.usd_per_million_tokens,
                    tokens_per_s_per_replica_set=best.tokens_per_s,
                    stages_per_token=1,
                ),
            }
        )
    plan = decode.plan
    sets = decode.replicas
    owners = tuple(o.model_copy(update={"replicas": o.replicas * sets}) for o in plan.owners)
    prefill = best.pool("prefill")
    par = prefill.engine.par
    pred = plan.prediction
    hardware = {hw.id: hw for hw in plan.hardware}
    hardware.setdefault(prefill.engine.device.id, prefill.engine.device.hardware)
    return Plan.model_validate(
        plan.model_dump()
        | {
            "owners": owners,
            "prefill": PrefillPool(
                gpu=prefill.engine.device.id,
                tp=par.tp,
                ep=par.ep,
                dp=par.dp,
                replicas=prefill.replicas,
            ),
            "hardware": tuple(hardware.values()) if plan.hardware else (),
            "prediction": pred.model_copy(
                update={
                    "usd_per_million_tokens": best.usd_per_million_tokens,
                    "tokens_per_s_per_replica_set": best.tokens_per_s,
                }
            ),
        }
    )


def _written_words(result: Any) -> str:
    best = result.best
    if best.pool("decode") is None:
        return "the aggregated engines as a colocated plan; opweave run serves it"
    return "the decode pool and its prefill pool; opweave run and deploy serve both"
