"""``opweave estimate`` and ``opweave analyze``: the analytical cost model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import (
    MAX_BATCH,
    MAX_GROUP,
    PLOT_SUFFIXES,
    ConcurrencyOpt,
    EngineOpt,
    HardwareOpt,
    IslOpt,
    JsonOpt,
    KvCacheOpt,
    MemoryFractionOpt,
    ModelArg,
    OslOpt,
    QuantOpt,
    RateOpt,
    RecvIntervalOpt,
    SchedulingOpt,
    WorkloadFileOpt,
    catalog,
    check_context,
    emit_json,
    finite,
    human_bytes,
    load_spec,
    output_file,
    parse_list,
    parse_size,
    table,
    workload_from_flags,
)

DEFAULT_CONTEXTS = "1K,2K,4K,8K,16K,32K,64K,128K"


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
    app.command("analyze")(analyze)


def estimate(
    model: ModelArg,
    gpu: Annotated[str, typer.Option("--gpu", help="GPU id, e.g. h100.")],
    tp: Annotated[
        int, typer.Option("--tp", help="Tensor-parallel degree of each DP rank (1, 2, 4, 8).")
    ] = 1,
    ep: Annotated[
        int,
        typer.Option(
            "--ep",
            help="Expert-parallel degree: GPU sets the routed experts are sharded over; divides "
            "tp x dp (tp x dp: one set per GPU, tokens dispatched by all-to-all; 1: experts "
            "tensor-parallel over all tp x dp GPUs). MoE models only.",
        ),
    ] = 1,
    dp: Annotated[
        int,
        typer.Option(
            "--dp",
            help="Data-parallel attention ranks: the replica spans tp x dp GPUs; each rank of "
            "tp GPUs runs attention (with its own KV cache) on its share of --batch.",
        ),
    ] = 1,
    dense_dp: Annotated[
        bool,
        typer.Option(
            "--dense-dp",
            help="With --dp above 1: dense FFN layers whole on every GPU, each computing its "
            "own tokens (SGLang's --moe-dense-tp-size 1, TensorRT-LLM under attention DP), not "
            "split over the replica.",
        ),
    ] = False,
    batch: Annotated[
        int | None,
        typer.Option(
            "--batch",
            min=1,
            max=MAX_BATCH,
            help="Requests per step of the replica, split over its DP ranks (ceil(B/dp) each); "
            "default 1. A single decode step (not with --isl/--osl).",
        ),
    ] = None,
    context: Annotated[
        str | None,
        typer.Option(
            "--context",
            help="Context tokens, e.g. 8192 or 8K (default: 4096, or the model's context if "
            "shorter).",
        ),
    ] = None,
    json_out: JsonOpt = False,
    hardware: HardwareOpt = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            help="Serving engine whose host time to charge (overlapped, sglang, sglang-sync, "
            "tensorrt-llm, vllm-0.6, vllm-0.4): per decode step, and for sglang and "
            "tensorrt-llm steps with prompt chunks run eagerly (at least their kernel launches' "
            "host time); default: the --engine's in serving, else the GPU's step_overhead_s "
            "(an overlapped engine).",
        ),
    ] = None,
    quant: QuantOpt = None,
    kv_cache_dtype: KvCacheOpt = "auto",
    expert_imbalance: Annotated[
        float | None,
        typer.Option(
            "--expert-imbalance",
            callback=finite,
            help="Measured busiest-over-mean expected load of the expert GPUs (>= 1; e.g. "
            "1.3-4.0 without a load balancer); default: balanced (EPLB), an assumption the "
            "output states.",
        ),
    ] = None,
    profile_path: Annotated[
        Path | None,
        typer.Option(
            "--profile",
            help="A profile of this model on --gpu (measured, or imported with opweave profile "
            "--from aiconfigurator): its operator latencies replace the roofline's.",
        ),
    ] = None,
    isl: IslOpt = None,
    osl: OslOpt = None,
    concurrency: ConcurrencyOpt = None,
    rate: RateOpt = None,
    workload_file: WorkloadFileOpt = None,
    engine: EngineOpt = None,
    scheduling: SchedulingOpt = None,
    scheduler_recv_interval: RecvIntervalOpt = None,
    memory_fraction: MemoryFractionOpt = None,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-num-batched-tokens",
            min=1,
            max=1 << 20,
            help="Serving: token budget of one engine step (default: the --engine's for the GPU).",
        ),
    ] = None,
    max_num_seqs: Annotated[
        int | None,
        typer.Option(
            "--max-num-seqs",
            min=1,
            max=1 << 16,
            help="Serving: requests one engine runs at once (default: the --engine's for the GPU).",
        ),
    ] = None,
) -> None:
    """Colocated decode step (--batch --context): where its latency goes, memory per GPU and
    whether it fits; or aggregated serving (--isl --osl --concurrency | --rate): TTFT, TPOT
    and tokens/s of one engine that prefills and decodes (vLLM's chunked prefill)."""
    from opweave.costmodel import TP_DEGREES, estimate_step, host_profile

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
    given = [flag for flag, value in serving.items() if value is not None]
    if given:
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
        _estimate_serving(
            model,
            gpu,
            (tp, ep, dp, dense_dp),
            json_out,
            hardware,
            host,
            quant,
            kv_cache_dtype,
            serving,
        )
        return
    batch = 1 if batch is None else batch

    if tp not in TP_DEGREES:
        raise typer.BadParameter(f"--tp must be one of {', '.join(map(str, TP_DEGREES))}")
    for flag, value in (("--ep", ep), ("--dp", dp)):
        if not 1 <= value <= MAX_GROUP:
            raise typer.BadParameter(f"{flag} must be from 1 to {MAX_GROUP}, got {value}")
    if expert_imbalance is not None and expert_imbalance < 1:
        raise typer.BadParameter(
            f"--expert-imbalance is a busiest-over-mean ratio of at least 1, got {expert_imbalance}"
        )
    tokens = None if context is None else parse_size(context)
    spec = load_spec(model, quant, kv_cache_dtype)
    if tokens is None:
        tokens = min(4096, spec.max_context_tokens)
    check_context(spec, tokens, "--context")
    hw = catalog(hardware).get(gpu)
    profile = None if host is None else host_profile(host)
    _check_tp(spec, hw, tp, ep)
    _check_parallelism(spec, hw, tp, ep, dp, expert_imbalance, dense_dp)
    latency = None
    if profile_path is not None:
        latency = _profiled(profile_path, spec, hw, tp, host)
        hw = latency.hardware
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
        doc = est.model_dump()
        if latency is not None:
            prov = latency.profile.provenance
            doc["profile"] = {"source": prov.source, "date": prov.date, "note": prov.note}
        emit_json(doc)
        return
    fits = "yes" if est.fits else "NO (exceeds usable memory)"
    layout = ""
    if ep != 1 or dp != 1:
        experts = "tensor-parallel over all" if ep == 1 else f"over EP{ep}"
        layout = f" ({dp} DP rank{'s' if dp > 1 else ''} of TP{tp}, experts {experts})"
    typer.echo(
        f"{spec.name} on {tp * dp} x {hw.id}{layout}, batch {batch}, context {est.context_tokens}"
    )
    typer.echo(
        table(
            [[k, f"{v * 1e3:.3f}"] for k, v in est.breakdown_s.items()]
            + [["step", f"{est.step_latency_s * 1e3:.3f}"]],
            ["term", "latency ms"],
        )
    )
    typer.echo(
        f"memory per GPU: {human_bytes(est.memory_bytes_per_gpu)} of "
        f"{human_bytes(est.memory_capacity_bytes)} usable "
        f"({human_bytes(est.weight_bytes_per_gpu)} of weights); fits: {fits}"
    )
    typer.echo(f"precision: {spec.precision.describe()}; GEMMs: {est.gemm_path}")
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
            else f"; cost: ${est.usd_per_million_tokens:.3f} per million tokens"
        )
    )


def _profiled(path: Path, spec: Any, hw: Any, tp: int, host: str | None) -> Any:
    """The ``--profile`` file as a latency model of ``hw`` for ``spec`` at ``tp``."""
    from opweave.costmodel import ConfigError, ProfiledLatency, default_catalog
    from opweave.costmodel.errors import UnknownGPUError

    from .planning import load_profiles

    if host is not None:
        raise typer.BadParameter("--host applies to the roofline, not to a --profile")
    (prof,) = load_profiles([path])
    try:
        device = default_catalog().resolve(prof.device.id)
    except UnknownGPUError:
        device = prof.device.id
    if device != hw.id:
        raise ConfigError(f"profile {path} is of {prof.device.id}, not --gpu {hw.id}")
    if prof.config_sha256 != spec.config_sha256:
        raise ConfigError(
            f"profile {path} was made for model {prof.model!r}, not {spec.name!r}; profile this "
            "model with opweave profile --model"
        )
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
    quant: str | None,
    kv_cache_dtype: str,
    flags: dict[str, Any],
) -> None:
    from opweave.costmodel import TP_DEGREES, estimate_serving, host_profile

    tp, ep, dp, dense_dp = layout
    if tp not in TP_DEGREES:
        raise typer.BadParameter(f"--tp must be one of {', '.join(map(str, TP_DEGREES))}")
    for flag, value in (("--ep", ep), ("--dp", dp)):
        if not 1 <= value <= MAX_GROUP:
            raise typer.BadParameter(f"{flag} must be from 1 to {MAX_GROUP}, got {value}")
    spec = load_spec(model, quant, kv_cache_dtype)
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
        emit_json(est.model_dump())
        return
    where = "" if ep == 1 and dp == 1 else f" (tp {tp}, ep {ep}, dp {dp})"
    where = where.replace(")", ", dense FFN data-parallel)") if dense_dp else where
    typer.echo(
        f"{spec.name} on {est.gpus} x {hw.id}{where}, aggregated serving ({workload.engine_name})"
    )
    typer.echo(
        table(
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
    )
    typer.echo(
        f"throughput: {est.tokens_per_s:,.0f} output tokens/s ({est.requests_per_s:,.2f} "
        f"requests/s); mean decode batch {est.decode_batch:.1f} (a decode step alone: "
        f"{est.decode_step_s * 1e3:.2f} ms)"
        + (
            ""
            if est.usd_per_million_tokens is None
            else f"; cost: ${est.usd_per_million_tokens:.3f} per million output tokens"
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
    gpus: Annotated[str, typer.Option("--gpus", help="One GPU id, or two: G1,G2.")],
    contexts: Annotated[
        str, typer.Option("--contexts", help="Comma-separated context lengths.")
    ] = DEFAULT_CONTEXTS,
    tp: Annotated[
        int | None,
        typer.Option("--tp", help="TP degree of the analysed unit (default: smallest that fits)."),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG of cost and gain against context.")
    ] = None,
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
    points = [parse_size(c) for c in parse_list(contexts, what="--contexts")]
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
        )
        return
    typer.echo(result.summary())
    typer.echo(f"precision: {precision.describe()}")
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
    from opweave.costmodel import ConfigError, Parallelism, parallelism_problem

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
