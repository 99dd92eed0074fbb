"""Build a :class:`ModelSpec` from a Hugging Face ``config.json`` of a supported family.

The config is read once, into an :class:`~.architecture.Architecture` (checked field by field);
the operators' costs here are derived from it, as the runtime's operators are.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from . import linears
from .architecture import FULL, SLIDING, Architecture, config_defaults, resolve_architecture
from .blocks import partition_block
from .mla import mla_attention
from .model import (
    AttentionKind,
    LayerSpec,
    LinearShape,
    ModelSpec,
    MoESpec,
    OpClass,
    OperatorName,
    OperatorSpec,
    TPCollective,
)
from .precision import DTYPE_BYTES as _DTYPE_BYTES
from .precision import UNQUANTISED
from .quant_config import resolve_precision
from .quantize import quantize_layer, quantize_ops
from .registry import FAMILIES, text_config

# ``--quant`` names of unquantised float dtypes, for a checkpoint served in another one
_SERVED_DTYPES = {label: dtype for dtype, label in UNQUANTISED.items()}
# families vLLM refuses to run in float16 (``_FLOAT16_NOT_SUPPORTED_MODELS`` in
# vllm/config/model.py: numerical instability)
_NO_FLOAT16 = frozenset({"gemma3_text"})


def _served_dtype(stored: str, quant: str | None, family: str) -> str | None:
    """The float dtype a checkpoint stored in ``stored`` is served in under ``--quant``, where
    that differs from its own: the dtype ``bf16|fp16|fp32`` names; bf16 for a float32
    checkpoint quantised online, since vLLM's --dtype auto casts float32 down (and its FP8
    method refuses float32 activations). None: as stored."""
    if quant is None or stored not in _SERVED_DTYPES.values():
        return None
    if quant in _SERVED_DTYPES:
        if quant == "fp16" and family in _NO_FLOAT16:
            raise ConfigError(
                f"--quant fp16: vLLM does not serve {family} models in float16 (numerical "
                "instability); use bf16 or fp32"
            )
        return _SERVED_DTYPES[quant]
    return "bfloat16" if stored == "float32" else None


def model_spec_from_config(
    config: Mapping[str, Any],
    *,
    name: str | None = None,
    dtype: str | None = None,
    quant: str | None = None,
    kv_cache_dtype: str = "auto",
    hf_quant_config: Mapping[str, Any] | None = None,
) -> ModelSpec:
    """Parse a Hugging Face config into a ModelSpec, in the precision it is served in.

    The weight format is the checkpoint's (its ``quantization_config``, else ModelOpt's
    ``hf_quant_config`` beside it), or ``quant`` for an unquantised checkpoint; the KV cache is
    in ``kv_cache_dtype`` (``auto``: the checkpoint's, else the model's dtype).

    >>> spec = model_spec_from_config({"model_type": "llama", "num_hidden_layers": 2,
    ...     "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "vocab_size": 100, "torch_dtype": "float32"})
    >>> [op.name for op in spec.layers[0].ops][:4]
    ['attn_norm', 'qkv_proj', 'rope', 'core_attn']
    >>> spec.block.period_layers
    1
    """
    text = text_config(config)
    arch = resolve_architecture(text, dtype=dtype)
    precision = resolve_precision(
        config, arch, quant=quant, kv_cache_dtype=kv_cache_dtype, hf_quant_config=hf_quant_config
    )
    # the checkpoint's own dtype: its fingerprint, whatever dtype it is served in
    stored = arch.dtype if dtype is None else resolve_architecture(text).dtype
    served = _served_dtype(stored, quant, arch.family)
    if served is not None and dtype is None and arch.dtype != served:
        # served in another float dtype (an engine's --dtype): weights, KV cache and math
        arch = resolve_architecture(text, dtype=served)
        recast = quant in _SERVED_DTYPES
        precision = resolve_precision(
            config,
            arch,
            quant=None if recast else quant,
            kv_cache_dtype=kv_cache_dtype,
            hf_quant_config=hf_quant_config,
        )
        source = (
            f"a {stored} checkpoint served in {quant}: --quant {quant}"
            if recast
            else f"{precision.source}; the {stored} checkpoint's other weights and its math "
            f"in {UNQUANTISED[served]}, as vLLM's --dtype auto serves it"
        )
        precision = precision.model_copy(update={"source": source})
    builder = _Builder(arch, _DTYPE_BYTES[arch.dtype])
    layers = tuple(
        _math_dtype(quantize_layer(builder.layer(i), precision), arch.dtype)
        for i in range(arch.num_layers)
    )
    pre_ops = _math_ops(quantize_ops(builder.pre_ops(), precision), arch.dtype)
    post_ops = _math_ops(quantize_ops(builder.post_ops(), precision), arch.dtype)
    layer_ops = [op for layer in layers for op in layer.ops]
    applied = {op.weight_format for op in (*pre_ops, *layer_ops, *post_ops)}
    if precision.rules and not applied - {None}:
        what = "quantized_layers" if precision.method == "modelopt-mixed" else "targets"
        ignored = ", or its ignore list holds them all" if precision.ignore else ""
        raise ConfigError(
            f"{precision.source}: it quantises none of this {arch.family} model's linears "
            f"(none of its {what} names one{ignored}); check that the checkpoint's config "
            "belongs to these weights"
        )
    # a rule whose targets are none of the model's linears (a vision tower's, say) says nothing
    # of how this model is stored: its format leaves the label
    rules = tuple(r for r in precision.rules if r.scheme.format in applied)
    if rules != precision.rules:
        precision = precision.model_copy(update={"rules": rules})
    identity: dict[str, Any] = {"config": text, "dtype": stored}
    if precision.quantized or precision.kv_fp8:  # unquantised models keep their digest
        identity["precision"] = precision.model_dump(exclude={"source", "kv_source"}) | {
            "compute_dtype": stored
        }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    return ModelSpec(
        name=name or arch.family,
        family=arch.family,
        dtype=arch.dtype,
        bytes_per_param=_DTYPE_BYTES[arch.dtype],
        hidden_size=arch.hidden_size,
        vocab_size=arch.vocab_size,
        num_layers=len(layers),
        max_context_tokens=arch.max_position_embeddings,
        pre_ops=pre_ops,
        layers=layers,
        post_ops=post_ops,
        block=partition_block(layers),
        config_sha256=digest,
        arch=arch,
        precision=precision,
        encoders_not_costed=_encoders(config),
        config_defaults=config_defaults(text),
    )


def _encoders(config: Mapping[str, Any]) -> tuple[str, ...]:
    """A multimodal wrapper's encoder configs (``vision_config``, ``audio_config``, ...)."""
    return tuple(
        sorted(
            key
            for key, value in config.items()
            if key != "text_config"
            and key.endswith("_config")
            and isinstance(value, Mapping)
            and any(word in key for word in ("vision", "audio", "visual", "image", "video"))
        )
    )


def _math_ops(ops: tuple[OperatorSpec, ...], dtype: str) -> tuple[OperatorSpec, ...]:
    """``ops`` computing in ``dtype``: float32 math runs at the device's FP32 rate."""
    if dtype != "float32":
        return ops
    return tuple(op.model_copy(update={"fp32_math": True}) for op in ops)


def _math_dtype(layer: LayerSpec, dtype: str) -> LayerSpec:
    ops = _math_ops(layer.ops, dtype)
    return layer if ops is layer.ops else layer.model_copy(update={"ops": ops})


class _Builder:
    """Operator costs of one :class:`Architecture` (sizes in elements; bytes via ``self.p``)."""

    def __init__(self, arch: Architecture, bytes_per_param: float) -> None:
        self.arch = arch
        self.p = bytes_per_param
        self.h = arch.hidden_size
        self.vocab = arch.vocab_size
        self.num_layers = arch.num_layers
        self.nq, self.nkv, self.d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.inter = arch.intermediate_size
        self.bias = arch.qkv_bias
        self.tied = "embed_tokens" if arch.tie_word_embeddings else None
        # checkpoint module names of the linears (what a quantisation config matches)
        self.names = FAMILIES[arch.family].checkpoint

    def _kind(self, i: int) -> tuple[AttentionKind, int | None]:
        kind = {FULL: AttentionKind.FULL, SLIDING: AttentionKind.SLIDING}.get(
            self.arch.layer_types[i], AttentionKind.LINEAR
        )
        return kind, self.arch.layer_window(i)

    # -- operators -------------------------------------------------------------------------
    def _op(
        self,
        name: OperatorName,
        op_class: OpClass,
        layer: int | None,
        *,
        params: float = 0.0,
        flops: float | None = None,
        act: float = 0.0,
        boundary: float = 0.0,
        collective: TPCollective = TPCollective.NONE,
        collective_elems: float = 0.0,
        **extra: Any,
    ) -> OperatorSpec:
        p = self.p
        return OperatorSpec(
            name=name,
            op_class=op_class,
            layer=layer,
            weight_bytes=round(params * p)
            if "weight_bytes" not in extra
            else extra.pop("weight_bytes"),
            flops_per_token=2.0 * params if flops is None else flops,
            activation_bytes_per_token=act * p,
            boundary_bytes_per_token=boundary * p,
            tp_collective=collective,
            tp_collective_bytes_per_token=collective_elems * p,
            **extra,
        )

    def _norm(self, name: OperatorName, layer: int | None, *, boundary: float) -> OperatorSpec:
        # Residual add fused in: read x and residual, write normed x and residual.
        return self._op(
            name,
            OpClass.SMALL,
            layer,
            params=self.h,
            flops=4.0 * self.h,
            act=4.0 * self.h,
            boundary=boundary,
            tp_sharded=False,
        )

    def pre_ops(self) -> tuple[OperatorSpec, ...]:
        h = self.h
        embed = self._op(
            "embed",
            OpClass.SMALL,
            None,
            params=self.vocab * h,
            flops=0.0,
            act=h,
            boundary=h,
            collective=TPCollective.ALLREDUCE,
            collective_elems=h,
            weight_bytes_read_per_token=h * self.p,
            tied_to=self.tied,
        )
        return (embed,)

    def post_ops(self) -> tuple[OperatorSpec, ...]:
        h, v = self.h, self.vocab
        tied = self.tied
        return (
            self._norm("final_norm", None, boundary=h),
            self._op(
                "lm_head",
                OpClass.GEMM,
                None,
                params=v * h,
                act=h + v,
                boundary=v,
                collective=TPCollective.ALLGATHER,
                collective_elems=v,
                tied_to=tied,
                linears=(LinearShape(module="lm_head", in_features=h, out_features=v),),
            ),
            # Greedy sampling reads the logits once and emits one int64 token id.
            self._op(
                "sample",
                OpClass.SMALL,
                None,
                flops=float(v),
                act=v,
                boundary=8.0 / self.p,
                tp_sharded=False,
            ),
        )

    def layer(self, i: int) -> LayerSpec:
        kind, window = self._kind(i)
        if kind is AttentionKind.LINEAR:
            attn = self._linear_attention(i)
        elif self.arch.mla is not None:
            attn = mla_attention(self, i, self.names)
        else:
            attn = self._softmax_attention(i, kind, window)
        moe = self.arch.is_moe_layer(i)
        ffn = self._moe_ffn(i) if moe else self._dense_ffn(i)
        return LayerSpec(index=i, attention=kind, window_tokens=window, moe=moe, ops=attn + ffn)

    def _softmax_attention(
        self, i: int, kind: AttentionKind, window: int | None
    ) -> tuple[OperatorSpec, ...]:
        h, nq, nkv, d = self.h, self.nq, self.nkv, self.d
        a = self.arch
        gated = a.attn_output_gate  # the output gate doubles q_proj (gated attention)
        q_out = nq * d * (2 if gated else 1)
        qkv_out = q_out + 2 * nkv * d
        # q/k norm weights: one head's width, or every head's (MiniMax-M2's per-layer norms)
        qk_norm = ((nq + nkv) * d if a.qk_norm_per_layer else 2 * d) if a.qk_norm else 0
        qkv_params = h * qkv_out + (qkv_out if self.bias else 0) + qk_norm
        o_params = nq * d * h + (h if a.o_bias else 0)
        post_norm = h if a.sandwich_norms else 0
        sinks = nq if a.attn_sinks else 0
        qkv_linears, o_linears = linears.softmax_attention(a, self.names)
        # Norms spanning all heads need the sum of squares of q and of k from every rank: one
        # all-reduce of two float32 per token (vLLM MiniMaxText01RMSNormTP.forward_qk).
        qk_allreduce = 8.0 / self.p if a.qk_norm and a.qk_norm_per_layer else 0.0
        extra_out = nq * d if gated else 0  # the gate travels with the attention output
        return (
            self._norm("attn_norm", i, boundary=2 * h),
            self._op(
                "qkv_proj",
                OpClass.GEMM,
                i,
                params=qkv_params,
                act=h + qkv_out,
                boundary=qkv_out + h,
                shard_units=nkv,
                kernels=3 if qk_norm else 1,
                collective=TPCollective.ALLREDUCE if qk_allreduce else TPCollective.NONE,
                collective_elems=qk_allreduce,
                linears=qkv_linears,
            ),
            self._op(
                "rope",
                OpClass.SMALL,
                i,
                flops=6.0 * (nq + nkv) * d,
                act=4.0 * (nq + nkv) * d,
                boundary=qkv_out + h,
                shard_units=nkv,
            ),
            self._op(
                "core_attn",
                OpClass.ATTENTION,
                i,
                params=sinks,
                flops=0.0,
                attn_flops_per_context_token=4.0 * nq * d,
                state_bytes_per_context_token=2.0 * nkv * d * self.p,
                state_window_tokens=window,
                act=2.0 * nq * d + 2.0 * nkv * d + extra_out,
                boundary=nq * d + h,
                shard_units=nkv,
                # the step's keys/values written into the paged cache, then attention over it
                # (vLLM's reshape_and_cache + attention kernel; the runtime's, _kernels.py), and
                # the output gate where there is one
                kernels=3 if gated else 2,
            ),
            self._op(
                "o_proj",
                OpClass.GEMM,
                i,
                params=o_params + post_norm,
                act=nq * d + 2 * h,
                boundary=h,
                collective=TPCollective.ALLREDUCE,
                collective_elems=h,
                kernels=2 if post_norm else 1,
                linears=o_linears,
            ),
        )

    def _linear_attention(self, i: int) -> tuple[OperatorSpec, ...]:
        """Gated DeltaNet (Qwen3-Next): conv + recurrent state instead of a KV cache."""
        h, la = self.h, self.arch.linear_attn
        assert la is not None
        nk, dk, nv, dv = la.num_k_heads, la.k_head_dim, la.num_v_heads, la.v_head_dim
        kernel = la.conv_kernel
        qkvz = 2 * nk * dk + 2 * nv * dv
        conv_dim = 2 * nk * dk + nv * dv
        # State per request: one dk x dv matrix per value head (in the state dtype) + the conv
        # window (in the model's)
        state_p = self.p if la.state_dtype is None else _DTYPE_BYTES[la.state_dtype]
        state_bytes = nv * dk * dv * state_p + conv_dim * (kernel - 1) * self.p
        # Per token: conv (2*K per channel) + delta rule (decay, k^T S, outer-product update,
        # q^T S: about 8 FLOPs per state element).
        gdn_flops = 2.0 * conv_dim * kernel + 8.0 * nv * dk * dv
        in_linears, out_linears = linears.linear_attention(self.arch, self.names)
        return (
            self._norm("attn_norm", i, boundary=2 * h),
            self._op(
                "qkv_proj",
                OpClass.GEMM,
                i,
                params=h * (qkvz + 2 * nv),
                act=h + qkvz,
                boundary=qkvz + 2 * nv + h,
                shard_units=nk,
                linears=in_linears,
            ),
            self._op(
                "core_attn",
                OpClass.ATTENTION,
                i,
                params=conv_dim * kernel + 2 * nv,
                flops=gdn_flops,
                state_bytes_fixed=state_bytes,
                act=conv_dim + 2 * nv * dv,
                boundary=2 * nv * dv + h,
                shard_units=nk,
                kernels=3,
            ),
            self._op(
                "o_proj",
                OpClass.GEMM,
                i,
                params=nv * dv * h + dv,
                act=2 * nv * dv + 2 * h,
                boundary=h,
                collective=TPCollective.ALLREDUCE,
                collective_elems=h,
                kernels=2,
                linears=out_linears,
            ),
        )

    def _dense_ffn(self, i: int) -> tuple[OperatorSpec, ...]:
        h, inter = self.h, self.inter
        bias = inter if self.arch.mlp_bias else 0
        post_norm = h if self.arch.sandwich_norms else 0
        up_linears, down_linears = linears.dense_ffn(self.arch, self.names)
        return (
            self._norm("ffn_norm", i, boundary=2 * h),
            self._op(
                "gate_up_proj",
                OpClass.GEMM,
                i,
                params=2 * h * inter + 2 * bias,
                act=h + 3 * inter,
                boundary=inter + h,
                kernels=2,
                linears=up_linears,
            ),
            self._op(
                "down_proj",
                OpClass.GEMM,
                i,
                params=inter * h + post_norm,
                act=inter + 2 * h,
                boundary=h,
                collective=TPCollective.ALLREDUCE,
                collective_elems=h,
                kernels=2 if post_norm else 1,
                linears=down_linears,
            ),
        )

    def _moe_ffn(self, i: int) -> tuple[OperatorSpec, ...]:
        h, moe = self.h, self.arch.moe
        assert moe is not None
        experts, top_k, inter = moe.num_experts, moe.top_k, moe.intermediate_size
        shared = moe.shared_intermediate_size
        expert_params = 3 * h * inter + ((2 * inter + h) if moe.expert_bias else 0)
        expert_bytes = round(expert_params * self.p)  # quantize.py applies the format
        router_linears, expert_linears, shared_linears = linears.moe_ffn(self.arch, self.names)
        router_params = experts * h + (experts if moe.router_bias else 0)
        router_params += experts if moe.score_correction_bias else 0
        router_flops = 2.0 * router_params
        if moe.num_groups > 1:
            # group-limited selection (vLLM grouped_topk): scores plus their correction bias,
            # each group's top-2 sum, the top groups, then a top-k over the unmasked experts --
            # about four passes over the expert scores
            router_flops += 4.0 * experts
        ops = [
            self._norm("ffn_norm", i, boundary=2 * h),
            self._op(
                "router",
                OpClass.SMALL,
                i,
                params=router_params,
                flops=router_flops,
                act=h + experts,
                boundary=2 * h + top_k * 8 / self.p,
                tp_sharded=False,
                kernels=2,
                linears=router_linears,
            ),
            self._op(
                "experts",
                OpClass.GEMM,
                i,
                flops=2.0 * expert_params * top_k,
                weight_bytes=experts * expert_bytes,
                act=h + 4 * inter * top_k,
                boundary=(2 * h) if shared else h,
                collective=TPCollective.NONE if shared else TPCollective.ALLREDUCE,
                collective_elems=0 if shared else h,
                kernels=3,
                linears=expert_linears,
                moe=MoESpec(
                    num_experts=experts,
                    top_k=top_k,
                    expert_weight_bytes=expert_bytes,
                    intermediate_size=inter,
                    shared_expert_intermediate_size=shared,
                ),
            ),
        ]
        if shared:
            ops.append(
                self._op(
                    "shared_expert",
                    OpClass.GEMM,
                    i,
                    params=3 * h * shared + (h if moe.shared_expert_gate else 0),
                    act=2 * h + 3 * shared,
                    boundary=h,
                    collective=TPCollective.ALLREDUCE,
                    collective_elems=h,
                    # gate_up, activation, down (and Qwen's sigmoid gate)
                    kernels=4 if moe.shared_expert_gate else 3,
                    side_stream=True,  # [SHARED-STREAM] in fixed_costs.py
                    linears=shared_linears,
                )
            )
        return tuple(ops)
