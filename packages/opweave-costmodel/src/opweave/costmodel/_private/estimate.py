"""Colocated decode step estimate: ``opweave estimate``."""

from __future__ import annotations

from pydantic import Field

from .base import Frozen
from .hardware import HardwareSpec
from .host import HostProfile
from .model import ModelSpec, OpClass
from .precision import check_runs
from .profile import LatencyModel
from .roofline import (
    ProfiledLatency,
    RooflineLatency,
    memory_bytes_per_rank,
    weight_bytes_per_rank,
)

# RooflineLatency.op_terms_s name -> breakdown_s key
FIXED_TERMS = {
    "kernel_launch": "kernel_launch",
    "moe_experts": "moe_experts",
    "step": "step_overhead",
}


class StepEstimate(Frozen):
    """One colocated decode step of ``batch`` requests at context ``context_tokens``."""

    model: str
    gpu: str
    tp: int
    batch: int
    context_tokens: int
    step_latency_s: float
    breakdown_s: dict[str, float] = Field(
        description="Where the step's time goes: the roofline per op class (attention, gemm, "
        "small), TP communication (payload over bandwidth), and the fixed costs: kernel_launch, "
        "allreduce_latency (the collectives' floor), moe_experts (fused-MoE start-up and "
        "per-expert cost) and step_overhead (the engine's host work per step: scheduling, "
        "sampling, host round trip; the host profile's when one is given). With a measured "
        "profile, kernel_launch and moe_experts are zero (its operator times contain them); the "
        "collectives and step_overhead stay the model's, as the profile holds no collectives and "
        "times the sampling kernel, not the step around it."
    )
    memory_bytes_per_gpu: float
    weight_bytes_per_gpu: float = Field(
        description="Resident weights per GPU, in their formats (scales and unquantised "
        "modules included)."
    )
    memory_capacity_bytes: float = Field(description="Usable memory per GPU.")
    quant: str = Field(description="Weight format (precision.py; bf16: unquantised).")
    kv_cache_dtype: str = Field(description="Dtype the KV cache is held in.")
    gemm_path: str = Field(description="How the GPU runs the quantised GEMMs (tensor-core path).")
    fits: bool
    tokens_per_s: float
    usd_per_million_tokens: float | None


def estimate_step(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    tp: int,
    batch: int,
    context: int,
    latency: LatencyModel | None = None,
    host: HostProfile | None = None,
) -> StepEstimate:
    """Latency, memory and cost of one colocated decode step.

    ``host`` names the serving engine's per-step host time (``HOST_PROFILES``) in place of the
    hardware's; it applies to the analytical latency model, not to a given ``latency``.

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
    if host is not None:
        if latency is not None:
            raise ValueError("host applies to the analytical latency model, not a given latency")
        hardware = host.apply(hardware)
    lat = latency or RooflineLatency(hardware)
    breakdown = (
        {c.value: 0.0 for c in OpClass}
        | {"communication": 0.0}
        | {term: 0.0 for term in FIXED_TERMS.values()}
        | {"allreduce_latency": 0.0}
    )
    layer_of = {op.key: layer for layer in model.layers for op in layer.ops}
    # the collectives are the roofline's for a profile too (it holds none): floor and payload
    roof = RooflineLatency(lat.hardware)
    split = isinstance(lat, (RooflineLatency, ProfiledLatency))
    for op in model.operators:
        if isinstance(lat, RooflineLatency):
            terms = lat.op_terms_s(op, tp, batch, context)
            breakdown[op.op_class.value] += terms.pop("roofline")
            for name, value in terms.items():
                breakdown[FIXED_TERMS[name]] += value
        else:
            seconds = lat.op_latency_s(model, op, layer_of.get(op.key), tp, batch, context)
            step = lat.step_s(op, batch) if isinstance(lat, ProfiledLatency) else 0.0
            breakdown[op.op_class.value] += seconds - step
            breakdown["step_overhead"] += step
        if split:
            floor, payload = roof.collective_terms_s(op, tp, batch)
            breakdown["allreduce_latency"] += floor
            breakdown["communication"] += payload
        else:
            breakdown["communication"] += lat.collective_s(op, tp, batch)
    step = sum(breakdown.values())
    memory = memory_bytes_per_rank(model.operators, tp, batch, context)
    price = hardware.usd_per_hour
    usd = None if price is None else price * tp * step / batch / 3600 * 1e6
    return StepEstimate(
        model=model.name,
        gpu=hardware.id,
        tp=tp,
        batch=batch,
        context_tokens=context,
        step_latency_s=step,
        breakdown_s=breakdown,
        memory_bytes_per_gpu=memory,
        weight_bytes_per_gpu=weight_bytes_per_rank(model.operators, tp),
        memory_capacity_bytes=hardware.usable_memory_bytes,
        quant=model.precision.quant,
        kv_cache_dtype=model.precision.kv_cache_dtype,
        gemm_path=gemm_path,
        fits=memory <= hardware.usable_memory_bytes,
        tokens_per_s=batch / step,
        usd_per_million_tokens=usd,
    )
