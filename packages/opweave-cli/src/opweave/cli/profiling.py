"""``opweave profile``: measure the runtime's operators and transport into a profile file.

Registered only when ``opweave.profiler`` is installed; torch is imported by the profiler once
the flags are checked (:func:`._profile.execute`), so ``opweave --help`` stays fast.
"""

from __future__ import annotations

import typer

from ._options import (
    BatchesOpt,
    DatabaseOpt,
    DtypeOpt,
    EngineVersionOpt,
    GridContextsOpt,
    HardwareOpt,
    ImportEngineOpt,
    JsonOpt,
    KvCacheOpt,
    NoIdleOpt,
    NoOrchestrationOpt,
    NoTransferOpt,
    OpsOpt,
    PassesOpt,
    ProfileDecodeStepOpt,
    ProfileDeviceOpt,
    ProfileKernelsOpt,
    ProfileModelOpt,
    ProfileOutputOpt,
    ProfileTpOpt,
    QuantOpt,
    QuietOpt,
    RandomWeightsOpt,
    RepeatsOpt,
    SeedOpt,
    SourceOpt,
    ThreadsOpt,
    TimingOpt,
    UsdPerHourOpt,
    WarmupOpt,
    WorkingSetOpt,
)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile)


def profile(
    model: ProfileModelOpt,
    output: ProfileOutputOpt,
    device: ProfileDeviceOpt = "cpu",
    source: SourceOpt = None,
    engine: ImportEngineOpt = "vllm",
    engine_version: EngineVersionOpt = None,
    database: DatabaseOpt = None,
    quant: QuantOpt = None,
    kv_cache_dtype: KvCacheOpt = "auto",
    tp: ProfileTpOpt = None,
    batches: BatchesOpt = None,
    contexts: GridContextsOpt = None,
    dtype: DtypeOpt = None,
    ops: OpsOpt = None,
    warmup: WarmupOpt = 2,
    repeats: RepeatsOpt = 5,
    passes: PassesOpt = None,
    timing_mode: TimingOpt = None,
    working_set_mib: WorkingSetOpt = None,
    threads: ThreadsOpt = None,
    usd_per_hour: UsdPerHourOpt = None,
    random_weights: RandomWeightsOpt = False,
    kernels: ProfileKernelsOpt = "opweave",
    decode_step: ProfileDecodeStepOpt = "per-request",
    no_transfer: NoTransferOpt = False,
    no_orchestration: NoOrchestrationOpt = False,
    no_idle: NoIdleOpt = False,
    hardware: HardwareOpt = None,
    seed: SeedOpt = 0,
    quiet: QuietOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Time the runtime's own operators of MODEL (one partition block, plus embed and head)
    over batch and context grids, and point-to-point transfers, into a profile file."""
    flags = dict(locals())  # the options, as typer converted them
    from ._profile import ProfileFlags, execute

    execute(ProfileFlags.of(flags))
