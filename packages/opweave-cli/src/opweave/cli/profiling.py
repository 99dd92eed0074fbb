"""``opweave profile``: measure the runtime's operators and transport into a profile file.

Registered only when ``opweave.profiler`` is installed; torch is imported inside the command so
``opweave --help`` stays fast.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import (
    MAX_BATCH,
    MAX_COUNT,
    HardwareOpt,
    JsonOpt,
    KvCacheOpt,
    QuantOpt,
    catalog,
    check_context,
    emit_json,
    finite,
    load_spec,
    output_file,
    parse_list,
    positive_price,
)
from .running import DECODE_STEPS, KERNELS  # the same choices as opweave run


def register(app: typer.Typer) -> None:
    app.command("profile")(profile)


def _device(value: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value.strip().lower()):
        raise typer.BadParameter(f"--device must be cpu or cuda (or cuda:N), got {value!r}")
    return value.strip().lower()


def _summary(run: Any, path: Path) -> dict[str, Any]:
    profile, fit, link, loop = run.profile, run.fit, run.transfer, run.orchestration
    idle = run.idle
    return {
        "path": str(path),
        "model": profile.model,
        "dtype": profile.dtype,
        "device": {"id": profile.device.id, "name": profile.provenance.device_name},
        "tables": len(profile.ops),
        "cells": run.cells,
        "wall_s": run.wall_s,
        "stall_overhead": profile.stall_overhead,
        "kernels": profile.provenance.settings.get("kernels"),
        "decode_step": profile.provenance.settings.get("decode_step", "per-request"),
        "kernel_ops": profile.provenance.settings.get("kernel_ops"),
        "grid": {
            "batches": profile.provenance.settings.get("batches"),
            "contexts": profile.provenance.settings.get("contexts"),
        },
        "transfer": None
        if link is None
        else {
            "backend": link.backend,
            "latency_s": link.latency_s,
            "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
            "host_send_s": link.host_send_s,
            "host_recv_s": link.host_recv_s,
        },
        "orchestration": None
        if loop is None
        else loop.profile.model_dump() | {"points": [list(p) for p in loop.points]},
        "idle_slowdown": None
        if idle is None
        else idle.slowdown.model_dump() | {"points": [list(p) for p in idle.points]},
        "fit": None
        if fit is None
        else {
            "memory_efficiency": fit.hardware.memory_efficiency,
            "compute_efficiency": fit.hardware.compute_efficiency,
            "kernel_overhead_s": fit.hardware.kernel_overhead_s,
            "points": fit.points,
            "median_error_factor": fit.median_error_factor,
            "p90_error_factor": fit.p90_error_factor,
            "max_error_factor": fit.max_error_factor,
            "rms_log_error": fit.rms_log_error,
            "worst_op": fit.worst_op,
        },
    }


def profile(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Built-in model name, config.json, or model folder (its weights are used when "
            "present; otherwise random weights of the right shapes).",
        ),
    ],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Write the profile (Profile schema JSON) here.")
    ],
    device: Annotated[
        str,
        typer.Option(
            "--device", help="cpu, cuda or cuda:N; with --from aiconfigurator a GPU id (h100)."
        ),
    ] = "cpu",
    source: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="aiconfigurator: import the operator latencies from NVIDIA's silicon database "
            "(aiconfigurator-core, the profiler's aiconfigurator extra) instead of measuring.",
        ),
    ] = None,
    engine: Annotated[
        str, typer.Option("--engine", help="--from aiconfigurator: vllm, sglang or trtllm.")
    ] = "vllm",
    engine_version: Annotated[
        str | None,
        typer.Option(
            "--engine-version",
            help="--from aiconfigurator: the engine version measured (default: the newest "
            "the database has per kernel table).",
        ),
    ] = None,
    database: Annotated[
        Path | None,
        typer.Option(
            "--database",
            help="--from aiconfigurator: a database folder in aiconfigurator-core's layout "
            "(default: the installed package's).",
        ),
    ] = None,
    quant: QuantOpt = None,
    kv_cache_dtype: KvCacheOpt = "auto",
    tp: Annotated[
        str | None,
        typer.Option(
            "--tp",
            help="TP degrees, e.g. 1 (default: 1 when measuring; every degree of a node that "
            "the model shards over when importing).",
        ),
    ] = None,
    batches: Annotated[
        str | None,
        typer.Option("--batches", help="Batch sizes, e.g. 1,4,16 (default: log-spaced grid)."),
    ] = None,
    contexts: Annotated[
        str | None,
        typer.Option("--contexts", help="Context lengths, e.g. 1K,8K (default: log-spaced)."),
    ] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="Compute dtype (default: the config's).")
    ] = None,
    ops: Annotated[
        str | None,
        typer.Option("--ops", help="Only these operators, e.g. core_attn@full,lm_head."),
    ] = None,
    warmup: Annotated[
        int, typer.Option("--warmup", min=0, max=MAX_COUNT, help="Untimed calls per cell.")
    ] = 2,
    repeats: Annotated[
        int, typer.Option("--repeats", min=1, max=MAX_COUNT, help="Minimum timed calls per cell.")
    ] = 5,
    passes: Annotated[
        int | None,
        typer.Option(
            "--passes",
            min=1,
            max=MAX_COUNT,
            help="Grid passes; a cell is the median of its passes' medians "
            "(default: 2 on CPU, 1 on CUDA).",
        ),
    ] = None,
    timing_mode: Annotated[
        str | None,
        typer.Option(
            "--timing",
            help="chain: time each operator inside the block's operator chain in decode order "
            "(default on CPU); isolated: one operator back to back (default on CUDA).",
        ),
    ] = None,
    working_set_mib: Annotated[
        float | None,
        typer.Option(
            "--working-set-mib",
            min=0.0,
            max=float(1 << 30),
            callback=finite,
            help="chain timing: add layers until their weights reach this many MiB, so no "
            "operator finds its weights cached (default: twice the largest cache).",
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads",
            min=1,
            max=4096,
            help="torch threads while timing (default: 1 on CPU, as each CPU rank runs).",
        ),
    ] = None,
    usd_per_hour: Annotated[
        float | None,
        typer.Option(
            "--usd-per-hour",
            callback=positive_price,
            help="Device price (default: catalog, or an assumed $0.0425 per vCPU-hour on CPU).",
        ),
    ] = None,
    random_weights: Annotated[
        bool, typer.Option("--random-weights", help="Ignore weights in the model folder.")
    ] = False,
    kernels: Annotated[
        str,
        typer.Option(
            "--kernels",
            help="The kernels to time, as opweave run --kernels: opweave (the runtime's), or "
            "vLLM's CPU kernels where they apply: vllm (exact ones), vllm-all.",
        ),
    ] = "opweave",
    decode_step: Annotated[
        str,
        typer.Option(
            "--decode-step",
            help="How the timed operators run decode steps, as opweave run --decode-step: "
            "per-request, or each operator as the static step a rank runs: static, compiled, "
            "traced (decode-order timing only).",
        ),
    ] = "per-request",
    no_transfer: Annotated[
        bool, typer.Option("--no-transfer", help="Skip the two-process transfer measurement.")
    ] = False,
    no_orchestration: Annotated[
        bool,
        typer.Option(
            "--no-orchestration",
            help="CPU: skip measuring the serving loop's host time (two short colocated runs).",
        ),
    ] = False,
    no_idle: Annotated[
        bool,
        typer.Option(
            "--no-idle",
            help="CPU: skip timing reads of a buffer after idle gaps (a few s).",
        ),
    ] = False,
    hardware: HardwareOpt = None,
    seed: Annotated[
        int,
        typer.Option("--seed", min=0, max=2**32 - 1, help="Seed of random weights and inputs."),
    ] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Time the runtime's own operators of MODEL (one partition block, plus embed and head)
    over batch and context grids, and point-to-point transfers, into a profile file."""
    from opweave.costmodel import TP_DEGREES, load_model

    if source is not None:
        if source != "aiconfigurator":
            raise typer.BadParameter(f"--from takes aiconfigurator, got {source!r}")
        _import(
            model,
            device,
            engine,
            engine_version,
            database,
            quant,
            kv_cache_dtype,
            tp,
            batches,
            contexts,
            output,
            hardware,
            json_out,
        )
        return
    if quant is not None or kv_cache_dtype != "auto":
        raise typer.BadParameter(
            "--quant and --kv-cache-dtype apply to --from aiconfigurator; a measured profile "
            "times the checkpoint's own weights (--dtype sets the compute dtype)"
        )
    dev = _device(device)
    if kernels not in KERNELS:
        raise typer.BadParameter(f"--kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if decode_step not in DECODE_STEPS:
        raise typer.BadParameter(
            f"--decode-step must be one of {', '.join(DECODE_STEPS)}, got {decode_step!r}"
        )
    tps = parse_list(tp or "1", int, "--tp")
    if any(t not in TP_DEGREES for t in tps):
        raise typer.BadParameter(f"--tp takes degrees among {', '.join(map(str, TP_DEGREES))}")
    grid_b = parse_list(batches, int, "--batches") if batches else None
    if grid_b is not None and max(grid_b) > MAX_BATCH:  # the profiler refuses those below 1
        raise typer.BadParameter(f"--batches takes batch sizes up to {MAX_BATCH}")
    grid_s = parse_list(contexts, int, "--contexts") if contexts else None
    only = parse_list(ops, what="--ops") if ops else None
    output_file(output, "-o")
    spec = load_model(model)  # a bad config fails here, before torch loads
    for s in grid_s or []:
        check_context(spec, s, "--contexts:")

    from opweave.profiler import TimingSettings, profile_model, save_profile

    timing = TimingSettings(
        warmup=warmup,
        repeats=repeats,
        cell_budget_s=0.02 if dev.startswith("cuda") else 0.03,
        passes=passes or (1 if dev.startswith("cuda") else 2),
    )
    run = profile_model(
        model,
        device=dev,
        dtype=dtype,
        tp=tps,
        batches=grid_b,
        contexts=grid_s,
        ops=only,
        timing=timing,
        timing_mode=timing_mode,
        working_set_bytes=None if working_set_mib is None else working_set_mib * 2**20,
        threads=threads,
        transfer=not no_transfer,
        orchestration=not no_orchestration,
        idle=not no_idle,
        usd_per_hour=usd_per_hour,
        random_weights=random_weights,
        kernels=kernels,
        decode_step=decode_step,
        seed=seed,
        progress=not quiet,
    )
    path = save_profile(run.profile, output)
    doc = _summary(run, path)
    if json_out:
        emit_json(doc)
        return
    typer.echo(
        f"wrote {path}: {doc['tables']} operator tables of {doc['model']} ({doc['dtype']}) on "
        f"{doc['device']['name']}, {doc['cells']} cells in {doc['wall_s']:.1f} s"
    )
    if doc["transfer"]:
        t = doc["transfer"]
        typer.echo(
            f"transfer ({t['backend']}): {t['latency_s'] * 1e6:.1f} us + bytes / "
            f"{t['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s"
            + (
                f"; while both ranks compute a message also costs the sender "
                f"{t['host_send_s'] * 1e6:.0f} us and the receiver {t['host_recv_s'] * 1e6:.0f} us"
                if t["host_send_s"] or t["host_recv_s"]
                else ""
            )
        )
    typer.echo(
        f"stalls: timed calls average {run.profile.stall_overhead:.1%} above their median "
        "(operator latencies from this profile are scaled by that)"
    )
    if run.orchestration is not None:
        typer.echo(run.orchestration.describe())
    if run.idle is not None:
        typer.echo(run.idle.describe())
    if doc["fit"]:
        f = doc["fit"]
        typer.echo(
            f"roofline fit: memory efficiency {f['memory_efficiency']:.3f}, compute efficiency "
            f"{f['compute_efficiency']:.3f}, {f['kernel_overhead_s'] * 1e6:.1f} us per kernel; "
            f"median error x{f['median_error_factor']:.2f}, p90 x{f['p90_error_factor']:.2f}"
        )


def _import(
    model: str,
    gpu: str,
    engine: str,
    engine_version: str | None,
    database: Path | None,
    quant: str | None,
    kv_cache_dtype: str,
    tp: str | None,
    batches: str | None,
    contexts: str | None,
    output: Path,
    hardware: Path | None,
    json_out: bool,
) -> None:
    """``opweave profile --from aiconfigurator``: no torch, no device; the database's rows."""
    from opweave.profiler import BATCHES_IMPORTED, import_profile, save_profile

    output_file(output, "-o")
    spec = load_spec(model, quant, kv_cache_dtype)
    hw = catalog(hardware).get(gpu)
    grid_b = parse_list(batches, int, "--batches") if batches else list(BATCHES_IMPORTED)
    if min(grid_b) < 1 or max(grid_b) > MAX_BATCH:
        raise typer.BadParameter(f"--batches takes batch sizes from 1 to {MAX_BATCH}")
    grid_s = parse_list(contexts, int, "--contexts") if contexts else None
    for s in grid_s or []:
        check_context(spec, s, "--contexts:")
    run = import_profile(
        spec,
        hw.id,
        engine=engine,
        engine_version=engine_version,
        tp=parse_list(tp, int, "--tp") if tp else None,
        batches=sorted(set(grid_b)),
        contexts=sorted(set(grid_s)) if grid_s else None,
        database=database,
        hardware=hw,
    )
    path = save_profile(run.profile, output)
    doc = {
        "path": str(path),
        "model": run.profile.model,
        "device": {"id": hw.id, "name": hw.name},
        "source": "aiconfigurator",
        "database": run.database,
        "system": run.system,
        "engine": run.engine,
        "table_versions": run.versions,
        "tables": len(run.profile.ops),
        "cells": dict(run.cells),
        "operators": [{"op": t.op, "tp": t.tp, "source": t.source} for t in run.profile.ops],
        "collectives": [
            {"kind": c.kind, "gpus": c.gpus, "source": c.source} for c in run.profile.collectives
        ],
    }
    if json_out:
        emit_json(doc)
        return
    typer.echo(f"wrote {path}: {run.describe()}")
    for t in run.profile.ops:
        if (t.source or "").startswith("roofline") and t.tp == min(x.tp for x in run.profile.ops):
            typer.echo(f"  roofline: {t.op} -- {t.source}")
