"""The decode operator sequence of a model, and the factory that builds any one operator.

The sequence is the cost model's (:attr:`opweave.costmodel.ModelSpec.operators`): a stage of a
plan is a contiguous slice of it, named by ``(layer, op)`` pairs (``layer`` is ``None`` for
model-level ops), and the runtime builds exactly those operators from the same
:class:`~opweave.costmodel.Architecture`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from opweave.costmodel import LINEAR_ATTENTION, ModelSpec, load_model, model_spec_from_config

from ..errors import UnsupportedModelError
from .attention import CoreAttention, OProj, QkvProj
from .gpt_oss import GptOssExperts, GptOssRouter
from .kernels import KernelSet
from .linear_attention import (
    LinearCoreAttention,
    LinearOProj,
    LinearQkvProj,
    SplitLinearQkvProj,
)
from .mla import MlaCoreAttention, MlaOProj, MlaQkvProj, MlaRope
from .mlp import DownProj, Experts, GateUpProj, Router, SharedExpert, router_class
from .ops import (
    ACTIVATIONS,
    AttnNorm,
    Embed,
    FfnNorm,
    FinalNorm,
    LmHead,
    OpContext,
    Operator,
    Sample,
)
from .quant import weight_formats
from .rope import ROPE_TYPES, Rope
from .tensor_parallel import Shard, TPComm
from .weights import TensorSource

# The families whose operators the runtime implements (planning covers gpt_oss too).
RUNTIME_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma3_text",
    "qwen3_next",
    "qwen3_5_moe",
    "qwen3_5",
    "qwen3_vl",
    "qwen3_vl_moe",
    "deepseek_v3",
    "gpt_oss",
    "minimax_m2",
    "glm4_moe",
    "glm4_moe_lite",
)
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class OpRef(NamedTuple):
    """One position in the operator sequence: ``(layer index or None, operator name)``."""

    layer: int | None
    name: str


ModelLike = ModelSpec | str | Path | Mapping[str, Any]


def model_spec(model: ModelLike) -> ModelSpec:
    """The cost model's description of a model: given, or from a folder, file or config dict."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Mapping):
        return model_spec_from_config(model)
    return load_model(model)


def check_runtime_support(model: ModelSpec) -> None:
    """Raise :class:`UnsupportedModelError` for a family the runtime's operators do not cover."""
    if model.family not in RUNTIME_FAMILIES:
        raise UnsupportedModelError(
            f"the runtime does not implement {model.family} models (planning and estimates "
            f"cover them); it runs {', '.join(RUNTIME_FAMILIES)}"
        )
    check_precision(model)
    arch = model.arch
    if arch.hidden_act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"hidden_act: the runtime implements {', '.join(ACTIVATIONS)}, not {arch.hidden_act!r}"
        )
    moe = arch.moe
    if moe is not None and moe.num_groups > 1 and moe.num_experts < 2 * moe.num_groups:
        # transformers' DeepseekV3TopkRouter and vLLM's grouped_topk (with the noaux_tc bias)
        # take each group's top two scores
        raise UnsupportedModelError(
            f"n_group: {moe.num_groups} groups of one expert; group-limited routing ranks a "
            "group by its two best experts, so a group needs at least 2"
        )
    for kind, rope in arch.rope.items():
        if rope.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rope.rope_type!r} is not implemented (of the {kind} layers; "
                f"{', '.join(ROPE_TYPES)} are)"
            )


def check_precision(model: ModelSpec) -> None:
    """Raise :class:`UnsupportedModelError` for weights or a KV cache the runtime cannot hold:
    a weight format no device has a kernel for, or ``--quant`` asking to quantise at serving
    time (the runtime serves a checkpoint in the format it is stored in)."""
    precision = model.precision
    if precision.quantized:
        formats = {r.scheme.format for r in precision.rules}
        missing = sorted(formats - set(weight_formats()))
        if missing:
            raise UnsupportedModelError(
                f"the runtime does not run {'+'.join(missing)} weights yet ({precision.source}; "
                f"planning and estimates cover them); it serves "
                f"{', '.join(weight_formats())} checkpoints, or unquantised ones"
            )
        if precision.source.startswith("--quant"):
            raise UnsupportedModelError(
                f"{precision.source.split(':')[0]}: the runtime serves a checkpoint in the format "
                "it is stored in and does not quantise one while loading; quantise the "
                "checkpoint, or drop --quant"
            )


def compute_dtype(model: ModelSpec, dtype: torch.dtype | str | None = None) -> torch.dtype:
    """The dtype operators compute in: ``dtype`` if given, else the config's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype or model.arch.dtype).removeprefix("torch.")
    if name not in COMPUTE_DTYPES:
        raise UnsupportedModelError(
            f"the runtime computes in {', '.join(COMPUTE_DTYPES)}, not {name}; pass a dtype"
        )
    return COMPUTE_DTYPES[name]


def layer_operator_names(model: ModelLike, layer: int) -> tuple[str, ...]:
    """Operator names of one decoder layer, in execution order."""
    return tuple(op.name for op in model_spec(model).layers[layer].ops)


def operator_sequence(model: ModelLike) -> list[OpRef]:
    """The whole decode sequence of a model (a spec, a config dict, or a folder / config path).

    >>> seq = operator_sequence({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
    ...     "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 512})
    >>> [op.name for op in seq]  # doctest: +NORMALIZE_WHITESPACE
    ['embed', 'attn_norm', 'qkv_proj', 'rope', 'core_attn', 'o_proj', 'ffn_norm', 'gate_up_proj',
     'down_proj', 'final_norm', 'lm_head', 'sample']
    """
    return [OpRef(op.layer, op.name) for op in model_spec(model).operators]


_MODEL_OPS: dict[str, type[Operator]] = {
    "embed": Embed,
    "final_norm": FinalNorm,
    "lm_head": LmHead,
    "sample": Sample,
}
_LAYER_OPS: dict[str, type[Operator]] = {
    "attn_norm": AttnNorm,
    "qkv_proj": QkvProj,
    "rope": Rope,
    "core_attn": CoreAttention,
    "o_proj": OProj,
    "ffn_norm": FfnNorm,
    "gate_up_proj": GateUpProj,
    "down_proj": DownProj,
    "router": Router,
    "experts": Experts,
    "shared_expert": SharedExpert,
}
_LINEAR_OPS: dict[str, type[Operator]] = {
    "qkv_proj": LinearQkvProj,
    "core_attn": LinearCoreAttention,
    "o_proj": LinearOProj,
}
_MLA_OPS: dict[str, type[Operator]] = {
    "qkv_proj": MlaQkvProj,
    "rope": MlaRope,
    "core_attn": MlaCoreAttention,
    "o_proj": MlaOProj,
}


def build_operator(
    model: ModelSpec,
    ckpt: TensorSource,
    ref: tuple[int | None, str],
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype | str | None = None,
    shard: Shard | None = None,
    comm: TPComm | None = None,
    kernels: KernelSet | None = None,
) -> Operator:
    """Construct one operator, reading only its own tensors (its shard of them) from ``ckpt``,
    with the kernels of ``kernels`` where they apply (operators built with one
    :class:`~.kernels.KernelSet` share its state, e.g. one block table)."""
    ctx = OpContext(
        model.arch,
        ckpt,
        torch.device(device),
        compute_dtype(model, dtype),
        shard or Shard(),
        comm,
        kernels,
    )
    return operator_from(model, ctx, OpRef(*ref))


def operator_from(model: ModelSpec, ctx: OpContext, ref: OpRef) -> Operator:
    check_runtime_support(model)
    layer, name = ref
    if layer is None:
        cls = _MODEL_OPS.get(name)
    else:
        if not 0 <= layer < model.num_layers or name not in layer_operator_names(model, layer):
            raise UnsupportedModelError(
                f"layer {layer} of this {model.family} model has no operator {name!r}"
            )
        arch = model.arch
        if arch.layer_types[layer] == LINEAR_ATTENTION:
            cls = _LINEAR_OPS.get(name)
            if name == "qkv_proj" and arch.linear_attn and arch.linear_attn.split_projections:
                cls = SplitLinearQkvProj
        elif arch.mla is not None:
            cls = _MLA_OPS.get(name)
        else:
            cls = None
        if cls is None and arch.moe is not None and arch.moe.expert_bias:  # gpt-oss
            cls = {"router": GptOssRouter, "experts": GptOssExperts}.get(name)
        if cls is None and name == "router" and arch.moe is not None:
            cls = router_class(arch.moe)
        cls = cls or _LAYER_OPS.get(name)
    if cls is None:
        raise UnsupportedModelError(f"unknown operator {ref}")
    if ctx.kernels is None:
        return cls(ctx, layer)
    op = ctx.kernels.operator_class(cls, model, ctx, layer)(ctx, layer)
    ctx.kernels.finish(op)
    return op
