"""Build a :class:`ModelSpec` from a Hugging Face ``config.json`` of a supported family.

Hugging Face saves only the keys that differ from its config class's defaults, so a missing key
takes that class's default (transformers 5.x, ``configuration_<family>.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from .model import (
    AttentionKind,
    LayerSpec,
    ModelSpec,
    MoESpec,
    OpClass,
    OperatorName,
    OperatorSpec,
    PartitionBlock,
    TPCollective,
)

SUPPORTED_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma3",
    "gemma3_text",
    "qwen3_next",
    "gpt_oss",
)

# Defaults of the transformers config classes for the keys the cost model reads.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        sliding_window=4096,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        attention_bias=False,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        attention_bias=False,
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_experts=128,
        norm_topk_prob=False,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        num_experts_per_tok=2,
        num_local_experts=8,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "gemma3_text": dict(
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
        sliding_window=4096,
        sliding_window_pattern=6,
        attention_bias=False,
        tie_word_embeddings=True,
    ),
    "qwen3_next": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        max_position_embeddings=32768,
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        decoder_sparse_step=1,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts_per_tok=10,
        num_experts=512,
        mlp_only_layers=[],
        attention_bias=False,
        tie_word_embeddings=False,
    ),
    "gpt_oss": dict(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        sliding_window=128,
        num_local_experts=128,
        num_experts_per_tok=4,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
}

_DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "float8_e4m3fn": 1.0}
# MXFP4 (OCP Microscaling spec v1.0): 32 FP4 values share one 8-bit scale = 4.25 bits/param.
_MXFP4_BYTES_PER_PARAM = 4.25 / 8


@dataclass(frozen=True)
class _Cfg:
    """A family config with defaults applied; ``get`` fails loudly on a missing key."""

    family: str
    raw: Mapping[str, Any]

    def get(self, key: str, default: Any = ...) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if key in self.raw and default is ...:
            return None
        if key in _DEFAULTS[self.family]:
            return _DEFAULTS[self.family][key]
        if default is ...:
            raise ConfigError(f"{self.family} config lacks '{key}'; add it to config.json")
        return default

    def int(self, key: str) -> int:
        value = self.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"config key '{key}' must be a non-negative integer, got {value!r}")
        return value


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: multimodal Gemma-3 nests it under ``text_config``."""
    if not isinstance(config, Mapping):
        raise ConfigError("config.json must hold a JSON object")
    model_type = config.get("model_type")
    if model_type == "gemma3":
        text = dict(config.get("text_config") or {})
        text.setdefault("model_type", "gemma3_text")
        for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
            if key in config and key not in text:
                text[key] = config[key]
        return text
    return dict(config)


# Keys that name the same thing in different transformers versions: a default for one must not
# shadow a value given under the other.
_ALIASES = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}


def family_defaults(family: str, present: Mapping[str, Any]) -> dict[str, Any]:
    """The transformers defaults of ``family`` for the keys absent from ``present``.

    Hugging Face omits keys equal to a config class's defaults when saving, so readers of a
    ``config.json`` (the cost model here, the runtime's operator builder) fill them the same way.

    >>> family_defaults("gemma3_text", {"hidden_size": 5376})["vocab_size"]
    262208
    """
    if family not in _DEFAULTS:
        raise UnsupportedModelError(
            f"model_type {family!r} is not supported; supported families: "
            + ", ".join(SUPPORTED_FAMILIES)
        )
    return {
        k: v
        for k, v in _DEFAULTS[family].items()
        if k not in present and _ALIASES.get(k) not in present
    }


def model_spec_from_config(
    config: Mapping[str, Any], *, name: str | None = None, dtype: str | None = None
) -> ModelSpec:
    """Parse a Hugging Face config into a ModelSpec.

    >>> spec = model_spec_from_config({"model_type": "llama", "num_hidden_layers": 2,
    ...     "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "vocab_size": 100, "torch_dtype": "float32"})
    >>> [op.name for op in spec.layers[0].ops][:4]
    ['attn_norm', 'qkv_proj', 'rope', 'core_attn']
    >>> spec.block.period_layers
    1
    """
    text = text_config(config)
    family = text.get("model_type")
    if family not in SUPPORTED_FAMILIES or family == "gemma3":
        raise UnsupportedModelError(
            f"model_type {family!r} is not supported; supported families: "
            + ", ".join(SUPPORTED_FAMILIES)
        )
    cfg = _Cfg(str(family), text)
    dtype_name = dtype or str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
    if dtype_name not in _DTYPE_BYTES:
        raise ConfigError(
            f"dtype {dtype_name!r} is not supported; use one of {', '.join(_DTYPE_BYTES)}"
        )
    builder = _Builder(cfg, _DTYPE_BYTES[dtype_name])
    layers = tuple(builder.layer(i) for i in range(builder.num_layers))
    if not layers:
        raise ConfigError("config has num_hidden_layers = 0; a decoder needs at least one layer")
    digest = hashlib.sha256(
        json.dumps({"config": text, "dtype": dtype_name}, sort_keys=True, default=str).encode()
    ).hexdigest()
    return ModelSpec(
        name=name or str(family),
        family=str(family),
        dtype=dtype_name,
        bytes_per_param=_DTYPE_BYTES[dtype_name],
        hidden_size=builder.h,
        vocab_size=builder.vocab,
        num_layers=len(layers),
        max_context_tokens=cfg.int("max_position_embeddings"),
        pre_ops=builder.pre_ops(),
        layers=layers,
        post_ops=builder.post_ops(),
        block=partition_block(layers),
        config_sha256=digest,
    )


def partition_block(layers: tuple[LayerSpec, ...]) -> PartitionBlock:
    """Smallest period ``p`` with layer ``i`` interchangeable with layer ``i - p`` for all i."""
    sigs = [layer.signature for layer in layers]
    n = len(sigs)
    period = next(p for p in range(1, n + 1) if all(sigs[i] == sigs[i - p] for i in range(p, n)))
    names: list[OperatorName] = []
    offsets: list[int] = []
    for offset, layer in enumerate(layers[:period]):
        for op in layer.ops:
            names.append(op.name)
            offsets.append(offset)
    return PartitionBlock(
        period_layers=period,
        num_full_blocks=n // period,
        remainder_layers=n % period,
        op_names=tuple(names),
        op_layers=tuple(offsets),
    )


class _Builder:
    """Operator costs for one family (all sizes in elements; bytes via ``self.p``)."""

    def __init__(self, cfg: _Cfg, bytes_per_param: float) -> None:
        self.cfg = cfg
        self.family = cfg.family
        self.p = bytes_per_param
        self.h = cfg.int("hidden_size")
        self.vocab = cfg.int("vocab_size")
        self.num_layers = cfg.int("num_hidden_layers")
        self.nq = cfg.int("num_attention_heads")
        kv = cfg.get("num_key_value_heads", None)
        self.nkv = self.nq if kv is None else cfg.int("num_key_value_heads")
        head_dim = cfg.get("head_dim", None)
        self.d = int(head_dim) if head_dim else self.h // max(self.nq, 1)
        self.inter = cfg.int("intermediate_size")
        self.bias = bool(cfg.get("attention_bias", False))
        if self.nq == 0 or self.nkv == 0 or self.nq % self.nkv:
            raise ConfigError(
                f"num_attention_heads ({self.nq}) must be a positive multiple of "
                f"num_key_value_heads ({self.nkv})"
            )
        self.layer_kinds = self._layer_kinds()

    # -- layer structure -------------------------------------------------------------------
    def _layer_kinds(self) -> list[tuple[AttentionKind, int | None]]:
        n, cfg = self.num_layers, self.cfg
        types = cfg.raw.get("layer_types")
        window = cfg.get("sliding_window", None)
        if types is not None:
            if len(types) != n:
                raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
            kinds = {
                "full_attention": AttentionKind.FULL,
                "sliding_attention": AttentionKind.SLIDING,
                "linear_attention": AttentionKind.LINEAR,
            }
            unknown = sorted(set(types) - set(kinds))
            if unknown:
                raise ConfigError(f"unknown layer_types {unknown}; known: {sorted(kinds)}")
            return [
                (kinds[t], int(window) if kinds[t] is AttentionKind.SLIDING else None)
                for t in types
            ]
        if self.family == "gemma3_text":
            pattern = cfg.int("sliding_window_pattern")
            return [
                (AttentionKind.SLIDING, int(window))
                if (i + 1) % pattern
                else (AttentionKind.FULL, None)
                for i in range(n)
            ]
        if self.family == "qwen3_next":
            interval = cfg.int("full_attention_interval")
            return [
                (AttentionKind.FULL, None)
                if (i + 1) % interval == 0
                else (AttentionKind.LINEAR, None)
                for i in range(n)
            ]
        if self.family == "gpt_oss":
            return [
                (AttentionKind.SLIDING, int(window)) if i % 2 == 0 else (AttentionKind.FULL, None)
                for i in range(n)
            ]
        if self.family in ("mistral", "mixtral"):
            if window:
                return [(AttentionKind.SLIDING, int(window))] * n
            return [(AttentionKind.FULL, None)] * n
        if self.family in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
            first = cfg.int("max_window_layers")
            if window:
                return [
                    (AttentionKind.SLIDING, int(window))
                    if i >= first
                    else (AttentionKind.FULL, None)
                    for i in range(n)
                ]
        return [(AttentionKind.FULL, None)] * n

    def _is_moe(self, i: int) -> bool:
        if self.family in ("mixtral", "gpt_oss"):
            return True
        if self.family in ("qwen3_moe", "qwen3_next"):
            if self._num_experts() == 0 or i in set(self.cfg.get("mlp_only_layers") or []):
                return False
            return (i + 1) % max(self.cfg.int("decoder_sparse_step"), 1) == 0
        return False

    def _num_experts(self) -> int:
        raw = self.cfg.raw
        for key in ("num_experts", "num_local_experts"):
            if raw.get(key) is not None:
                return self.cfg.int(key)
        defaults = _DEFAULTS[self.family]
        return int(defaults.get("num_experts", defaults.get("num_local_experts", 0)))

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
            tied_to="embed_tokens" if self.cfg.get("tie_word_embeddings") else None,
        )
        return (embed,)

    def post_ops(self) -> tuple[OperatorSpec, ...]:
        h, v = self.h, self.vocab
        tied = "embed_tokens" if self.cfg.get("tie_word_embeddings") else None
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
        kind, window = self.layer_kinds[i]
        if kind is AttentionKind.LINEAR:
            attn = self._linear_attention(i)
        else:
            attn = self._softmax_attention(i, kind, window)
        moe = self._is_moe(i)
        ffn = self._moe_ffn(i) if moe else self._dense_ffn(i)
        return LayerSpec(index=i, attention=kind, window_tokens=window, moe=moe, ops=attn + ffn)

    def _softmax_attention(
        self, i: int, kind: AttentionKind, window: int | None
    ) -> tuple[OperatorSpec, ...]:
        h, nq, nkv, d = self.h, self.nq, self.nkv, self.d
        gated = self.family == "qwen3_next"  # output gate doubles q_proj (gated attention)
        q_out = nq * d * (2 if gated else 1)
        qkv_out = q_out + 2 * nkv * d
        qk_norm = 2 * d if self.family in ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_next") else 0
        qkv_params = h * qkv_out + (qkv_out if self.bias else 0) + qk_norm
        o_params = nq * d * h + (h if self.family == "gpt_oss" else 0)
        post_norm = h if self.family == "gemma3_text" else 0
        sinks = nq if self.family == "gpt_oss" else 0
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
                kernels=2 if gated else 1,
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
            ),
        )

    def _linear_attention(self, i: int) -> tuple[OperatorSpec, ...]:
        """Gated DeltaNet (Qwen3-Next): conv + recurrent state instead of a KV cache."""
        cfg, h = self.cfg, self.h
        nk, dk = cfg.int("linear_num_key_heads"), cfg.int("linear_key_head_dim")
        nv, dv = cfg.int("linear_num_value_heads"), cfg.int("linear_value_head_dim")
        kernel = cfg.int("linear_conv_kernel_dim")
        qkvz = 2 * nk * dk + 2 * nv * dv
        conv_dim = 2 * nk * dk + nv * dv
        # State per request: one dk x dv matrix per value head + the conv window.
        recurrent = nv * dk * dv + conv_dim * (kernel - 1)
        # Per token: conv (2*K per channel) + delta rule (decay, k^T S, outer-product update,
        # q^T S: about 8 FLOPs per state element).
        gdn_flops = 2.0 * conv_dim * kernel + 8.0 * nv * dk * dv
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
            ),
            self._op(
                "core_attn",
                OpClass.ATTENTION,
                i,
                params=conv_dim * kernel + 2 * nv,
                flops=gdn_flops,
                state_bytes_fixed=recurrent * self.p,
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
            ),
        )

    def _dense_ffn(self, i: int) -> tuple[OperatorSpec, ...]:
        h, inter = self.h, self.inter
        bias = inter if self.cfg.get("mlp_bias", False) else 0
        post_norm = h if self.family == "gemma3_text" else 0
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
            ),
        )

    def _moe_ffn(self, i: int) -> tuple[OperatorSpec, ...]:
        cfg, h = self.cfg, self.h
        experts = self._num_experts()
        top_k = cfg.int("num_experts_per_tok")
        inter = (
            cfg.int("moe_intermediate_size")
            if self.family in ("qwen3_moe", "qwen3_next")
            else self.inter
        )
        shared = cfg.int("shared_expert_intermediate_size") if self.family == "qwen3_next" else 0
        biased = self.family == "gpt_oss"
        expert_params = 3 * h * inter + ((2 * inter + h) if biased else 0)
        quant = (cfg.raw.get("quantization_config") or {}).get("quant_method")
        expert_bytes_per_param = _MXFP4_BYTES_PER_PARAM if quant == "mxfp4" else self.p
        expert_bytes = round(expert_params * expert_bytes_per_param)
        ops = [
            self._norm("ffn_norm", i, boundary=2 * h),
            self._op(
                "router",
                OpClass.SMALL,
                i,
                params=experts * h + (experts if biased else 0),
                act=h + experts,
                boundary=2 * h + top_k * 8 / self.p,
                tp_sharded=False,
                kernels=2,
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
                moe=MoESpec(
                    num_experts=experts,
                    top_k=top_k,
                    expert_weight_bytes=expert_bytes,
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
                    params=3 * h * shared + h,
                    act=2 * h + 3 * shared,
                    boundary=h,
                    collective=TPCollective.ALLREDUCE,
                    collective_elems=h,
                    kernels=4,
                )
            )
        return tuple(ops)
