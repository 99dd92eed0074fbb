"""``opweave plan`` and ``opweave simulate``: plan search and schedule simulation."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import (
    HardwareOpt,
    JsonOpt,
    ModelArg,
    catalog,
    emit_json,
    parse_list,
    parse_size,
    table,
)

ProfileOpt = Annotated[
    list[Path] | None,
    typer.Option("--profile", help="Measured profile file; its device becomes usable in --gpus."),
]


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
    app.command("simulate")(simulate)


def load_profiles(paths: list[Path] | None) -> list[Any]:
    from pydantic import ValidationError

    from opweave.costmodel import ConfigError, Profile

    profiles = []
    for path in paths or []:
        if not path.is_file():
            raise ConfigError(f"profile file {path} does not exist")
        try:
            profiles.append(Profile.model_validate_json(path.read_text()))
        except (ValidationError, UnicodeDecodeError) as exc:
            first = (
                exc.errors()[0]
                if isinstance(exc, ValidationError)
                else {"msg": str(exc), "loc": ()}
            )
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(
                f"profile file {path} is not a valid profile ({where}: "
                f"{first['msg']}); re-run opweave profile"
            ) from None
    return profiles


def load_plan_file(path: Path):  # -> Plan
    from pydantic import ValidationError

    from opweave.costmodel import ConfigError, Plan

    if not path.is_file():
        raise ConfigError(f"plan file {path} does not exist")
    try:
        return Plan.model_validate_json(path.read_text())
    except (ValidationError, UnicodeDecodeError) as exc:
        first = (
            exc.errors()[0] if isinstance(exc, ValidationError) else {"msg": str(exc), "loc": ()}
        )
        where = ".".join(str(p) for p in first["loc"]) or "file"
        raise ConfigError(
            f"plan file {path} is not a valid plan ({where}: {first['msg']}); "
            "write one with opweave plan -o"
        ) from None


class _Progress:
    """A one-line live progress display on stderr (only when it is a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()

    def __call__(self, p: Any) -> None:
        if not self.enabled:
            return
        best = (
            "-"
            if p.best_usd_per_million_tokens is None
            else f"${p.best_usd_per_million_tokens:.3f}/Mtok"
        )
        sys.stderr.write(
            f"\r{p.phase:<12} {p.done}/{p.total} candidates "
            f"{p.simulator_calls} simulated, best {best}   "
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 110 + "\r")


def plan(
    model: ModelArg,
    gpus: Annotated[str, typer.Option("--gpus", help="GPU types of the cluster: G1 or G1,G2.")],
    context: Annotated[str, typer.Option("--context", help="Context tokens, e.g. 32K.")],
    tpot_slo_ms: Annotated[
        float, typer.Option("--tpot-slo-ms", min=0.001, help="Time-per-output-token SLO in ms.")
    ],
    profile: ProfileOpt = None,
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Write the best plan (Plan schema) to this file."),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(
            "--batch",
            min=1,
            help="Resident batch of every owner replica (requests); with one --microbatches "
            "count M every owner holds B requests in M microbatches of B/M, one replica each.",
        ),
    ] = None,
    microbatches: Annotated[
        str | None,
        typer.Option("--microbatches", help="Microbatch counts to search, e.g. 2 or 1,2,4."),
    ] = None,
    max_owners: Annotated[
        int,
        typer.Option("--max-owners", help="Most owners (device groups) a plan may map to: 1-3."),
    ] = 2,
    no_frontier_pruning: Annotated[bool, typer.Option("--no-frontier-pruning")] = False,
    no_branch_and_bound: Annotated[bool, typer.Option("--no-branch-and-bound")] = False,
    json_out: JsonOpt = False,
    hardware: HardwareOpt = None,
) -> None:
    """Search operator partitions, GPU types, TP, batching and microbatching for the cheapest
    plan that meets the TPOT SLO; compare with colocated, AFD and CAD."""
    from opweave.costmodel import InfeasibleError, load_model
    from opweave.planner import plan as search

    names = parse_list(gpus)
    if len(names) > 2:
        raise typer.BadParameter("--gpus takes one or two GPU types")
    if max_owners not in (1, 2, 3):
        raise typer.BadParameter(f"--max-owners must be 1, 2 or 3, got {max_owners}")
    shape = _batching(batch, microbatches)
    spec = load_model(model)
    progress = _Progress(not json_out)
    try:
        result = search(
            spec,
            names,
            context=parse_size(context),
            tpot_slo_s=tpot_slo_ms / 1e3,
            catalog=catalog(hardware),
            profiles=load_profiles(profile),
            frontier_pruning=not no_frontier_pruning,
            branch_and_bound=not no_branch_and_bound,
            progress=progress,
            max_owners=max_owners,
            **shape,
        )
    finally:
        progress.close()
    if result.best is None:
        raise InfeasibleError(result.message())
    if output is not None:
        output.write_text(result.best.model_dump_json(indent=2) + "\n")
    if json_out:
        emit_json(result.to_json())
        return
    typer.echo("\n".join(result.describe()))
    if output is not None:
        ranks = sum(o.replicas * o.tp for o in result.best.owners)
        typer.echo(
            f"plan written to {output} (runs on {ranks} rank{'s' if ranks > 1 else ''}: "
            f"opweave run {output} --ranks {ranks} ...)"
        )


def _batching(batch: int | None, microbatches: str | None) -> dict[str, Any]:
    """``plan()``'s ``microbatches`` / ``u_grid`` from ``--batch`` and ``--microbatches``.

    A fixed resident batch ``B`` needs one microbatch count ``M``: the planner searches the
    microbatch size ``u`` per owner (resident batch ``M * u``), so fixing ``u = B / M`` gives
    every owner ``B`` requests and therefore one replica each.
    """
    counts = None
    if microbatches is not None:
        counts = sorted(set(parse_list(microbatches, int)))
        if counts[0] < 1:
            raise typer.BadParameter(f"--microbatches takes positive counts, got {microbatches!r}")
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
    profile: ProfileOpt = None,
    json_out: JsonOpt = False,
    hardware: HardwareOpt = None,
) -> None:
    """Re-simulate a plan: TPOT, cost and per-resource occupancy of one steady-state iteration."""
    from opweave.costmodel import ConfigError, load_model
    from opweave.planner import gantt as draw_gantt
    from opweave.planner import simulate_plan

    the_plan = load_plan_file(plan_file)
    spec = load_model(model or the_plan.model.name)
    if spec.config_sha256 != the_plan.model.config_sha256:
        raise ConfigError(
            f"plan {plan_file} was made for a different {the_plan.model.name} "
            "config; pass --model with the config it was planned for"
        )
    sim = simulate_plan(the_plan, spec, catalog=catalog(hardware), profiles=load_profiles(profile))
    if gantt is not None:
        draw_gantt(sim, gantt)
    if json_out:
        emit_json(sim.to_json())
        return
    typer.echo(
        f"{the_plan.strategy} plan for {spec.name} at context {the_plan.context_tokens}: "
        f"TPOT {sim.tpot_s * 1e3:.3f} ms"
        + (
            ""
            if sim.usd_per_million_tokens is None
            else f", ${sim.usd_per_million_tokens:.3f} per million tokens"
        )
    )
    rows = [
        [name, f"{busy * 1e3:.3f}", f"{100 * sim.occupancy[name]:.1f}%"]
        for name, busy in sim.busy_s.items()
    ]
    typer.echo(table(rows, ["resource", "busy ms/iter", "occupancy"]))
    if gantt is not None:
        typer.echo(f"gantt chart written to {gantt}")
