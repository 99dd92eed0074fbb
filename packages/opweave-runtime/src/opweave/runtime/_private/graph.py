"""The decode operator sequence of a model, and the factory that builds any one operator.

The sequence is the contract shared with the cost model and planner: a stage of a plan is a
contiguous slice of it, named by ``(layer, op)`` pairs (``layer`` is ``None`` for model-level ops).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import UnsupportedModelError
from .attention import CoreAttention, OProj, QkvProj
from .config import LINEAR, ModelSpec, parse_config
from .linear_attention import LinearCoreAttention, LinearOProj, LinearQkvProj
from .mlp import DownProj, Experts, GateUpProj, Router, SharedExpert
from .ops import AttnNorm, Embed, FfnNorm, FinalNorm, LmHead, Operator, Sample
from .rope import Rope
from .weights import Checkpoint

MODEL_START = ("embed",)
MODEL_END = ("final_norm", "lm_head", "sample")


class OpRef(NamedTuple):
    """One position in the operator sequence: ``(layer index or None, operator name)``."""

    layer: int | None
    name: str


def layer_operator_names(spec: ModelSpec, layer: int) -> tuple[str, ...]:
    """Operator names of one decoder layer, in execution order."""
    names = ["attn_norm", "qkv_proj"]
    if spec.layer_types[layer] != LINEAR:
        names.append("rope")
    names += ["core_attn", "o_proj", "ffn_norm"]
    if spec.is_moe_layer(layer):
        assert spec.moe is not None
        names += ["router", "experts"] + (
            ["shared_expert"] if spec.moe.shared_intermediate_size else []
        )
    else:
        names += ["gate_up_proj", "down_proj"]
    return tuple(names)


def operator_sequence(model: ModelSpec | str | Path | Mapping[str, Any]) -> list[OpRef]:
    """The whole decode sequence of a model (a spec, a config dict, or a folder / config path).

    >>> seq = operator_sequence({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
    ...     "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 512})
    >>> [op.name for op in seq]  # doctest: +NORMALIZE_WHITESPACE
    ['embed', 'attn_norm', 'qkv_proj', 'rope', 'core_attn', 'o_proj', 'ffn_norm', 'gate_up_proj',
     'down_proj', 'final_norm', 'lm_head', 'sample']
    """
    spec = model if isinstance(model, ModelSpec) else parse_config(model)
    seq = [OpRef(None, name) for name in MODEL_START]
    for layer in range(spec.num_layers):
        seq += [OpRef(layer, name) for name in layer_operator_names(spec, layer)]
    seq += [OpRef(None, name) for name in MODEL_END]
    return seq


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


def build_operator(
    spec: ModelSpec, ckpt: Checkpoint, ref: OpRef, device: torch.device | str = "cpu"
) -> Operator:
    """Construct one operator, reading only its own tensors from ``ckpt``."""
    layer, name = ref
    if layer is None:
        cls = _MODEL_OPS.get(name)
    else:
        if not 0 <= layer < spec.num_layers or name not in layer_operator_names(spec, layer):
            raise UnsupportedModelError(
                f"layer {layer} of this {spec.family} model has no operator {name!r}"
            )
        cls = (
            _LINEAR_OPS.get(name) if spec.layer_types[layer] == LINEAR else None
        ) or _LAYER_OPS.get(name)
    if cls is None:
        raise UnsupportedModelError(f"unknown operator {ref}")
    return cls(spec, ckpt, layer, device)
