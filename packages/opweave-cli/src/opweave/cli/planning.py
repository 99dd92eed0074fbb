"""``opweave plan`` and ``opweave simulate``: plan search and schedule simulation."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import (
    PLOT_SUFFIXES,
    catalog,
    check_context,
    emit_json,
    load_spec,
    output_file,
    parse_list,
    parse_size,
    table,
)
from ._options import (
    MAX_MICROBATCHES,
    ConcurrencyOpt,
    DecodeContextOpt,
    EngineOpt,
    FleetOpt,
    FrontierPlotOpt,
    HardwareOpt,
    IslOpt,
    JsonOpt,
    KvCacheOpt,
    MaxOwnersOpt,
    MemoryFractionOpt,
    MicrobatchCountsOpt,
    ModelArg,
    NoBranchAndBoundOpt,
    NoFrontierPruningOpt,
    OslOpt,
    PlanBatchOpt,
    PlanOutputOpt,
    PlanProfileOpt,
    QuantOpt,
    RateOpt,
    RecvIntervalOpt,
    SchedulingOpt,
    SloStatisticOpt,
    TpotSlosOpt,
    TtftSloOpt,
    WorkloadFileOpt,
)
from ._progress import SearchProgress


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
    app.command("simulate")(simulate)


def load_profiles(paths: list[Path] | None) -> list[Any]:
    from pydantic import ValidationError

    from opweave.costmodel import ConfigError, Profile
    from opweave.costmodel.errors import not_a_file, validation_message

    profiles = []
    for path in paths or []:
        if not path.is_file():
            raise ConfigError(f"profile file {path} {not_a_file(path)}")
        try:
            profiles.append(Profile.from_json(path.read_bytes()))
        except OSError as exc:
            raise ConfigError(f"cannot read profile file {path}: {exc.strerror or exc}") from None
        except (ValidationError, UnicodeDecodeError) as exc:
            first = (
                exc.errors()[0]
                if isinstance(exc, ValidationError)
                else {"msg": str(exc), "loc": ()}
            )
            where = ".".join(str(p) for p in first["loc"]) or "file"
            raise ConfigError(
                f"profile file {path} is not a valid profile ({where}: "
                f"{validation_message(first)}); re-run opweave profile"
            ) from None
    return profiles


def load_plan_file(path: Path):  # -> Plan
    from pydantic import ValidationError

    from opweave.costmodel import ConfigError, Plan
    from opweave.costmodel.errors import not_a_file, validation_message

    if not path.is_file():
        raise ConfigError(f"plan file {path} {not_a_file(path)}")
    try:
        return Plan.from_json(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read plan file {path}: {exc.strerror or exc}") from None
    except (ValidationError, UnicodeDecodeError) as exc:
        first = (
            exc.errors()[0] if isinstance(exc, ValidationError) else {"msg": str(exc), "loc": ()}
        )
        where = ".".join(str(p) for p in first["loc"]) or "file"
        raise ConfigError(
            f"plan file {path} is not a valid plan ({where}: {validation_message(first)}); "
            "write one with opweave plan -o"
        ) from None


def load_servable_plan(path: Path, command: str):  # -> Plan
    """A plan file ``command`` (run, deploy) serves: its decode owners and, for a P/D
    deployment, its prefill pool."""
    del command
    return load_plan_file(path)


def plan(
    model: ModelArg,
    gpus: FleetOpt,
    tpot_slo_ms: TpotSlosOpt,
    context: DecodeContextOpt = None,
    isl: IslOpt = None,
    osl: OslOpt = None,
    concurrency: ConcurrencyOpt = None,
    rate: RateOpt = None,
    workload_file: WorkloadFileOpt = None,
    engine: EngineOpt = None,
    scheduling: SchedulingOpt = None,
    scheduler_recv_interval: RecvIntervalOpt = None,
    memory_fraction: MemoryFractionOpt = None,
    ttft_slo_ms: TtftSloOpt = None,
    slo_statistic: SloStatisticOpt = "p90",
    profile: PlanProfileOpt = None,
    output: PlanOutputOpt = None,
    plot: FrontierPlotOpt = None,
    batch: PlanBatchOpt = None,
    microbatches: MicrobatchCountsOpt = None,
    max_owners: MaxOwnersOpt = 2,
    no_frontier_pruning: NoFrontierPruningOpt = False,
    no_branch_and_bound: NoBranchAndBoundOpt = False,
    json_out: JsonOpt = False,
    hardware: HardwareOpt = None,
    quant: QuantOpt = None,
    kv_cache_dtype: KvCacheOpt = "auto",
) -> None:
    """Search operator partitions, GPU types, TP, batching and microbatching for the cheapest
    decode plan that meets the TPOT SLO at --context, compared with colocated, AFD and CAD; or,
    with a workload (--isl --osl --concurrency | --rate), the cheapest whole deployment
    (aggregated, or a prefill pool beside a colocated, AFD, CAD or OpWeave decode pool)."""
    names, inventory = parse_gpus(gpus)
    slos = parse_slos(tpot_slo_ms)
    serving = {
        "--isl": isl,
        "--osl": osl,
        "--concurrency": concurrency,
        "--rate": rate,
        "--workload": workload_file,
        "--engine": engine,
        "--scheduling": scheduling,
        "--scheduler-recv-interval": scheduler_recv_interval,
        "--memory-fraction": memory_fraction,
        "--ttft-slo-ms": ttft_slo_ms,
    }
    if max_owners not in (1, 2, 3):
        raise typer.BadParameter(f"--max-owners must be 1, 2 or 3, got {max_owners}")
    if any(v is not None for v in serving.values()) or slo_statistic != "p90":
        from .serving_plans import plan_serving

        refused = {
            "--context": context,
            "--plot": plot,
            "--batch": batch,
            "--microbatches": microbatches,
            "--no-frontier-pruning": no_frontier_pruning or None,
            "--no-branch-and-bound": no_branch_and_bound or None,
        }
        plan_serving(
            model,
            names,
            inventory,
            slos,
            serving,
            slo_statistic,
            refused={k: v for k, v in refused.items() if v is not None},
            profile=profile,
            output=output,
            max_owners=max_owners,
            json_out=json_out,
            hardware=hardware,
            quant=quant,
            kv_cache_dtype=kv_cache_dtype,
        )
        return
    if context is None:
        raise typer.BadParameter(
            "plan needs --context (decode only) or a workload: --isl --osl with --concurrency "
            "or --rate"
        )
    shape = _batching(batch, microbatches)
    output_file(output, "-o")
    output_file(plot, "--plot", PLOT_SUFFIXES)
    if output is not None and plot is not None and output.resolve() == plot.resolve():
        raise typer.BadParameter(f"-o and --plot both name {plot}; give them different files")
    profiles = load_profiles(profile)
    spec = load_spec(model, quant, kv_cache_dtype, profiles)
    tokens = parse_size(context, "--context")
    check_context(spec, tokens, "--context")
    search = {
        "catalog": catalog(hardware),
        "profiles": profiles,
        "frontier_pruning": not no_frontier_pruning,
        "branch_and_bound": not no_branch_and_bound,
        "max_owners": max_owners,
        "inventory": inventory,
        **shape,
    }
    results = _search(spec, names, tokens, slos, search, progress=not json_out)
    _report(results, spec, tokens, output=output, plot=plot, json_out=json_out)


def _search(
    spec: Any,
    names: list[str],
    tokens: int,
    slos: list[float],
    options: dict[str, Any],
    *,
    progress: bool,
) -> list[Any]:
    """One plan search per SLO (ms), with a progress bar each; an error when none is feasible."""
    from opweave.costmodel import InfeasibleError
    from opweave.planner import plan as search

    results = []
    for slo in slos:
        bar = SearchProgress(progress)
        try:
            results.append(
                search(spec, names, context=tokens, tpot_slo_s=slo / 1e3, progress=bar, **options)
            )
        finally:
            bar.close()
    if all(r.best is None for r in results):
        raise InfeasibleError(results[0].message())
    return results


def _report(
    results: list[Any],
    spec: Any,
    tokens: int,
    *,
    output: Path | None,
    plot: Path | None,
    json_out: bool,
) -> None:
    """Write the plan files and the plot, and print the result (or the sweep) as asked."""
    written = _write_plans(results, output)
    if plot is not None:
        from ._plots import plot_frontier

        plot_frontier(
            frontier(results), plot, model=spec.name, gpus=results[0].gpus, context_tokens=tokens
        )
    if len(results) == 1:
        if json_out:
            emit_json(results[0].to_json())
            return
        typer.echo("\n".join(results[0].describe()))
    else:
        if json_out:
            emit_json({"sweep": [r.to_json() for r in results], "frontier": frontier(results)})
            return
        typer.echo("\n".join(describe_sweep(results)))
    for path, result in written:
        assert result.best is not None
        ranks = sum(o.replicas * o.gpus_per_replica for o in result.best.owners)
        typer.echo(
            f"plan written to {path} ({ranks} rank{'s' if ranks > 1 else ''}); deployment "
            f"files: opweave deploy {path} --image IMAGE -o DIR"
        )
    if plot is not None:
        typer.echo(f"frontier plot written to {plot}")


FRONTIER = ("opweave", "colocated", "afd", "cad")


def frontier(results: list[Any]) -> dict[str, list[dict[str, Any] | None]]:
    """Per strategy, its plan at each SLO: ``{tpot_slo_s, tpot_s, usd_per_million_tokens}``,
    or null where it cannot meet the SLO."""
    out: dict[str, list[dict[str, Any] | None]] = {}
    for name in FRONTIER:
        points: list[dict[str, Any] | None] = []
        for r in results:
            p = r.best if name == "opweave" else r.baselines.get(name)
            if p is None or p.prediction is None:
                points.append(None)
                continue
            points.append(
                {
                    "tpot_slo_s": r.tpot_slo_s,
                    "tpot_s": p.prediction.tpot_s,
                    "usd_per_million_tokens": p.prediction.usd_per_million_tokens,
                }
            )
        out[name] = points
    return out


def describe_sweep(results: list[Any]) -> list[str]:
    """The cost vs TPOT frontier as a table, then each SLO's best plan in one line."""
    from opweave.planner import describe_plan

    front = frontier(results)
    rows = []
    for i, r in enumerate(results):
        cells = [f"{r.tpot_slo_s * 1e3:g}"]
        for name in FRONTIER:
            pt = front[name][i]
            cells.append(
                "infeasible"
                if pt is None
                else f"${pt['usd_per_million_tokens']:.4g} @ {pt['tpot_s'] * 1e3:.1f} ms"
            )
        rows.append(cells)
    header = ["SLO ms", "OpWeave", "colocated", "AFD", "CAD"]
    lines = [
        "Cost per million tokens vs TPOT: each strategy's cheapest plan per SLO "
        "(AFD = attention-FFN disaggregation, CAD = core-attention disaggregation)",
        table(rows, header),
        "",
    ]
    for r in results:
        lines.append(f"{r.tpot_slo_s * 1e3:g} ms: {r.message()}")
        if r.best is not None:
            lines.append(f"  {describe_plan(r.best)}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in results[0].assumptions()]
    return lines


def _write_plans(results: list[Any], output: Path | None) -> list[tuple[Path, Any]]:
    if output is None:
        return []
    written = []
    for r in results:
        if r.best is None:
            continue
        path = output
        if len(results) > 1:
            path = output.with_name(f"{output.stem}-{r.tpot_slo_s * 1e3:g}ms{output.suffix}")
            output_file(path, "-o")  # the file written in -o's place
        path.write_text(r.best.model_dump_json(indent=2) + "\n")
        written.append((path, r))
    return written


MAX_GPUS_PER_TYPE = 100_000  # an inventory bound beyond any cluster's; larger is a typo


def parse_gpus(text: str) -> tuple[list[str], dict[str, int]]:
    """``h100:16,a100`` -> (["h100", "a100"], {"h100": 16}); bad counts are one-line errors."""
    from opweave.costmodel import ConfigError

    names: list[str] = []
    inventory: dict[str, int] = {}
    for item in parse_list(text, what="--gpus"):
        name, sep, count = item.partition(":")
        name = name.strip()
        if not name:
            raise ConfigError(f"--gpus item {item!r} has no GPU type; write G or G:N, e.g. h100:8")
        if name.lower() in (n.lower() for n in names):
            raise ConfigError(f"--gpus names {name} more than once; give each GPU type once")
        names.append(name)
        if not sep:
            continue
        if not re.fullmatch(r"[0-9]+", count.strip()) or int(count) < 1:
            raise ConfigError(
                f"--gpus {item!r}: the count of {name} must be a positive whole number of GPUs, "
                f"got {count.strip()!r}"
            )
        if len(count.strip()) > 6 or int(count) > MAX_GPUS_PER_TYPE:
            raise ConfigError(
                f"--gpus {item!r}: at most {MAX_GPUS_PER_TYPE:,} GPUs of one type can be planned"
            )
        inventory[name] = int(count)
    if len(names) > 2:
        raise ConfigError(f"--gpus takes one or two GPU types, got {len(names)}")
    return names, inventory


MAX_SLOS = 64


def parse_slos(text: str) -> list[float]:
    """``50,20`` -> [20.0, 50.0] (ms): positive, finite, distinct, ascending."""
    import math

    from opweave.costmodel import ConfigError

    slos = []
    items = parse_list(text, what="--tpot-slo-ms")
    if len(items) > MAX_SLOS:  # each is a search of its own
        raise ConfigError(
            f"--tpot-slo-ms gives {len(items)} SLOs; give at most {MAX_SLOS} (each is a search)"
        )
    for item in items:
        # ASCII decimals, with an exponent or not: float() would also take "٥٠", "1_0", " 5"
        plain = re.fullmatch(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", item)
        value = float(item) if plain else math.nan
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--tpot-slo-ms takes positive numbers of ms, got {item!r}")
        slos.append(value)
    if len(set(slos)) < len(slos):
        raise ConfigError(f"--tpot-slo-ms {text!r} names an SLO more than once")
    return sorted(slos)


def _batching(batch: int | None, microbatches: str | None) -> dict[str, Any]:
    """``plan()``'s ``microbatches`` / ``u_grid`` from ``--batch`` and ``--microbatches``.

    A fixed resident batch ``B`` needs one microbatch count ``M``: the planner searches the
    microbatch size ``u`` per owner (resident batch ``M * u``), so fixing ``u = B / M`` gives
    every owner ``B`` requests and therefore one replica each.
    """
    counts = None
    if microbatches is not None:
        counts = sorted(parse_list(microbatches, int, "--microbatches"))  # distinct
        if counts[0] < 1 or counts[-1] > MAX_MICROBATCHES:
            raise typer.BadParameter(
                f"--microbatches takes counts from 1 to {MAX_MICROBATCHES}, got {microbatches!r}"
            )
    if batch is None:
        return {} if counts is None else {"microbatches": tuple(counts)}
    if counts is None or len(counts) != 1:
        raise typer.BadParameter(
            "--batch needs exactly one --microbatches count M (each owner holds B requests "
            "in M microbatches of B/M)"
        )
    (m,) = counts
    if batch % m:
        raise typer.BadParameter(
            f"--batch {batch} is not divisible by --microbatches {m}; pick a batch that splits "
            "into equal microbatches"
        )
    return {"microbatches": (m,), "u_grid": (batch // m,)}


def _builtin_model(plan: Any, path: Path) -> str:
    """The built-in model a plan names; never a path: a plan file is data, and its ``model.name``
    is only the folder's name where the plan was made (``--model`` says where the config is)."""
    from opweave.costmodel import BUILTIN_MODELS, ConfigError

    name = plan.model.name
    if name not in BUILTIN_MODELS:
        raise ConfigError(
            f"plan {path} is for model {name!r}, which is not built in; pass --model with its "
            "config.json or model folder"
        )
    return name


def _planned_model(model: str, plan: Any, path: Path):  # -> ModelSpec
    """``model`` in the precision the plan assumed (recorded in the plan file)."""
    from opweave.costmodel import ConfigError, load_model

    pm = plan.model
    options = pm.precision_options
    own = load_model(model, kv_cache_dtype=options["kv_cache_dtype"]).precision
    if own.quantized and own.quant != pm.quant:
        raise ConfigError(
            f"plan {path} assumed {pm.quant} weights, but {model} stores {own.quant} "
            f"({own.source}); pass --model with the config it was planned for"
        )
    return load_model(model, **options)


def _differs(planned: Any, sim: Any) -> bool:
    """Whether a re-simulation's TPOT or cost differs from the plan file's prediction."""
    if not math.isclose(sim.tpot_s, planned.tpot_s, rel_tol=1e-3):
        return True
    usd, again = planned.usd_per_million_tokens, sim.usd_per_million_tokens
    if usd is None or again is None:
        return (usd is None) != (again is None)
    return not math.isclose(again, usd, rel_tol=1e-3)


def planned_config(name: str, spec: Any, plan: Any, path: Path) -> bool:
    """Whether ``spec`` (model ``name`` in the plan's precision) is the config the plan was
    made for. A plan whose precision was edited beside the fingerprint of ``name``'s own
    precision is an error: nothing but an edit writes that."""
    from opweave.costmodel import ConfigError, load_model

    if spec.config_sha256 == plan.model.config_sha256:
        return True
    own = load_model(name)  # the checkpoint's own precision
    if own.config_sha256 == plan.model.config_sha256:
        pm = plan.model
        raise ConfigError(
            f"plan {path} records {pm.quant} weights and a {pm.kv_cache_dtype} KV cache "
            f"beside the fingerprint of {name} in {own.precision.quant} and "
            f"{own.precision.kv_cache_dtype}: the file was edited; plan again"
        )
    return False


def simulate(
    plan_file: Annotated[
        Path, typer.Argument(metavar="PLAN", help="A plan file (opweave plan -o).")
    ],
    model: Annotated[
        str | None,
        typer.Option("--model", help="Model name or config path (default: the plan's model)."),
    ] = None,
    gantt: Annotated[
        Path | None, typer.Option("--gantt", help="Write a Gantt chart PNG of one iteration.")
    ] = None,
    profile: PlanProfileOpt = None,
    json_out: JsonOpt = False,
    hardware: HardwareOpt = None,
) -> None:
    """Re-simulate a plan: TPOT, cost and per-resource occupancy of one steady-state iteration."""
    from opweave.costmodel import ConfigError
    from opweave.planner import gantt as draw_gantt
    from opweave.planner import simulate_plan

    output_file(gantt, "--gantt", PLOT_SUFFIXES)
    the_plan = load_plan_file(plan_file)
    name = model or _builtin_model(the_plan, plan_file)
    spec = _planned_model(name, the_plan, plan_file)
    if not planned_config(name, spec, the_plan, plan_file):
        raise ConfigError(
            f"plan {plan_file} was made for a different {the_plan.model.name} "
            "config; pass --model with the config it was planned for"
        )
    profiles = load_profiles(profile)
    sim = simulate_plan(
        the_plan, spec, catalog=None if hardware is None else catalog(hardware), profiles=profiles
    )
    for note in sim.notes:
        typer.echo(f"note: simulating other specs than the plan was made with: {note}", err=True)
    planned = the_plan.prediction
    if planned is not None and not sim.notes and _differs(planned, sim):

        def cost(usd: float | None) -> str:
            return "" if usd is None else f" and ${usd:.4g} per million tokens"

        typer.echo(
            f"note: the plan file predicts TPOT {planned.tpot_s * 1e3:.3f} ms"
            f"{cost(planned.usd_per_million_tokens)}, this re-simulation of its decode "
            f"iteration {sim.tpot_s * 1e3:.3f} ms{cost(sim.usd_per_million_tokens)}: the plan "
            "was made for a workload (its prediction covers the whole deployment, prompts "
            "prefilled beside decode), or the file was edited since",
            err=True,
        )
    if gantt is not None:
        draw_gantt(sim, gantt)
    precision = spec.precision
    pool = the_plan.prefill
    if json_out:
        emit_json(
            sim.to_json()
            | {"quant": precision.quant, "kv_cache_dtype": precision.kv_cache_dtype}
            | {"prefill": None if pool is None else pool.model_dump() | {"gpus": pool.gpus}}
        )
        return
    from opweave.planner import parallelism_words, plan_title

    typer.echo(
        f"{plan_title(the_plan)} for {spec.name} ({precision.quant} weights, "
        f"{precision.kv_cache_dtype} KV cache) at context {the_plan.context_tokens:,}: "
        f"TPOT {sim.tpot_s * 1e3:.3f} ms"
        + (
            ""
            if sim.usd_per_million_tokens is None
            else f", ${sim.usd_per_million_tokens:.4g} per million tokens"
        )
    )
    rows = [
        [name, f"{busy * 1e3:.3f}", f"{100 * sim.occupancy[name]:.1f}%"]
        for name, busy in sim.busy_s.items()
    ]
    typer.echo(table(rows, ["resource", "busy ms/iter", "occupancy"]))
    for path, prof in zip(profile or (), profiles, strict=True):
        typer.echo(f"{prof.device.id} latencies: {path}, {prof.describe()}")
    if pool is not None:
        typer.echo(
            f"prefill pool: {pool.replicas} engine{'s' if pool.replicas > 1 else ''} of "
            f"{pool.tp * pool.dp} x {pool.gpu} ({parallelism_words(pool.tp, pool.ep, pool.dp)}), "
            f"{pool.gpus} GPU{'s' if pool.gpus > 1 else ''}; it prefills every prompt and "
            "sends its KV cache to the decode owners above (the iteration simulated, its TPOT "
            "and its cost are the decode pool's)"
        )
    if gantt is not None:
        typer.echo(f"gantt chart written to {gantt}")
