"""``opweave estimate`` and ``opweave analyze``: the analytical cost model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ._common import (
    MAX_GROUP,
    PLOT_SUFFIXES,
    catalog,
    check_context,
    emit_json,
    human_bytes,
    load_spec,
    output_file,
    parse_list,
    parse_size,
    workload_from_flags,
)
from ._console import print_table
from ._options import (
    DEFAULT_CONTEXTS,
    AnalyzePlotOpt,
    AnalyzeTpOpt,
    ConcurrencyOpt,
    ContextOpt,
    ContextsOpt,
    DenseDpOpt,
    DpOpt,
    EngineOpt,
    EpOpt,
    ExpertImbalanceOpt,
    GpuOpt,
    GpusOpt,
    HardwareOpt,
    HostOpt,
    IslOpt,
    JsonOpt,
    KvCacheOpt,
    MaxBatchedTokensOpt,
    MaxSeqsOpt,
    MemoryFractionOpt,
    ModelArg,
    OslOpt,
    ProfileFileOpt,
    QuantOpt,
    RateOpt,
    RecvIntervalOpt,
    SchedulingOpt,
    StepBatchOpt,
    TpOpt,
    WorkloadFileOpt,
)


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
    app.command("analyze")(analyze)


def estimate(
    model: ModelArg,
    gpu: GpuOpt,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    dp: DpOpt = 1,
    dense_dp: DenseDpOpt = False,
    batch: StepBatchOpt = None,
    context: ContextOpt = None,
    json_out: JsonOpt = False,
    hardware: HardwareOpt = None,
    host: HostOpt = None,
    quant: QuantOpt = None,
    kv_cache_dtype: KvCacheOpt = "auto",
    expert_imbalance: ExpertImbalanceOpt = None,
    profile_path: ProfileFileOpt = None,
    isl: IslOpt = None,
    osl: OslOpt = None,
    concurrency: ConcurrencyOpt = None,
    rate: RateOpt = None,
    workload_file: WorkloadFileOpt = None,
    engine: EngineOpt = None,
    scheduling: SchedulingOpt = None,
    scheduler_recv_interval: RecvIntervalOpt = None,
    memory_fraction: MemoryFractionOpt = None,
    max_num_batched_tokens: MaxBatchedTokensOpt = None,
    max_num_seqs: MaxSeqsOpt = None,
) -> None:
    """Colocated decode step (--batch --context): where its latency goes, memory per GPU and
    whether it fits; or aggregated serving (--isl --osl --concurrency | --rate): TTFT, TPOT
    and tokens/s of one engine that prefills and decodes (vLLM's chunked prefill)."""
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
        "--max-num-batched-tokens": max_num_batched_tokens,
        "--max-num-seqs": max_num_seqs,
    }
    layout = (tp, ep, dp, dense_dp)
    precision = (quant, kv_cache_dtype)
    if any(value is not None for value in serving.values()):
        _refuse_step_flags(serving, batch, context, expert_imbalance, profile_path)
        _estimate_serving(model, gpu, layout, json_out, hardware, host, precision, serving)
        return
    step = (1 if batch is None else batch, context, expert_imbalance, profile_path)
    _estimate_step(model, gpu, layout, step, json_out, hardware, host, precision)


def _refuse_step_flags(
    serving: dict[str, Any],
    batch: int | None,
    context: str | None,
    expert_imbalance: float | None,
    profile_path: Path | None,
) -> None:
    """A decode step's flags given with serving's: say which of both were given."""
    given = [flag for flag, value in serving.items() if value is not None]
    step_flags = [f for f, v in (("--batch", batch), ("--context", context)) if v is not None]
    if step_flags:
        raise typer.BadParameter(
            f"{' and '.join(step_flags)} (a decode step) cannot be combined with "
            f"{' and '.join(given)} (serving); give one or the other"
        )
    for flag, value in (("--expert-imbalance", expert_imbalance), ("--profile", profile_path)):
        if value is not None:
            raise typer.BadParameter(
                f"{flag} applies to a decode step (--batch --context), not serving"
            )


def _check_layout(tp: int, ep: int, dp: int) -> None:
    # the GPU's NVLink domain and the model's shapes bound --tp further (parallelism_problem)
    for flag, value in (("--tp", tp), ("--ep", ep), ("--dp", dp)):
        if not 1 <= value <= MAX_GROUP:
            raise typer.BadParameter(f"{flag} must be from 1 to {MAX_GROUP}, got {value}")


def _estimate_step(
    model: str,
    gpu: str,
    layout: tuple[int, int, int, bool],
    step: tuple[int, str | None, float | None, Path | None],
    json_out: bool,
    hardware: Path | None,
    host: str | None,
    precision: tuple[str | None, str],
) -> None:
    """One colocated decode step: its latency by term, memory per GPU, whether it fits."""
    from opweave.costmodel import estimate_step, host_profile

    tp, ep, dp, dense_dp = layout
    batch, context, expert_imbalance, profile_path = step
    _check_layout(tp, ep, dp)
    if expert_imbalance is not None and expert_imbalance < 1:
        raise typer.BadParameter(
            f"--expert-imbalance is a busiest-over-mean ratio of at least 1, got {expert_imbalance}"
        )
    tokens = None if context is None else parse_size(context, "--context")
    from .planning import load_profiles

    profiles = load_profiles([profile_path] if profile_path else None)
    spec = load_spec(model, *precision, profiles)
    if tokens is None:
        tokens = min(4096, spec.max_context_tokens)
    check_context(spec, tokens, "--context")
    cat = catalog(hardware)
    latency = None
    if profile_path is None:
        hw = cat.get(gpu)
    else:
        latency = _profiled(profile_path, profiles[0], spec, cat, gpu, tp, host)
        hw = latency.hardware
    profile = None if host is None else host_profile(host)
    _check_tp(spec, hw, tp, ep)
    _check_parallelism(spec, hw, tp, ep, dp, expert_imbalance, dense_dp)
    est = estimate_step(
        spec,
        hw,
        tp=tp,
        ep=ep,
        dp=dp,
        batch=batch,
        context=tokens,
        host=profile,
        latency=latency,
        expert_skew=expert_imbalance,
        dense_dp=dense_dp,
    )
    if json_out:
        doc = est.model_dump() | _model_notes(spec)
        if latency is not None:
            prov = latency.profile.provenance
            doc["profile"] = {"source": prov.source, "date": prov.date, "note": prov.note}
        emit_json(doc)
        return
    _print_step(est, spec, hw, layout, batch)
    if latency is not None:
        typer.echo(f"latencies: {profile_path}, {latency.profile.describe()}")


# The estimate's terms (`breakdown_s` keys in --json) in words; terms that are zero are not shown.
TERM_WORDS = {
    "attention": "attention (KV cache reads)",
    "gemm": "GEMMs (weight reads or FLOPs)",
    "small": "norms, RoPE, embedding, sampling",
    "communication": "tensor-parallel collectives",
    "kernel_launch": "kernel launches",
    "moe_experts": "fused-MoE fixed cost",
    "step_overhead": "engine host work per step",
    "allreduce_latency": "collectives' latency floor",
    "alltoall_latency": "expert all-to-all latency floor",
    "alltoall": "expert all-to-all (dispatch, combine)",
}


def _model_notes(spec: Any) -> dict[str, list[str]]:
    """``--json``'s words on the model beyond its figures: encoders a multimodal checkpoint's
    figures leave out, sizes its config left to transformers' defaults."""
    return {
        "encoders_not_costed": list(spec.encoders_not_costed),
        "config_defaults": list(spec.config_defaults),
    }


def _replica_words(spec: Any, hw: Any, layout: tuple[int, int, int, bool]) -> str:
    """``qwen3-32b on 4 x h100-sxm (TP4)``: the model, the GPUs and their layout in words."""
    from opweave.costmodel import Parallelism

    tp, ep, dp, dense_dp = layout
    par = Parallelism(tp=tp, ep=ep, dp=dp, dense_dp=dense_dp)
    return f"{spec.name} on {par.gpus} x {hw.id} ({par.describe(spec.arch.moe is not None)})"


def _print_step(
    est: Any, spec: Any, hw: Any, layout: tuple[int, int, int, bool], batch: int
) -> None:
    tp, ep, dp, dense_dp = layout
    fits = "yes" if est.fits else "NO (exceeds usable memory)"
    typer.echo(f"{_replica_words(spec, hw, layout)}, batch {batch}, context {est.context_tokens}")
    print_table(
        [[TERM_WORDS.get(k, k), f"{v * 1e3:.3f}"] for k, v in est.breakdown_s.items() if v > 0]
        + [["decode step", f"{est.step_latency_s * 1e3:.3f}"]],
        ["where the step's time goes", "ms"],
    )
    typer.echo(
        f"memory per GPU: {human_bytes(est.memory_bytes_per_gpu)} of "
        f"{human_bytes(est.memory_capacity_bytes)} usable "
        f"({human_bytes(est.weight_bytes_per_gpu)} of weights); fits: {fits}"
    )
    typer.echo(f"precision: {spec.precision.describe()}; GEMMs: {est.gemm_path}")
    for note in spec.notes:
        typer.echo(note)
    _echo_engine_split(spec, tp, ep, dp, dense_dp)
    if est.expert_imbalance is not None:
        typer.echo(
            f"busiest expert GPU: {est.expert_imbalance:.2f}x the mean load "
            f"({est.expert_imbalance_basis})"
        )
    typer.echo(
        f"throughput: {est.tokens_per_s:,.0f} tokens/s"
        + (
            ""
            if est.usd_per_million_tokens is None
            else f"; cost: ${est.usd_per_million_tokens:.4g} per million tokens"
        )
    )


def _profiled(
    path: Path, prof: Any, spec: Any, cat: Any, gpu: str, tp: int, host: str | None
) -> Any:
    """The ``--profile`` file (``prof``, read from ``path``) as a latency model of ``--gpu`` (a
    catalog GPU, or the device the profile measured, e.g. ``cpu``, as ``plan --gpus`` takes it)
    for ``spec`` at ``tp``."""
    from opweave.costmodel import ConfigError, ProfiledLatency
    from opweave.costmodel.errors import UnknownGPUError
    from opweave.planner import profile_device_id

    if host is not None:
        raise typer.BadParameter("--host applies to the roofline, not to a --profile")
    device = profile_device_id(prof, cat)
    try:
        wanted = cat.resolve(gpu)
    except UnknownGPUError:
        if gpu.strip().lower() != device:
            raise
        wanted = device
    if device != wanted:
        raise ConfigError(f"profile {path} is of {prof.device.id}, not --gpu {wanted}")
    hw = cat.get(device) if device in cat.ids else prof.device
    problem = prof.config_problem(spec)
    if problem is not None:
        raise ConfigError(f"profile {path} {problem}")
    if not any(t.tp == tp for t in prof.ops):
        have = sorted({t.tp for t in prof.ops})
        raise ConfigError(f"profile {path} has no tables at --tp {tp}; it has tp {have}")
    if hw.usd_per_hour is not None and prof.device.usd_per_hour is None:
        prof = prof.model_copy(
            update={"device": prof.device.model_copy(update={"usd_per_hour": hw.usd_per_hour})}
        )
    return ProfiledLatency(prof)


def _estimate_serving(
    model: str,
    gpu: str,
    layout: tuple[int, int, int, bool],
    json_out: bool,
    hardware: Path | None,
    host: str | None,
    precision: tuple[str | None, str],
    flags: dict[str, Any],
) -> None:
    """Aggregated serving of the workload ``flags`` describe: TTFT, TPOT, tokens/s."""
    from opweave.costmodel import estimate_serving, host_profile

    tp, ep, dp, dense_dp = layout
    _check_layout(tp, ep, dp)
    spec = load_spec(model, *precision)
    workload = workload_from_flags(
        spec,
        flags["--isl"],
        flags["--osl"],
        flags["--concurrency"],
        flags["--rate"],
        max_num_batched_tokens=flags["--max-num-batched-tokens"],
        max_num_seqs=flags["--max-num-seqs"],
        workload_file=flags["--workload"],
        scheduling=flags["--scheduling"],
        scheduler_recv_interval=flags["--scheduler-recv-interval"],
        engine=flags["--engine"],
        memory_fraction=flags["--memory-fraction"],
    )
    hw = catalog(hardware).get(gpu)
    _check_tp(spec, hw, tp, ep)
    _check_parallelism(spec, hw, tp, ep, dp, None, dense_dp)
    profile = None if host is None else host_profile(host)
    est = estimate_serving(
        spec, hw, tp=tp, ep=ep, dp=dp, dense_dp=dense_dp, workload=workload, host=profile
    )
    if json_out:
        emit_json(est.model_dump() | _model_notes(spec))
        return
    typer.echo(
        f"{_replica_words(spec, hw, (tp, ep, dp, dense_dp))}, "
        f"aggregated serving ({workload.engine_name})"
    )
    print_table(
        [
            [
                "TTFT",
                f"{est.ttft_s * 1e3:,.1f} ms",
                f"{est.ttft_p50_s * 1e3:,.1f} ms",
                f"{est.ttft_p90_s * 1e3:,.1f} ms",
                f"{est.ttft_p99_s * 1e3:,.1f} ms",
            ],
            [
                "TPOT",
                f"{est.tpot_s * 1e3:,.2f} ms",
                f"{est.tpot_p50_s * 1e3:,.2f} ms",
                f"{est.tpot_p90_s * 1e3:,.2f} ms",
                f"{est.tpot_p99_s * 1e3:,.2f} ms",
            ],
        ],
        ["", "mean", "median", "p90", "p99"],
    )
    typer.echo(
        f"throughput: {est.tokens_per_s:,.0f} output tokens/s ({est.requests_per_s:,.2f} "
        f"requests/s); mean decode batch {est.decode_batch:.1f} (a decode step alone: "
        f"{est.decode_step_s * 1e3:.2f} ms)"
        + (
            ""
            if est.usd_per_million_tokens is None
            else f"; cost: ${est.usd_per_million_tokens:.4g} per million output tokens"
        )
    )
    if est.saturated:
        typer.echo("overloaded: the engine serves less than the offered rate; TTFT keeps growing")
    typer.echo(f"statistic: {est.statistic}")
    for line in est.assumptions:
        typer.echo(f"assumed: {line}")
    _echo_engine_split(spec, tp, ep, dp, dense_dp)


def analyze(
    model: ModelArg,
    gpus: GpusOpt,
    contexts: ContextsOpt = DEFAULT_CONTEXTS,
    tp: AnalyzeTpOpt = None,
    plot: AnalyzePlotOpt = None,
    json_out: JsonOpt = False,
    hardware: HardwareOpt = None,
    quant: QuantOpt = None,
    kv_cache_dtype: KvCacheOpt = "auto",
) -> None:
    """The paper's §3 quantities: colocated vs homogeneous vs heterogeneous cost per token."""
    from opweave.costmodel import TP_DEGREES
    from opweave.costmodel import analyze as run_analysis

    if tp is not None and tp not in TP_DEGREES:
        raise typer.BadParameter(f"--tp must be one of {', '.join(map(str, TP_DEGREES))}")
    points = [parse_size(c, "--contexts") for c in parse_list(contexts, what="--contexts")]
    if len(set(points)) < len(points):
        raise typer.BadParameter(f"--contexts {contexts!r} names a context more than once")
    output_file(plot, "--plot", PLOT_SUFFIXES)
    spec = load_spec(model, quant, kv_cache_dtype)
    if contexts == DEFAULT_CONTEXTS:  # the default grid stops at the model's context
        points = [s for s in points if s <= spec.max_context_tokens] or [spec.max_context_tokens]
    for s in points:
        check_context(spec, s, "--contexts:")
    cat = catalog(hardware)
    names = parse_list(gpus, what="--gpus")
    if len(names) > 2:
        raise typer.BadParameter("--gpus takes one or two GPU ids")
    devices = [cat.get(n) for n in names]
    if tp is not None:
        for hw in devices:
            _check_tp(spec, hw, tp)
    result = run_analysis(spec, devices, points, tp=tp)
    if plot is not None:
        from ._plots import plot_analysis

        plot_analysis(result, plot)
    precision = spec.precision
    if json_out:
        emit_json(
            result.to_json()
            | {"quant": precision.quant, "kv_cache_dtype": precision.kv_cache_dtype}
            | _model_notes(spec)
        )
        return
    typer.echo(result.summary())
    typer.echo(f"precision: {precision.describe()}")
    for note in spec.notes:
        typer.echo(note)
    if plot is not None:
        typer.echo(f"plot written to {plot}")


def _check_parallelism(
    spec: Any,
    hw: Any,
    tp: int,
    ep: int,
    dp: int,
    imbalance: float | None,
    dense_dp: bool = False,
) -> None:
    """That the model's operators split as ``(tp, ep, dp)`` asks on ``hw`` (one-line errors)."""
    from opweave.costmodel import (
        ConfigError,
        Parallelism,
        max_expert_load_imbalance,
        parallelism_problem,
    )

    if dense_dp and dp == 1:
        raise ConfigError("--dense-dp applies to data-parallel attention; give --dp above 1")
    if ep != 1 or dp != 1:
        par = Parallelism(tp=tp, ep=ep, dp=dp, dense_dp=dense_dp)
        problem = parallelism_problem(spec, par, hw, engine_splits=True)
        if problem is not None:
            flags = f"--tp {tp} --ep {ep} --dp {dp}" + (" --dense-dp" if dense_dp else "")
            raise ConfigError(f"{flags}: {problem}")
    if imbalance is not None and ep == 1:
        raise ConfigError(
            "--expert-imbalance applies to expert parallelism; give --ep above 1 with it"
        )
    moe = spec.arch.moe
    if imbalance is not None and moe is not None:
        most = max_expert_load_imbalance(moe, ep)
        if imbalance > most:
            raise ConfigError(
                f"--expert-imbalance {imbalance:g} is more than a busiest expert GPU can carry "
                f"with --ep {ep}: at most {most:g} times the mean, when it holds as many of "
                f"each token's {moe.top_k} experts as it can"
            )


def _echo_engine_split(spec: Any, tp: int, ep: int, dp: int, dense_dp: bool) -> None:
    """Say so where the estimate costs a split engines run and OpWeave's runtime does not
    (MXFP4 experts in uneven whole scale blocks: ``tp_problem(..., engine_splits=True)``)."""
    from opweave.costmodel import Parallelism, parallelism_problem

    problem = parallelism_problem(spec, Parallelism(tp=tp, ep=ep, dp=dp, dense_dp=dense_dp))
    if problem is not None:
        typer.echo(
            f"sharding: {problem}; costed as vLLM and SGLang load it (whole blocks, the busiest "
            "rank's share); OpWeave's runtime does not serve this split, so plans leave it out"
        )


def _check_tp(spec: Any, hw: Any, tp: int, ep: int = 1) -> None:
    """That ``spec`` splits over ``tp`` GPUs of ``hw`` within one NVLink domain (a node, or a
    rack-scale domain such as GB200 NVL72's). Under expert parallelism (``ep`` above 1) the
    routed experts are not split by ``tp`` but over the GPUs of each expert, which
    ``_check_parallelism`` checks."""
    from opweave.costmodel import ConfigError, tp_problem

    ops = None if ep == 1 else [op for op in spec.operators if op.moe is None]
    problem = tp_problem(spec, tp, ops, engine_splits=True)
    if problem is not None:
        raise ConfigError(f"--tp {tp}: {problem}; choose a degree the model splits over")
    if tp > hw.scale_up_gpus:
        raise ConfigError(
            f"--tp {tp}: {hw.id} has {hw.scale_up_gpus} GPUs per NVLink domain and a TP group "
            "stays within one; choose a smaller --tp"
        )
