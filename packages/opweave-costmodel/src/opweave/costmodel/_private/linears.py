"""The matmul weights of each layer operator, named as a family's checkpoints name them.

:class:`~.model.LinearShape` paths are relative to the decoder layer and come from the
family's :class:`~.registry.CheckpointNames`; the shapes come from the
:class:`~.architecture.Architecture`. A weight format (FP8 blocks, NVFP4 groups, ...) applies
per linear, so the shapes here are what a quantised checkpoint's bytes are computed from.
Norms, biases, convolutions and other parameters are not linears.

>>> from opweave.costmodel import load_model
>>> experts = next(op for op in load_model("deepseek-v3").layers[3].ops if op.name == "experts")
>>> [(linear.module, linear.count) for linear in experts.linears][:2]
[('mlp.experts.gate_proj', 256), ('mlp.experts.up_proj', 256)]
"""

from __future__ import annotations

from .architecture import Architecture
from .model import LinearShape
from .registry import CheckpointNames

Linears = tuple[LinearShape, ...]


def _lin(module: str, in_features: int, out_features: int, count: int = 1) -> LinearShape:
    return LinearShape(
        module=module, in_features=in_features, out_features=out_features, count=count
    )


def softmax_attention(a: Architecture, names: CheckpointNames) -> tuple[Linears, Linears]:
    """``(qkv_proj, o_proj)`` of a GQA layer (q_proj doubled by an output gate)."""
    h, nq, nkv, d, m = a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, names.attention
    q_out = nq * d * (2 if a.attn_output_gate else 1)
    qkv = (_lin(f"{m}.q_proj", h, q_out), _lin(f"{m}.k_proj", h, nkv * d))
    return (*qkv, _lin(f"{m}.v_proj", h, nkv * d)), (_lin(f"{m}.o_proj", nq * d, h),)


def linear_attention(a: Architecture, names: CheckpointNames) -> tuple[Linears, Linears]:
    """``(qkv_proj, o_proj)`` of a gated-DeltaNet layer: Qwen3-Next fuses the input
    projections into ``in_proj_qkvz`` and ``in_proj_ba``; Qwen3.5 ships four."""
    la, h, m = a.linear_attn, a.hidden_size, names.linear_attention
    assert la is not None
    qk, v, nv = 2 * la.key_dim, la.value_dim, la.num_v_heads
    if names.gdn_split_projections:
        inputs: Linears = (
            _lin(f"{m}.in_proj_qkv", h, qk + v),
            _lin(f"{m}.in_proj_z", h, v),
            _lin(f"{m}.in_proj_b", h, nv),
            _lin(f"{m}.in_proj_a", h, nv),
        )
    else:
        inputs = (_lin(f"{m}.in_proj_qkvz", h, qk + 2 * v), _lin(f"{m}.in_proj_ba", h, 2 * nv))
    return inputs, (_lin(f"{m}.out_proj", v, h),)


def dense_ffn(a: Architecture, names: CheckpointNames) -> tuple[Linears, Linears]:
    """``(gate_up_proj, down_proj)`` of a dense feed-forward layer."""
    h, inter, m = a.hidden_size, a.intermediate_size, names.mlp
    gate_up = (_lin(f"{m}.gate_proj", h, inter), _lin(f"{m}.up_proj", h, inter))
    return gate_up, (_lin(f"{m}.down_proj", inter, h),)


def moe_ffn(a: Architecture, names: CheckpointNames) -> tuple[Linears, Linears, Linears]:
    """``(router, experts, shared_expert)`` of a sparse layer; the routed experts' linears
    have ``count`` = the number of experts."""
    moe, h, m = a.moe, a.hidden_size, names.moe
    assert moe is not None
    e, inter, shared = moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
    gate, up, down = names.experts
    ups = (
        (_lin(f"{m}.experts.{names.fused_gate_up}", h, 2 * inter, e),)
        if names.fused_gate_up
        else (_lin(f"{m}.experts.{gate}", h, inter, e), _lin(f"{m}.experts.{up}", h, inter, e))
    )
    experts = (*ups, _lin(f"{m}.experts.{down}", inter, h, e))
    s = f"{m}.{names.shared_expert}"
    shared_linears: Linears = ()
    if shared:
        shared_linears = (
            _lin(f"{s}.gate_proj", h, shared),
            _lin(f"{s}.up_proj", h, shared),
            _lin(f"{s}.down_proj", shared, h),
        )
        if moe.shared_expert_gate and names.shared_expert_gate:
            shared_linears += (_lin(f"{m}.{names.shared_expert_gate}", h, 1),)
    return (_lin(f"{m}.{names.router}", h, e),), experts, shared_linears
