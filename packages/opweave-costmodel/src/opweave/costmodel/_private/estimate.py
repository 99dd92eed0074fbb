"""Colocated decode step estimate: ``opweave estimate``."""

from __future__ import annotations

import math

from pydantic import Field

from ..errors import ConfigError
from .base import Frozen
from .expert_comm import expert_load_imbalance
from .hardware import HardwareSpec
from .host import HostProfile
from .model import ModelSpec, OpClass
from .parallelism import (
    BALANCED_BASIS,
    Parallelism,
    memory_bytes_per_gpu,
    parallel_op_terms_s,
    parallelism_problem,
    weight_bytes_per_gpu,
)
from .precision import check_runs
from .profile import LatencyModel
from .roofline import ProfiledLatency, RooflineLatency

# parallelism.parallel_op_terms_s name -> breakdown_s key
FIXED_TERMS = {
    "kernel_launch": "kernel_launch",
    "moe_experts": "moe_experts",
    "step": "step_overhead",
    "collective_latency": "allreduce_latency",
    "collective": "communication",
    "alltoall_latency": "alltoall_latency",
    "alltoall": "alltoall",
}


class StepEstimate(Frozen):
    """One colocated decode step of ``batch`` requests at context ``context_tokens``."""

    model: str
    gpu: str
    tp: int
    ep: int = 1
    dp: int = 1
    dense_dp: bool = Field(
        default=False,
        description="Dense FFN layers fully data-parallel (whole on every GPU, on its own "
        "tokens) instead of tensor-parallel over tp x dp.",
    )
    batch: int = Field(
        description="Requests of the replica (tp x dp GPUs), split over its DP ranks."
    )
    context_tokens: int
    step_latency_s: float
    breakdown_s: dict[str, float] = Field(
        description="Where the step's time goes: the roofline per op class (attention, gemm, "
        "small), TP communication (payload over bandwidth; with data-parallel ranks also the "
        "experts' gather and scatter), the expert-parallel all-to-all (alltoall: dispatch and "
        "combine payload; alltoall_latency: their floors), and the fixed costs: kernel_launch, "
        "allreduce_latency (the collectives' floor), moe_experts (fused-MoE start-up and "
        "per-expert cost) and step_overhead (the engine's host work per step: scheduling, "
        "sampling, host round trip; the host profile's when one is given). With a measured "
        "profile, kernel_launch and moe_experts are zero (its operator times contain them); the "
        "collectives stay the model's unless the profile holds measured all-reduce or "
        "all-gather tables (an imported profile's, in communication), and step_overhead stays "
        "the model's, as a measured profile times the sampling kernel, not the step around it."
    )
    memory_bytes_per_gpu: float = Field(
        description="Busiest GPU: weights, and the state and activations of its DP rank."
    )
    weight_bytes_per_gpu: float = Field(
        description="Resident weights per GPU, in their formats (scales and unquantised "
        "modules included): non-expert operators over tp, routed experts and dense FFN layers "
        "over tp x dp (dense FFN whole with dense_dp)."
    )
    memory_capacity_bytes: float = Field(description="Usable memory per GPU.")
    quant: str = Field(description="Weight format (precision.py; bf16: unquantised).")
    kv_cache_dtype: str = Field(description="Dtype the KV cache is held in.")
    gemm_path: str = Field(description="How the GPU runs the quantised GEMMs (tensor-core path).")
    fits: bool
    tokens_per_s: float
    usd_per_million_tokens: float | None
    expert_imbalance: float | None = Field(
        default=None,
        description="Routed-expert copies the busiest expert GPU receives over the mean "
        "(null without expert parallelism).",
    )
    expert_imbalance_basis: str | None = Field(
        default=None, description="Whether expert_imbalance is measured or assumed, and how."
    )


def estimate_step(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    tp: int,
    batch: int,
    context: int,
    latency: LatencyModel | None = None,
    host: HostProfile | None = None,
    ep: int = 1,
    dp: int = 1,
    expert_skew: float | None = None,
    dense_dp: bool = False,
) -> StepEstimate:
    """Latency, memory and cost of one colocated decode step of a replica of ``tp x dp`` GPUs
    (layout: :mod:`.parallelism`): ``batch`` requests split over ``dp`` data-parallel ranks,
    routed experts over ``ep``; ``dense_dp`` holds dense FFN layers whole on every GPU (SGLang's
    ``--moe-dense-tp-size 1``, TensorRT-LLM under attention DP) instead of over the group.

    ``host`` names the serving engine's per-step host time (``HOST_PROFILES``) in place of the
    hardware's; it applies to the analytical latency model, not to a given ``latency``.
    ``expert_skew`` is a measured busiest-over-mean expected load of the expert GPUs (default:
    balanced, an assumption the result says it made).

    >>> from opweave.costmodel import load_model, default_catalog, host_profile
    >>> llama, h100 = load_model("llama-3.3-70b"), default_catalog().get("h100")
    >>> est = estimate_step(llama, h100, tp=4, batch=32, context=8192)
    >>> est.fits, round(est.step_latency_s * 1e3, 1) > 10
    (True, True)
    >>> v0 = estimate_step(llama, h100, tp=4, batch=32, context=8192, host=host_profile("vllm-0.6"))
    >>> round((v0.step_latency_s - est.step_latency_s) * 1e3, 2)  # 1.71 ms instead of 0.16 ms
    1.55
    """
    gemm_path = check_runs(model.precision, hardware)
    par = Parallelism(tp=tp, ep=ep, dp=dp, dense_dp=dense_dp)
    if not par.plain:
        problem = parallelism_problem(model, par, hardware, engine_splits=True)
        if problem is not None:
            raise ConfigError(problem)
    if expert_skew is not None and not (expert_skew >= 1.0 and math.isfinite(expert_skew)):
        raise ConfigError(f"the expert imbalance must be a ratio of at least 1, got {expert_skew}")
    if host is not None:
        if latency is not None:
            raise ValueError("host applies to the analytical latency model, not a given latency")
        hardware = host.apply(hardware)
    lat = latency or RooflineLatency(hardware)
    if not par.plain and not isinstance(lat, RooflineLatency):
        raise ConfigError(f"{par}: a measured profile holds tensor-parallel latencies only")
    breakdown = (
        {c.value: 0.0 for c in OpClass}
        | {"communication": 0.0}
        | {term: 0.0 for term in FIXED_TERMS.values()}
    )
    layer_of = {op.key: layer for layer in model.layers for op in layer.ops}
    # the collectives are the roofline's unless a profile measured them: floor and payload
    roof = RooflineLatency(lat.hardware)
    split = isinstance(lat, (RooflineLatency, ProfiledLatency))
    skew = 1.0 if expert_skew is None else expert_skew
    for op in model.operators:
        if isinstance(lat, RooflineLatency):
            terms = parallel_op_terms_s(lat.hardware, model, op, par, batch, context, skew)
            breakdown[op.op_class.value] += terms.pop("roofline")
            for name, value in terms.items():
                breakdown[FIXED_TERMS[name]] += value
            continue
        seconds = lat.op_latency_s(model, op, layer_of.get(op.key), tp, batch, context)
        step = lat.step_s(op, batch) if isinstance(lat, ProfiledLatency) else 0.0
        breakdown[op.op_class.value] += seconds - step
        breakdown["step_overhead"] += step
        if split:
            source = lat if isinstance(lat, ProfiledLatency) else roof
            floor, payload = source.collective_terms_s(op, tp, batch)
            breakdown["allreduce_latency"] += floor
            breakdown["communication"] += payload
        else:
            breakdown["communication"] += lat.collective_s(op, tp, batch)
    step = sum(breakdown.values())
    memory = memory_bytes_per_gpu(model.operators, par, batch, context)
    price = hardware.usd_per_hour
    usd = None if price is None else price * par.gpus * step / batch / 3600 * 1e6
    imbalance, basis = None, None
    moe = next((op.moe for op in model.operators if op.moe is not None), None)
    if moe is not None and ep > 1:
        imbalance = expert_load_imbalance(moe, batch, ep, skew)
        basis = BALANCED_BASIS if expert_skew is None else f"measured skew {skew:g} (given)"
    return StepEstimate(
        model=model.name,
        gpu=hardware.id,
        tp=tp,
        ep=ep,
        dp=dp,
        dense_dp=dense_dp,
        batch=batch,
        context_tokens=context,
        step_latency_s=step,
        breakdown_s=breakdown,
        memory_bytes_per_gpu=memory,
        weight_bytes_per_gpu=weight_bytes_per_gpu(model.operators, par),
        memory_capacity_bytes=hardware.usable_memory_bytes,
        quant=model.precision.quant,
        kv_cache_dtype=model.precision.kv_cache_dtype,
        gemm_path=gemm_path,
        fits=memory <= hardware.usable_memory_bytes,
        tokens_per_s=batch / step,
        usd_per_million_tokens=usd,
        expert_imbalance=imbalance,
        expert_imbalance_basis=basis,
    )
