"""What ``opweave profile`` does once its flags are parsed: check them, then measure the
runtime's operators (:func:`opweave.profiler.profile_model`) or import them from NVIDIA's
silicon database (:func:`opweave.profiler.import_profile`), save the profile and report it.

Torch is imported by the profiler only, after every flag has been checked.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from ._common import (
    catalog,
    check_context,
    emit_json,
    load_spec,
    output_file,
    parse_list,
)
from ._options import DECODE_STEPS, KERNELS, MAX_BATCH


@dataclass(frozen=True)
class ProfileFlags:
    """``opweave profile``'s options, as parsed."""

    model: str
    output: Path
    device: str = "cpu"
    source: str | None = None
    engine: str = "vllm"
    engine_version: str | None = None
    database: Path | None = None
    quant: str | None = None
    kv_cache_dtype: str = "auto"
    tp: str | None = None
    batches: str | None = None
    contexts: str | None = None
    dtype: str | None = None
    ops: str | None = None
    warmup: int = 2
    repeats: int = 5
    passes: int | None = None
    timing_mode: str | None = None
    working_set_mib: float | None = None
    threads: int | None = None
    usd_per_hour: float | None = None
    random_weights: bool = False
    kernels: str = "opweave"
    decode_step: str = "per-request"
    no_transfer: bool = False
    no_orchestration: bool = False
    no_idle: bool = False
    hardware: Path | None = None
    seed: int = 0
    quiet: bool = False
    json_out: bool = False

    @classmethod
    def of(cls, values: dict[str, Any]) -> ProfileFlags:
        """The flags among the command's ``values`` (its parameters)."""
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


# Options only one way of profiling reads, by field, with their option names: given to the
# other way, they would be silently ignored.
_MEASURE_ONLY = {
    "dtype": "--dtype",
    "ops": "--ops",
    "warmup": "--warmup",
    "repeats": "--repeats",
    "passes": "--passes",
    "timing_mode": "--timing",
    "working_set_mib": "--working-set-mib",
    "threads": "--threads",
    "usd_per_hour": "--usd-per-hour",
    "random_weights": "--random-weights",
    "kernels": "--kernels",
    "decode_step": "--decode-step",
    "no_transfer": "--no-transfer",
    "no_orchestration": "--no-orchestration",
    "no_idle": "--no-idle",
    "seed": "--seed",
}
_IMPORT_ONLY = {
    "engine": "--engine",
    "engine_version": "--engine-version",
    "database": "--database",
    "hardware": "--hardware",
}


def _given(flags: ProfileFlags, names: dict[str, str]) -> list[str]:
    """The options among ``names`` set to other than their defaults."""
    defaults = ProfileFlags(model="", output=Path())
    return [opt for f, opt in names.items() if getattr(flags, f) != getattr(defaults, f)]


def execute(flags: ProfileFlags) -> None:
    """Measure (or, with ``--from aiconfigurator``, import) the profile and report it."""
    if flags.source is not None:
        if flags.source != "aiconfigurator":
            raise typer.BadParameter(f"--from takes aiconfigurator, got {flags.source!r}")
        stray = _given(flags, _MEASURE_ONLY)
        if stray:
            raise typer.BadParameter(
                f"{' and '.join(stray)} set{'s' if len(stray) == 1 else ''} how a profile is "
                "measured; --from aiconfigurator imports measured latencies, so drop "
                f"{'it' if len(stray) == 1 else 'them'}"
            )
        _import(flags)
    else:
        stray = _given(flags, _IMPORT_ONLY)
        if stray:
            raise typer.BadParameter(
                f"{' and '.join(stray)} appl{'ies' if len(stray) == 1 else 'y'} to --from "
                "aiconfigurator; a measured profile times this machine's device"
            )
        _measure(flags)


def _measure(flags: ProfileFlags) -> None:
    from opweave.costmodel import load_model

    settings = _measure_settings(flags)
    output_file(flags.output, "-o")
    spec = load_model(flags.model)  # a bad config fails here, before torch loads
    for s in settings["contexts"] or []:
        check_context(spec, s, "--contexts:")

    from opweave.profiler import TimingSettings, profile_model, save_profile

    cuda = settings["device"].startswith("cuda")
    timing = TimingSettings(
        warmup=flags.warmup,
        repeats=flags.repeats,
        cell_budget_s=0.02 if cuda else 0.03,
        passes=flags.passes or (1 if cuda else 2),
    )
    working_set = flags.working_set_mib
    run = profile_model(
        flags.model,
        **settings,
        dtype=flags.dtype,
        timing=timing,
        timing_mode=flags.timing_mode,
        working_set_bytes=None if working_set is None else working_set * 2**20,
        threads=flags.threads,
        transfer=not flags.no_transfer,
        orchestration=not flags.no_orchestration,
        idle=not flags.no_idle,
        usd_per_hour=flags.usd_per_hour,
        random_weights=flags.random_weights,
        kernels=flags.kernels,
        decode_step=flags.decode_step,
        seed=flags.seed,
        progress=not flags.quiet,
    )
    path = save_profile(run.profile, flags.output)
    doc = _summary(run, path)
    if flags.json_out:
        emit_json(doc)
        return
    _print_measured(run, doc)


def _measure_settings(flags: ProfileFlags) -> dict[str, Any]:
    """The device, TP degrees, grids and operators to measure, checked (before torch loads)."""
    from opweave.costmodel import TP_DEGREES

    if flags.quant is not None or flags.kv_cache_dtype != "auto":
        raise typer.BadParameter(
            "--quant and --kv-cache-dtype apply to --from aiconfigurator; a measured profile "
            "times the checkpoint's own weights (--dtype sets the compute dtype)"
        )
    device = _device(flags.device)
    if flags.kernels not in KERNELS:
        raise typer.BadParameter(
            f"--kernels must be one of {', '.join(KERNELS)}, got {flags.kernels!r}"
        )
    if flags.decode_step not in DECODE_STEPS:
        raise typer.BadParameter(
            f"--decode-step must be one of {', '.join(DECODE_STEPS)}, got {flags.decode_step!r}"
        )
    tps = parse_list(flags.tp or "1", int, "--tp")
    if any(t not in TP_DEGREES for t in tps):
        raise typer.BadParameter(f"--tp takes degrees among {', '.join(map(str, TP_DEGREES))}")
    batches = parse_list(flags.batches, int, "--batches") if flags.batches else None
    if batches is not None and max(batches) > MAX_BATCH:  # the profiler refuses those below 1
        raise typer.BadParameter(f"--batches takes batch sizes up to {MAX_BATCH}")
    contexts = parse_list(flags.contexts, int, "--contexts") if flags.contexts else None
    ops = parse_list(flags.ops, what="--ops") if flags.ops else None
    return {"device": device, "tp": tps, "batches": batches, "contexts": contexts, "ops": ops}


def _device(value: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value.strip().lower()):
        raise typer.BadParameter(f"--device must be cpu or cuda (or cuda:N), got {value!r}")
    return value.strip().lower()


def _summary(run: Any, path: Path) -> dict[str, Any]:
    """The ``--json`` document of a measured profile."""
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


def _print_measured(run: Any, doc: dict[str, Any]) -> None:
    typer.echo(
        f"wrote {doc['path']}: {doc['tables']} operator tables of {doc['model']} "
        f"({doc['dtype']}) on {doc['device']['name']}, {doc['cells']} cells in "
        f"{doc['wall_s']:.1f} s"
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


def _import(flags: ProfileFlags) -> None:
    """``opweave profile --from aiconfigurator``: no torch, no device; the database's rows."""
    from opweave.profiler import BATCHES_IMPORTED, import_profile, save_profile

    output_file(flags.output, "-o")
    spec = load_spec(flags.model, flags.quant, flags.kv_cache_dtype)
    hw = catalog(flags.hardware).get(flags.device)
    batches = flags.batches
    grid_b = parse_list(batches, int, "--batches") if batches else list(BATCHES_IMPORTED)
    if min(grid_b) < 1 or max(grid_b) > MAX_BATCH:
        raise typer.BadParameter(f"--batches takes batch sizes from 1 to {MAX_BATCH}")
    grid_s = parse_list(flags.contexts, int, "--contexts") if flags.contexts else None
    for s in grid_s or []:
        check_context(spec, s, "--contexts:")
    run = import_profile(
        spec,
        hw.id,
        engine=flags.engine,
        engine_version=flags.engine_version,
        tp=parse_list(flags.tp, int, "--tp") if flags.tp else None,
        batches=sorted(set(grid_b)),
        contexts=sorted(set(grid_s)) if grid_s else None,
        database=flags.database,
        hardware=hw,
    )
    path = save_profile(run.profile, flags.output)
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
    if flags.json_out:
        emit_json(doc)
        return
    typer.echo(f"wrote {path}: {run.describe()}")
    for t in run.profile.ops:
        if (t.source or "").startswith("roofline") and t.tp == min(x.tp for x in run.profile.ops):
            typer.echo(f"  roofline: {t.op} -- {t.source}")
