"""A :class:`~.precision.Precision` applied to a model's operators, and the time of their math.

The operators of ``families.py`` are built in the compute dtype and list their matmul weights
(``OperatorSpec.linears``, checkpoint names). Here each linear gets the scheme its checkpoint
stores it in: an operator's resident bytes become its quantised linears' bytes (values, scales,
zeros) plus everything else in the compute dtype, and its quantised FLOPs are marked so that the
roofline runs them at the weight format's rate (:func:`~.precision.gemm_rate`). The KV cache
follows the KV-cache dtype; activations stay in the compute dtype.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from .hardware import HardwareSpec
from .kernel_rates import grouped_gemm_fraction
from .model import LayerSpec, LinearShape, ModelSpec, MoESpec, OperatorSpec
from .precision import Precision, WeightScheme, gemm_rate

# Router and gate linears: vLLM builds them unquantised whatever the checkpoint's method
# (``ReplicatedLinear(..., quant_config=None)`` for the router of Qwen3-MoE, Mixtral and
# DeepSeek, and Qwen3-Next's shared-expert gate), and checkpoints leave them in the compute
# dtype (Qwen3-235B-A22B-FP8's ``modules_to_not_convert`` lists every ``mlp.gate``).
ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})


def linear_paths(module: str, layer: int | None, expert: bool) -> tuple[str, ...]:
    """The checkpoint names of a linear: ``model.layers.3.self_attn.q_proj``; a routed expert's
    also with its index, as checkpoints store them (``mlp.experts.0.gate_proj``), and the
    experts' module itself (``mlp.experts``), the name vLLM matches a fused-MoE layer by."""
    path = module if layer is None else f"model.layers.{layer}.{module}"
    if expert and ".experts." in path:
        experts = path[: path.index(".experts.") + len(".experts")]
        return (path, path.replace(".experts.", ".experts.0.", 1), experts)
    return (path,)


def weight_only(op: OperatorSpec) -> bool:
    """Whether ``op``'s quantised weights are weight-only (``WeightScheme.weight_only``): stored
    in their format, multiplied in the compute dtype, so none of its FLOPs is quantised."""
    return op.weight_format is not None and op.quantized_flops_per_token == 0


def _is_expert(op: OperatorSpec, linear: LinearShape) -> bool:
    return op.moe is not None and linear.count == op.moe.num_experts and linear.count > 1


def quantize_op(op: OperatorSpec, precision: Precision) -> OperatorSpec:
    """``op`` in ``precision``: quantised linears' bytes and FLOPs, KV cache in its dtype."""
    update: dict[str, object] = {}
    p = precision.dtype_bytes
    if precision.kv_fp8 and op.fp8_state_bytes_per_context_token is not None:
        update["state_bytes_per_context_token"] = op.fp8_state_bytes_per_context_token
    elif op.state_bytes_per_context_token and precision.kv_bytes_per_value != p:
        update["state_bytes_per_context_token"] = (
            op.state_bytes_per_context_token * precision.kv_bytes_per_value / p
        )
    schemes: list[tuple[LinearShape, WeightScheme, bool]] = []
    for linear in op.linears:
        expert = _is_expert(op, linear)
        router = linear.module.rsplit(".", 1)[-1] in ROUTER_NAMES
        scheme = precision.scheme_for(
            linear_paths(linear.module, op.layer, expert), router=router, expert=expert
        )
        if scheme is not None:
            schemes.append((linear, scheme, expert))
    if schemes:
        update |= _quantized_weights(op, schemes, p)
    return op.model_copy(update=update) if update else op


def _quantized_weights(
    op: OperatorSpec, schemes: list[tuple[LinearShape, WeightScheme, bool]], p: float
) -> dict[str, object]:
    formats = {s.format for _, s, _ in schemes}
    if len(formats) > 1:
        raise ConfigError(
            f"{op.key}: its linears are stored in {' and '.join(sorted(formats))}; OpWeave "
            "models one quantised weight format per operator"
        )
    # bytes each quantised linear saves against the compute dtype: per expert, and the rest
    expert_delta = other_delta = 0.0
    flops = 0.0
    for linear, scheme, expert in schemes:
        per_copy = scheme.linear_bytes(linear.in_features, linear.out_features)
        delta = per_copy - linear.in_features * linear.out_features * p
        active = linear.count
        if expert:
            assert op.moe is not None
            expert_delta += delta
            active = op.moe.top_k
        else:
            other_delta += delta * linear.count
        if not scheme.weight_only:  # weight-only GEMMs run at the compute dtype's rate
            flops += 2.0 * linear.in_features * linear.out_features * active
    out: dict[str, object] = {
        "weight_format": formats.pop(),
        "quantized_flops_per_token": min(flops, op.flops_per_token),
    }
    weight_bytes = op.weight_bytes + other_delta
    if op.moe is not None and expert_delta:
        per_expert = round(op.moe.expert_weight_bytes + expert_delta)
        weight_bytes += (per_expert - op.moe.expert_weight_bytes) * op.moe.num_experts
        out["moe"] = MoESpec(**(op.moe.model_dump() | {"expert_weight_bytes": per_expert}))
    assert weight_bytes > 0, f"{op.key}: its linears hold more parameters than the operator"
    out["weight_bytes"] = round(weight_bytes)
    units = mxfp4_expert_blocks(op, schemes)
    if units is not None:
        out["shard_units"] = units
    return out


def mxfp4_expert_blocks(
    op: OperatorSpec, schemes: list[tuple[LinearShape, WeightScheme, bool]]
) -> int | None:
    """The whole MXFP4 scale blocks along routed experts' intermediate dimension (``None``:
    not MXFP4 experts, or a dimension that is not whole blocks).

    Engines shard MXFP4 experts in whole scale blocks, the busiest rank holding
    ``ceil(blocks / tp)`` of them: vLLM's ``GptOssModel._load_weights_mxfp4``
    (``vllm/model_executor/models/gpt_oss.py``) slices each rank
    ``cdiv(intermediate_size // 32, tp_size) * 32`` channels, the last rank the rest, into
    buffers ``Mxfp4MoEMethod.create_weights`` (``vllm/model_executor/layers/quantization/
    mxfp4.py``) pads "to hold non-uniform sharded tensor"; SGLang's ``mxfp4.py`` does the same.
    gpt-oss-120b's 2880 channels are 90 blocks: 12 (384 channels) on the busiest of 8 ranks, not
    360. As :attr:`~.model.OperatorSpec.shard_units` this is the busiest rank's share
    (:func:`~.roofline.shard_fraction`), equal to ``1 / tp`` wherever ``tp`` divides the blocks.
    Padding beyond that (to 64 or 256 channels, by kernel backend) is not modelled.
    """
    if op.moe is None:
        return None
    for linear, scheme, expert in schemes:
        name = linear.module.rsplit(".", 1)[-1]
        if expert and scheme.format == "mxfp4" and name in ROW_PARALLEL and scheme.scale_cols:
            blocks, rest = divmod(linear.in_features, scheme.scale_cols)
            return blocks if rest == 0 else None
    return None


# Row-parallel linears (their input dimension is sharded under TP); the rest are column-parallel
# but for MLA's down-projections, which every rank holds whole (ReplicatedLinear in vLLM's
# deepseek_v2.py; mla.py), so no shard of them has to hold whole scale blocks.
ROW_PARALLEL = frozenset({"o_proj", "down_proj", "out_proj", "w2"})
REPLICATED = frozenset({"q_a_proj", "kv_a_proj_with_mqa", "wq_b", "wk"})  # + the DSA indexer's


def tp_split(module: str) -> tuple[bool, bool]:
    """How tensor parallelism splits the linear ``module`` (a checkpoint name, its last part
    read): ``(split, row_parallel)``. Routers, MLA's down-projections and a DSA indexer's
    projections run whole on every rank (vLLM's ReplicatedLinear); row-parallel linears split
    their input dimension, the others their output.

    >>> tp_split("mlp.experts.down_proj"), tp_split("self_attn.q_a_proj"), tp_split("mlp.gate")
    ((True, True), (False, False), (False, False))
    """
    leaf = module.rsplit(".", 1)[-1]
    return leaf not in REPLICATED and leaf not in ROUTER_NAMES, leaf in ROW_PARALLEL


# formats whose scales cover blocks or groups of a weight, and how errors name them
_BLOCK_FORMATS = {"fp8-block": "FP8", "mxfp4": "MXFP4", "nvfp4": "NVFP4"}


def block_tp_problem(
    op: OperatorSpec, precision: Precision, tp: int, *, engine_splits: bool = False
) -> str | None:
    """Why ``tp`` ranks cannot shard ``op``'s block-scaled weights (``None``: they can).

    A rank holds whole scale blocks, so each shard of a block-FP8 weight must be a multiple of
    the block along the sharded dimension, as vLLM checks when it loads one (``Fp8LinearMethod``
    for column- and row-parallel layers, ``Fp8MoEMethod``: "not divisible by weight
    quantization block"). Qwen3-235B-A22B-FP8's experts (1536 channels) do not split over 8.
    MXFP4 and NVFP4 scale groups (32 and 16 input columns) bind row-parallel shards alike, as
    the runtime reads them (whole groups per rank).

    ``engine_splits`` also accepts the uneven splits serving engines run and OpWeave's runtime
    does not: MXFP4 routed experts in whole scale blocks, ``ceil(blocks / tp)`` on the busiest
    rank (:func:`mxfp4_expert_blocks`). Estimates of engine deployments pass it; the runtime and
    the planner do not, so no plan asks the runtime for such a split.
    """
    if tp == 1 or op.weight_format not in _BLOCK_FORMATS:
        return None
    if engine_splits and op.moe is not None and op.shard_units and op.weight_format == "mxfp4":
        return None  # the experts' only linears; their split is op.shard_units (see above)
    for linear in op.linears:
        expert = _is_expert(op, linear)
        router = linear.module.rsplit(".", 1)[-1] in ROUTER_NAMES
        paths = linear_paths(linear.module, op.layer, expert)
        scheme = precision.scheme_for(paths, router=router, expert=expert)
        if scheme is None or scheme.scale_rows is None or scheme.scale_cols is None:
            continue
        name = linear.module.rsplit(".", 1)[-1]
        if name in REPLICATED:
            continue
        row = name in ROW_PARALLEL
        size = linear.in_features if row else linear.out_features
        block = scheme.scale_cols if row else scheme.scale_rows
        shard = size / tp
        if name in ("k_proj", "v_proj") and op.shard_units:
            # fewer KV heads than ranks: each rank holds whole heads (shard_fraction's rule)
            shard = size * math.ceil(op.shard_units / tp) / op.shard_units
        if not shard.is_integer() or int(shard) % block:
            kind = _BLOCK_FORMATS[scheme.format]
            return (
                f"{op.key}: {linear.module} shards of {shard:g} are not whole "
                f"{scheme.scale_rows}x{scheme.scale_cols} {kind} scale blocks at tp {tp}"
            )
    return None


def quantize_ops(ops: tuple[OperatorSpec, ...], precision: Precision) -> tuple[OperatorSpec, ...]:
    if not precision.quantized and not precision.kv_fp8:
        return ops
    return tuple(quantize_op(op, precision) for op in ops)


def quantize_layer(layer: LayerSpec, precision: Precision) -> LayerSpec:
    ops = quantize_ops(layer.ops, precision)
    return layer if ops is layer.ops else layer.model_copy(update={"ops": ops})


def expert_channels(op: OperatorSpec, share: float) -> float:
    """Intermediate channels of one routed expert a GPU holding ``share`` of ``op`` computes
    (0 where ``op`` is no routed-expert operator or does not say)."""
    return op.moe.intermediate_size * share if op.moe is not None else 0.0


def compute_s(
    op: OperatorSpec,
    hw: HardwareSpec,
    flops: float,
    batch: float,
    share: float,
    channels: float | None = None,
) -> float:
    """Seconds of math of ``flops`` (one rank's share ``share`` of ``op`` at ``batch``): the
    quantised linears' FLOPs at their format's rate, everything else at the dense rate; routed
    experts at the fraction of it their fused-MoE kernels reach (:func:`grouped_gemm_fraction`,
    each GPU holding ``channels`` of an expert, by default ``share`` of them).

    Attention reads an FP8 KV cache and dequantises it to the compute dtype in the kernel
    (BF16 math; its FLOPs stay at the dense rate), as vLLM's paged-attention kernels do for
    ``kv_cache_dtype=fp8``.
    """
    dense = hw.effective_fp32_flops if op.fp32_math else hw.effective_flops
    width = expert_channels(op, share) if channels is None else channels
    fraction = grouped_gemm_fraction(op, hw, width)
    if op.weight_format is None or not op.quantized_flops_per_token:
        return flops / dense / fraction
    quantized = min(flops, batch * op.quantized_flops_per_token * share)
    rate = gemm_rate(op.weight_format, hw).flops_per_s
    return ((flops - quantized) / dense + quantized / rate) / fraction


def gemm_flops_per_s(model: ModelSpec, hw: HardwareSpec) -> float:
    """The rate ``model``'s FLOPs outside attention run at on ``hw``: the FLOP-weighted
    (harmonic) mean of its GEMMs' rates (their formats', routed experts' at their fused-MoE
    kernels' fraction of it), since the time of all of them is ``sum(flops_i / rate_i)``."""
    ops = [o for o in model.operators if o.name != "core_attn" and o.flops_per_token]
    flops = sum(o.flops_per_token for o in ops)
    seconds = sum(compute_s(o, hw, o.flops_per_token, 1.0, 1.0) for o in ops)
    return flops / seconds if seconds else compute_rate(model, hw)


def compute_rate(model: ModelSpec, hw: HardwareSpec) -> float:
    """The dense rate ``model``'s unquantised math runs at on ``hw``: its FP32 rate for a model
    computing in float32, else its dense tensor rate."""
    return hw.effective_fp32_flops if model.dtype == "float32" else hw.effective_flops
