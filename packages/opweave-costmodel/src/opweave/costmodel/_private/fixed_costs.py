"""Fixed costs of a decode step beside the roofline: what bytes over bandwidth leave out.

A roofline charges an operator its bytes over bandwidth (or FLOPs over throughput). Measured
decode steps take longer, by amounts that do not scale with the bytes, and most visibly at batch
1, on MoE models and under tensor or expert parallelism. Five terms account for that, each a
small pure function of (operator, hardware) whose per-GPU values live in the hardware catalog
(``hardware.py`` cites the measurements):

- **per kernel launch** (``kernel_overhead_s``): launching a kernel, filling its memory pipeline
  and draining its last wave, during which no weights stream; not charged to an operator that
  runs on a second stream beside the routed experts (``OperatorSpec.side_stream``: the shared
  experts), whose launches overlap the routed experts' longer path [SHARED-STREAM];
- **per TP collective** (``allreduce_latency_s``, ``allreduce_bandwidth_bytes_per_s``): a latency
  floor per all-reduce / all-gather, and the bandwidth decode-size collectives actually reach
  (far below the link's: they are synchronisation-bound);
- **per expert all-to-all** (``alltoall_latency_s``): the floor of each expert-parallel
  dispatch and combine (``expert_comm.py`` cites the measurements; its payload moves at the
  links' rates);
- **MoE expert loading** (``expert_fixed_latency_s``, ``expert_overhead_s``): at small batch,
  ``b`` tokens routed top-``k`` over ``E`` experts touch about ``min(E, b k)`` experts
  (``OperatorSpec.weight_bytes_read`` takes the expected count, ``E (1 - (1 - k/E)^b)``, whose
  bytes the roofline reads); the fused kernels add a fixed start-up per layer and, per expert
  touched, the ramp and tail of one small GEMM;
- **per decode step** (``step_overhead_s``, ``step_overhead_per_request_s``): scheduling,
  sampling launch and the host-device round trip the GPU waits for between steps, charged once
  per step (per microbatch) to the ``sample`` operator, which every step runs once. The default
  is an engine that overlaps its host work with the GPU; one that does not pays more, and per
  request, by an amount of its own: ``host.py``'s host profiles carry measured values.

[SHARED-STREAM] The engines run a MoE layer's shared experts on a second CUDA stream beside
the router and routed experts in decode: vLLM since v0.11.1 (vllm-project/vllm#26440, "Dual
stream execution of shared_experts and selected_experts inside FusedMoE": DeepSeek-R1 FP8 on
8 x B200 at batch 32, TPOT 23.35 -> 22.09 ms; #28406 limits it to 256 tokens a step; #30085 to
CUDA), SGLang (``DeepseekV2MoE.forward_normal_dual_stream`` under CUDA-graph capture; GLM-4.x
since sgl-project/sglang#13786: GLM-4.6-FP8 60.40 -> 66.31 tokens/s) and TensorRT-LLM
(``maybe_execute_in_parallel`` in its DeepSeek-V3 model). The shared experts' bytes still pass
through the same memory, so only their fixed costs leave the critical path. On ROCm both vLLM
(#30085, a regression on MI300) and SGLang (its second stream exists only under CUDA) run them
inline: ``HardwareSpec.side_streams`` is False there. vLLM uses the second stream for steps of
at most 256 tokens (#28406), SGLang in its CUDA-graph decode steps only: larger steps (prefill
chunks) run them inline (``SIDE_STREAM_MAX_TOKENS``).

A measured profile replaces the first and third: it times each operator's kernels, launches
and fused-MoE start-up included. It holds no collectives, so those stay these terms; and it
times the sampling kernel, not the step around it, so the per-step cost is still charged
(``ProfiledLatency.step_s``), unless the profile measured the runtime's own loop instead.
"""

from __future__ import annotations

from .hardware import HardwareSpec
from .model import OperatorSpec, TPCollective

# HardwareSpec fields of these terms, at the values that switch each one off
NO_FIXED_COSTS: dict[str, float | None] = {
    "kernel_overhead_s": 0.0,
    "allreduce_latency_s": 0.0,
    "allreduce_bandwidth_bytes_per_s": None,  # the link's bandwidth, as the roofline's transfers
    "alltoall_latency_s": 0.0,
    "step_overhead_s": 0.0,
    "step_overhead_per_request_s": 0.0,
    "expert_fixed_latency_s": 0.0,
    "expert_overhead_s": 0.0,
}


def without_fixed_costs(hw: HardwareSpec) -> HardwareSpec:
    """``hw`` on the plain roofline: every fixed cost of this module zeroed (to measure what the
    terms do, as ``costmodel_accuracy.py`` and ``paper_grid.py --fixed-costs off`` do).

    >>> from opweave.costmodel import default_catalog, estimate_step, load_model
    >>> llama, h100 = load_model("llama-3.3-70b"), default_catalog().get("h100")
    >>> plain = estimate_step(llama, without_fixed_costs(h100), tp=4, batch=1, context=4096)
    >>> sum(plain.breakdown_s[k] for k in ("kernel_launch", "allreduce_latency", "step_overhead"))
    0.0
    """
    return hw.model_copy(update=NO_FIXED_COSTS)


# Largest collective the all-reduce fits cover ([AIC-AR] in hardware.py): beyond it,
# marginal bytes move at the link's bandwidth, as a bandwidth-bound ring (NCCL) moves them.
SMALL_COLLECTIVE_MAX_BYTES = float(1 << 20)


# [SHARED-STREAM]: vLLM runs the second stream only for steps of at most this many tokens
# (DUAL_STREAM_TOKEN_THRESHOLD, vllm-project/vllm#28406); SGLang only in CUDA-graph (decode) steps
SIDE_STREAM_MAX_TOKENS = 256


def side_stream_overlaps(op: OperatorSpec, hw: HardwareSpec, tokens: float) -> bool:
    """Whether ``op`` runs on the second stream beside the routed experts in a step of
    ``tokens`` tokens per GPU on ``hw`` ([SHARED-STREAM])."""
    return op.side_stream and hw.side_streams and tokens <= SIDE_STREAM_MAX_TOKENS


def launches(op: OperatorSpec, *, overlapped: bool = True) -> int:
    """Kernel launches charged ``kernel_overhead_s`` each (``overlapped=False``: of the operator
    run alone, as a profiler times it).

    Routed experts are charged ``expert_fixed_latency_s`` instead: that measurement times the
    whole fused-MoE sequence, its launches included. An operator on a second stream beside them
    (``side_stream``: shared experts) is charged none: its launches overlap theirs
    [SHARED-STREAM].

    >>> from opweave.costmodel import load_model
    >>> moe = [o for o in load_model("deepseek-v3").layers[3].ops if o.name.endswith("expert")]
    >>> [(o.name, o.kernels, launches(o)) for o in moe]
    [('shared_expert', 3, 0)]
    """
    if op.moe is not None or (op.side_stream and overlapped):
        return 0
    return op.kernels


def launch_s(op: OperatorSpec, hw: HardwareSpec, tokens: float = 1.0) -> float:
    """Per-kernel fixed cost of one execution of ``op`` in a step of ``tokens`` tokens per GPU.

    >>> from opweave.costmodel import default_catalog, load_model
    >>> op = next(o for o in load_model("qwen3-32b").layers[0].ops if o.name == "gate_up_proj")
    >>> round(launch_s(op, default_catalog().get("h100")) * 1e6, 1)  # GEMM + SiLU-and-mul
    7.4
    """
    return launches(op, overlapped=side_stream_overlaps(op, hw, tokens)) * hw.kernel_overhead_s


def experts_touched(op: OperatorSpec, batch: float) -> float:
    """Expected distinct experts ``batch`` tokens route to (zero for non-expert operators)."""
    if op.moe is None or op.moe.expert_weight_bytes <= 0:
        return 0.0
    return float(op.weight_bytes_read(batch)) / op.moe.expert_weight_bytes


def expert_fixed_s(op: OperatorSpec, batch: float, hw: HardwareSpec) -> float:
    """Fixed time of a routed-experts operator: the fused-MoE start-up plus a small-GEMM cost
    per expert touched (zero for every other operator). The experts' bytes are in the roofline.

    >>> from opweave.costmodel import default_catalog, load_model
    >>> experts = next(o for o in load_model("qwen3-30b-a3b").layers[0].ops if o.name == "experts")
    >>> round(experts_touched(experts, 1), 1), round(experts_touched(experts, 64), 1)
    (8.0, 125.9)
    >>> round(expert_fixed_s(experts, 1, default_catalog().get("h100")) * 1e6, 2)  # 22.6 + 8 x 0.33
    25.24
    """
    if op.moe is None:
        return 0.0
    return hw.expert_fixed_latency_s + experts_touched(op, batch) * hw.expert_overhead_s


def step_overhead_s(op: OperatorSpec, batch: float, hw: HardwareSpec) -> float:
    """The per-step fixed cost of a step of ``batch`` requests, charged to the one operator
    every step (every microbatch of a pipeline) runs once: ``sample``.

    >>> from opweave.costmodel import default_catalog, load_model
    >>> sample = load_model("qwen3-32b").post_ops[-1]
    >>> round(step_overhead_s(sample, 8, default_catalog().get("h100")) * 1e6)
    160
    """
    if op.name != "sample":
        return 0.0
    return hw.step_overhead_s + hw.step_overhead_per_request_s * batch


def collective_factor(collective: TPCollective, tp: int) -> float:
    """Bytes a rank moves per payload byte: ``2(t-1)/t`` for a ring all-reduce, ``(t-1)/t`` for
    an all-gather, zero without a collective or a TP group."""
    # == rather than is: string enums compare by value, whichever copy of the module made them
    if tp <= 1 or collective == TPCollective.NONE:
        return 0.0
    scale = 2.0 if collective == TPCollective.ALLREDUCE else 1.0
    return scale * (tp - 1) / tp


def collective_latency_s(op: OperatorSpec, tp: int, hw: HardwareSpec) -> float:
    """Latency floor of ``op``'s TP collective, paid however small the payload."""
    if collective_factor(op.tp_collective, tp) == 0.0:
        return 0.0
    return hw.allreduce_latency_s


def collective_transfer_s(op: OperatorSpec, tp: int, batch: float, hw: HardwareSpec) -> float:
    """Bandwidth part of ``op``'s TP collective for ``batch`` tokens.

    Decode-size payloads (up to ``SMALL_COLLECTIVE_MAX_BYTES``) move at the measured
    ``allreduce_bandwidth_bytes_per_s``; bytes beyond at the link's ``link_efficiency``.

    >>> from opweave.costmodel import default_catalog, load_model
    >>> o_proj = next(o for o in load_model("llama-3.3-70b").layers[0].ops if o.name == "o_proj")
    >>> h100 = default_catalog().get("h100")
    >>> # 64 tokens x 8192 x 2 bytes = 1 MiB at TP 8: 1.75 MiB of ring traffic at 179 GB/s
    >>> round(collective_transfer_s(o_proj, 8, 64, h100) * 1e6, 1)
    10.3
    """
    factor = collective_factor(op.tp_collective, tp)
    payload = batch * op.tp_collective_bytes_per_token
    if factor == 0.0 or payload <= 0:
        return 0.0
    link = hw.intra_node_bandwidth_bytes_per_s * hw.link_efficiency
    small_bw = hw.allreduce_bandwidth_bytes_per_s or link
    small = min(payload, SMALL_COLLECTIVE_MAX_BYTES)
    return factor * (small / small_bw + (payload - small) / link)
