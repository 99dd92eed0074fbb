"""Multi-head latent attention (DeepSeek-V3, Kimi-K2) at decode time, in its absorbed form.

A token's cache entry is one compressed latent ``c_KV`` (``kv_lora_rank`` values) and one
decoupled RoPE key (``qk_rope_head_dim``), shared by every head (DeepSeek-V2, arXiv:2405.04434,
§2.1.2-2.1.3). Decode never expands the cache into per-head keys and values: vLLM's MLA
backends absorb ``W_UK`` (``kv_b_proj``'s key half) into the query and apply ``W_UV`` (its value
half) after attention -- the "data-movement friendly approach" of
``vllm/v1/attention/backends/mla/common.py`` -- so attention is multi-query attention over the
latent. The operators:

- ``qkv_proj``: ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or one ``q_proj``),
  ``kv_a_proj_with_mqa`` -> ``kv_a_layernorm``, and ``q_nope`` times ``W_UK`` per head (a batched
  GEMM over the heads) into the latent space;
- ``rope``: on ``q_pe`` and the token's ``k_pe``;
- ``core_attn``: per context token and head, a score over ``kv_lora_rank + qk_rope_head_dim``
  values and a weighted sum of the ``kv_lora_rank`` latent: ``2 (L + R) + 2 L`` FLOPs, while the
  cache is read once for all heads;
- ``o_proj``: the output times ``W_UV`` per head, then ``o_proj``.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; ``Architecture.sparse_index``) adds a lightning
indexer to a layer: ``wq_b`` (``q_lora_rank`` to ``index_n_heads x index_head_dim``), ``wk``
(hidden to one ``index_head_dim`` key) with a LayerNorm, and ``weights_proj`` (hidden to one
weight per index head, kept in BF16 by the checkpoints) in ``qkv_proj``; in ``core_attn`` it
scores every cached token, ``2 x index_n_heads x index_head_dim`` FLOPs a position, over its own
key cache of ``index_head_dim`` FP8 values and an FP32 scale per 128 (132 bytes a token and layer
for DeepSeek-V3.2, as vLLM's indexer cache holds it, whatever the KV-cache dtype), and MLA then
reads and attends only the ``index_topk`` tokens it selects (DeepSeek-V3.2-Exp report,
arXiv:2512.02556, §2; transformers ``DeepseekV32Indexer``). The indexer runs whole on every
tensor-parallel rank (vLLM builds its linears replicated). A layer of GLM-5.2 whose
``indexer_types`` entry is ``shared`` reuses another layer's selection: no indexer of its own.

Tensor parallelism splits the heads but not the latent: vLLM builds the MLA cache with one KV
head (``MLAAttentionSpec``), so every rank holds and reads the whole cache
(``OperatorSpec.state_tp_replicated``) -- why DeepSeek serving uses data-parallel attention.
``q_a_proj`` and ``kv_a_proj_with_mqa`` are ``ReplicatedLinear`` in vLLM's ``deepseek_v2.py``:
every rank runs them whole (``OperatorSpec.tp_replicated_fraction``). The projections carry no
bias there.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from .architecture import Architecture
from .model import LinearShape, OpClass, OperatorName, OperatorSpec, TPCollective
from .registry import CheckpointNames


class OpBuilder(Protocol):
    """What the operator builders share (``families._Builder``)."""

    arch: Architecture
    h: int
    p: float

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
    ) -> OperatorSpec: ...

    def _norm(self, name: OperatorName, layer: int | None, *, boundary: float) -> OperatorSpec: ...


def mla_attention(b: OpBuilder, i: int, names: CheckpointNames) -> tuple[OperatorSpec, ...]:
    """The attention operators of layer ``i`` of an MLA model."""
    a, h = b.arch, b.h
    m = a.mla
    assert m is not None
    nq, lq, lkv = a.num_heads, m.q_lora_rank, m.kv_lora_rank
    nope, rope, v, latent = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.latent_dim
    q_down = h * lq + lq if lq else 0  # q_a_proj + q_a_layernorm
    q_up = (lq or h) * nq * (nope + rope)  # q_b_proj (or q_proj)
    kv_down = h * latent + lkv  # kv_a_proj_with_mqa + kv_a_layernorm
    w_uk = lkv * nq * nope
    dsa = a.sparse_index
    indexed = dsa is not None and i in dsa.indexer_layers
    index_params = 0
    index_linears: tuple[LinearShape, ...] = ()
    if dsa is not None and indexed:
        ni, di = dsa.index_n_heads, dsa.index_head_dim
        index_params = (lq or h) * ni * di + h * di + 2 * di + h * ni  # wq_b, wk, k_norm, weights
        index_linears = (
            LinearShape(
                module=f"{names.attention}.indexer.wq_b", in_features=lq or h, out_features=ni * di
            ),
            LinearShape(module=f"{names.attention}.indexer.wk", in_features=h, out_features=di),
        )
    qkv_params = q_down + q_up + kv_down + w_uk + index_params
    q_absorbed = nq * (lkv + rope)  # the query in the latent space, with its rope part
    attn = names.attention
    q_linears = (
        (
            LinearShape(module=f"{attn}.q_a_proj", in_features=h, out_features=lq),
            LinearShape(module=f"{attn}.q_b_proj", in_features=lq, out_features=nq * (nope + rope)),
        )
        if lq
        else (LinearShape(module=f"{attn}.q_proj", in_features=h, out_features=nq * (nope + rope)),)
    )
    return (
        b._norm("attn_norm", i, boundary=2 * h),
        b._op(
            "qkv_proj",
            OpClass.GEMM,
            i,
            params=qkv_params,
            act=h + 2 * ((lq or 0) + latent) + nq * (nope + rope) + nq * nope + nq * lkv,
            boundary=q_absorbed + latent + h,
            shard_units=nq,
            tp_replicated_fraction=(q_down + kv_down + index_params) / qkv_params,
            # q_a and kv_a as one GEMM (vLLM's fused_qkv_a_proj), two norms, q_b, the W_UK bmm;
            # an indexer's wq_b, wk, its LayerNorm and weights_proj
            kernels=(5 if lq else 4) + (4 if indexed else 0),
            linears=(
                *index_linears,
                *q_linears,
                LinearShape(
                    module=f"{attn}.kv_a_proj_with_mqa", in_features=h, out_features=latent
                ),
                # kv_b_proj's rows split between qkv_proj (W_UK) and o_proj (W_UV)
                LinearShape(module=f"{attn}.kv_b_proj", in_features=lkv, out_features=nq * nope),
            ),
        ),
        b._op(
            "rope",
            OpClass.SMALL,
            i,
            flops=6.0 * (nq + 1) * rope,
            act=4.0 * (nq + 1) * rope,
            boundary=q_absorbed + latent + h,
            shard_units=nq,
        ),
        b._op(
            "core_attn",
            OpClass.ATTENTION,
            i,
            flops=0.0,
            attn_flops_per_context_token=nq * (2.0 * latent + 2.0 * lkv),
            state_bytes_per_context_token=latent * b.p,
            state_tp_replicated=True,
            act=q_absorbed + latent + nq * lkv,
            boundary=nq * lkv + h,
            shard_units=nq,
            # the token's latent written into the paged cache (concat_and_cache_mla), then the
            # MLA decode kernel over it; with DSA the index key written, the scores, the top-k
            kernels=2 + (3 if indexed else 0),
            **_sparse_fields(a, indexed),
        ),
        b._op(
            "o_proj",
            OpClass.GEMM,
            i,
            params=lkv * nq * v + nq * v * h,
            act=nq * lkv + 2 * nq * v + 2 * h,
            boundary=h,
            collective=TPCollective.ALLREDUCE,
            collective_elems=h,
            kernels=2,  # the W_UV bmm, then o_proj
            linears=(
                LinearShape(module=f"{attn}.kv_b_proj", in_features=lkv, out_features=nq * v),
                LinearShape(module=f"{attn}.o_proj", in_features=nq * v, out_features=h),
            ),
        ),
    )


def fp8_ds_mla_bytes(a: Architecture) -> float:
    """Bytes a token's latent takes in a DSA layer's FP8 cache: the latent in FP8 with an FP32
    scale per 128 values, the rope key left in BF16 -- vLLM's ``fp8_ds_mla`` record (656 bytes
    for DeepSeek-V3.2: FlashMLASparseBackend.get_kv_cache_shape) and SGLang's NSA FP8 pool alike,
    where a dense MLA layer's FP8 cache holds one byte a value (576)."""
    m = a.mla
    assert m is not None
    return m.kv_lora_rank + 4.0 * math.ceil(m.kv_lora_rank / 128) + 2.0 * m.qk_rope_head_dim


def _sparse_fields(a: Architecture, indexed: bool) -> dict[str, Any]:
    """``core_attn``'s DSA fields: the top-k it attends, and (in a layer with an indexer of its
    own) the indexer's key cache and scoring FLOPs per context token."""
    dsa = a.sparse_index
    if dsa is None:
        return {}
    out: dict[str, Any] = {
        "sparse_attended_tokens": dsa.index_topk,
        "fp8_state_bytes_per_context_token": fp8_ds_mla_bytes(a),
    }
    if indexed:
        d = dsa.index_head_dim
        out["index_bytes_per_context_token"] = d + 4.0 * math.ceil(d / 128)  # FP8 + FP32 scales
        out["index_flops_per_context_token"] = 2.0 * dsa.index_n_heads * d + dsa.index_n_heads
    return out
