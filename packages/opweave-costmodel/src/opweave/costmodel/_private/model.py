"""ModelSpec: a decoder-only LLM as the sequence of operators one decode step runs.

Every operator carries the four quantities the cost model needs, as functions of batch ``b`` and
context ``s``: resident weight bytes, bytes moved, FLOPs, and per-request state (KV cache,
sliding-window KV, recurrent state). Names follow the vocabulary of DESIGN.md.
"""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from pydantic import Field

from .architecture import Architecture
from .base import Frozen
from .precision import Precision

OperatorName = Literal[
    "embed",
    "attn_norm",
    "qkv_proj",
    "rope",
    "core_attn",
    "o_proj",
    "ffn_norm",
    "gate_up_proj",
    "down_proj",
    "router",
    "experts",
    "shared_expert",
    "final_norm",
    "lm_head",
    "sample",
]


class OpClass(StrEnum):
    """Bottleneck class of an operator (DESIGN.md)."""

    ATTENTION = "attention"
    GEMM = "gemm"
    SMALL = "small"


class AttentionKind(StrEnum):
    FULL = "full"
    SLIDING = "sliding"
    LINEAR = "linear"


class TPCollective(StrEnum):
    """Collective a tensor-parallel group runs after the operator."""

    NONE = "none"
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"


class MoESpec(Frozen):
    num_experts: int = Field(description="Routed experts per MoE layer.")
    top_k: int = Field(description="Experts each token is routed to.")
    expert_weight_bytes: int = Field(description="Weight bytes of one routed expert.")
    intermediate_size: int = Field(
        default=0, ge=0, description="Intermediate channels of one routed expert; 0: not known."
    )
    shared_expert_intermediate_size: int = Field(default=0, description="0 when there is none.")


class LinearShape(Frozen):
    """One matmul weight inside an operator, named as the checkpoint names it."""

    module: str = Field(
        description="Module path in the checkpoint, relative to the decoder layer for layer "
        "operators ('self_attn.q_proj', 'mlp.experts.down_proj') and to the model otherwise "
        "('lm_head'). A module split between operators (MLA's kv_b_proj: its key half in "
        "qkv_proj, its value half in o_proj) appears in each with its share of out_features."
    )
    in_features: int = Field(ge=1)
    out_features: int = Field(ge=1)
    count: int = Field(default=1, ge=1, description="Copies of it (routed experts of a layer).")

    @property
    def params(self) -> int:
        return self.in_features * self.out_features * self.count


class OperatorSpec(Frozen):
    """One operator of one layer (or of the model's start/end), unsharded."""

    name: OperatorName
    op_class: OpClass
    layer: int | None = Field(
        default=None, description="Decoder layer index; None for embed/head ops."
    )
    weight_bytes: int = Field(
        default=0, description="Resident weight bytes (all experts for `experts`)."
    )
    weight_bytes_read_per_token: float | None = Field(
        default=None,
        description="Set for gathers (embed): a step reads only the rows its tokens use.",
    )
    flops_per_token: float = Field(default=0.0, description="Context-independent FLOPs per token.")
    attn_flops_per_context_token: float = Field(
        default=0.0, description="core_attn FLOPs per token per attended context position."
    )
    state_bytes_per_context_token: float = Field(
        default=0.0, description="KV bytes a request holds per context token (full or sliding)."
    )
    fp8_state_bytes_per_context_token: float | None = Field(
        default=None,
        description="KV bytes per context token in an FP8 cache whose layout is not one byte a "
        "value (DSA's fp8_ds_mla record); None = one byte a value.",
    )
    state_window_tokens: int | None = Field(
        default=None, description="Sliding window; None = unbounded."
    )
    state_bytes_fixed: float = Field(
        default=0.0, description="Context-independent state per request."
    )
    sparse_attended_tokens: int | None = Field(
        default=None,
        description="DSA: attention reads and computes over at most this many of the held "
        "context tokens (the indexer's top-k); None = all it holds.",
    )
    index_bytes_per_context_token: float = Field(
        default=0.0,
        description="DSA: the indexer's key cache per context token, held and read over the "
        "whole context (always FP8 with its scales, whatever the KV-cache dtype).",
    )
    index_flops_per_context_token: float = Field(
        default=0.0,
        description="DSA: the indexer's scoring FLOPs per token per context position, run "
        "whole on every tensor-parallel rank.",
    )
    activation_bytes_per_token: float = Field(
        default=0.0, description="Activation bytes read and written per token (HBM traffic)."
    )
    boundary_bytes_per_token: float = Field(
        default=0.0,
        description="Bytes per token that cross a stage cut placed right after this op.",
    )
    shard_units: int | None = Field(
        default=None,
        description="Heads the op shards over under tensor parallelism (state/compute per rank "
        "is ceil(units/tp)/units); None for finely divisible GEMMs.",
    )
    tp_sharded: bool = Field(
        default=True, description="False: replicated on every TP rank (norms)."
    )
    tp_collective: TPCollective = TPCollective.NONE
    tp_collective_bytes_per_token: float = 0.0
    kernels: int = Field(
        default=1, description="Kernel launches per execution (for launch overhead)."
    )
    side_stream: bool = Field(
        default=False,
        description="Runs on a second stream beside the routed experts in a decode step (the "
        "shared experts, in vLLM, SGLang and TensorRT-LLM): its kernels' fixed costs hide under "
        "the routed experts' longer path; its bytes still share the memory.",
    )
    tp_replicated_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of the weights, FLOPs and activation traffic every tensor-parallel "
        "rank holds and runs whole (MLA's down-projections are replicated linears in vLLM).",
    )
    state_tp_replicated: bool = Field(
        default=False,
        description="Every tensor-parallel rank holds and reads the whole state: MLA's latent "
        "cache is one vector per token shared by all heads (compute still splits by heads).",
    )
    moe: MoESpec | None = None
    linears: tuple[LinearShape, ...] = Field(
        default=(),
        description="The matmul weights among weight_bytes (what a quantised checkpoint stores "
        "in its weight format); norms, biases and other parameters are not listed.",
    )
    weight_format: str | None = Field(
        default=None,
        description="Weight format of its quantised linears (precision.py); None: every weight "
        "in the compute dtype.",
    )
    quantized_flops_per_token: float = Field(
        default=0.0,
        description="The share of flops_per_token its quantised linears compute (the GEMMs "
        "that run at the weight format's rate).",
    )
    tied_to: str | None = Field(default=None, description="Key of a weight shared with another op.")
    fp32_math: bool = Field(
        default=False,
        description="Its math runs in float32 (a model computing in float32), at the device's "
        "FP32 rate (HardwareSpec.fp32_flops_per_s) instead of its dense tensor rate.",
    )

    def alone(self) -> OperatorSpec:
        """This operator as it runs by itself on the main stream (as a profiler times it, or
        split from the routed experts it would run beside): no ``side_stream`` overlap."""
        return self.model_copy(update={"side_stream": False}) if self.side_stream else self

    @property
    def key(self) -> str:
        """Stable identifier: ``"L12.core_attn"`` or ``"embed"``."""
        return self.name if self.layer is None else f"L{self.layer}.{self.name}"

    @property
    def holds_state(self) -> bool:
        return self.state_bytes_per_context_token > 0 or self.state_bytes_fixed > 0

    def attended_tokens(self, context: ArrayLike) -> NDArray[np.float64]:
        s = np.asarray(context, dtype=np.float64)
        if self.state_window_tokens is None:
            return s
        return np.minimum(s, float(self.state_window_tokens))

    def read_tokens(self, context: ArrayLike) -> NDArray[np.float64]:
        """Context positions attention reads: those it holds, at most the DSA top-k."""
        held = self.attended_tokens(context)
        if self.sparse_attended_tokens is None:
            return held
        return np.minimum(held, float(self.sparse_attended_tokens))

    def state_bytes(self, context: ArrayLike) -> NDArray[np.float64]:
        """Per-request resident state at context length ``s``."""
        return (
            self.state_bytes_per_context_token * self.attended_tokens(context)
            + self.index_bytes_per_context_token * np.asarray(context, dtype=np.float64)
            + self.state_bytes_fixed
        )

    def weight_bytes_read(self, batch: ArrayLike) -> NDArray[np.float64]:
        """Weight bytes one step reads: routed experts only load the experts tokens hit.

        With ``b`` tokens each picking ``k`` of ``E`` experts uniformly, the expected number of
        distinct experts touched is ``E * (1 - (1 - k/E)^b)``.
        """
        b = np.asarray(batch, dtype=np.float64)
        if self.weight_bytes_read_per_token is not None:
            return np.minimum(b * self.weight_bytes_read_per_token, float(self.weight_bytes))
        if self.moe is None:
            return np.full_like(b, float(self.weight_bytes))
        e, k = self.moe.num_experts, self.moe.top_k
        touched = e * (1.0 - (1.0 - k / e) ** b)
        return touched * self.moe.expert_weight_bytes

    def state_bytes_read(self, context: ArrayLike) -> NDArray[np.float64]:
        """State traffic per request per step: KV is read; recurrent state is read and written."""
        kv = self.state_bytes_per_context_token * self.read_tokens(context)
        index = self.index_bytes_per_context_token * np.asarray(context, dtype=np.float64)
        return kv + index + 2.0 * self.state_bytes_fixed

    def bytes_moved(self, batch: ArrayLike, context: ArrayLike) -> NDArray[np.float64]:
        b = np.asarray(batch, dtype=np.float64)
        return (
            self.weight_bytes_read(b)
            + b * self.activation_bytes_per_token
            + b * self.state_bytes_read(context)
        )

    def flops(self, batch: ArrayLike, context: ArrayLike) -> NDArray[np.float64]:
        b = np.asarray(batch, dtype=np.float64)
        return b * (
            self.flops_per_token + self.attn_flops_per_context_token * self.read_tokens(context)
        ) + self.index_flops(b, context)

    def index_flops(self, batch: ArrayLike, context: ArrayLike) -> NDArray[np.float64]:
        """The DSA indexer's share of :meth:`flops` (replicated over tensor-parallel ranks)."""
        return (
            np.asarray(batch, dtype=np.float64)
            * self.index_flops_per_context_token
            * np.asarray(context, dtype=np.float64)
        )


class LayerSpec(Frozen):
    index: int
    attention: AttentionKind
    window_tokens: int | None = None
    moe: bool = False
    ops: tuple[OperatorSpec, ...]

    @property
    def signature(self) -> tuple[object, ...]:
        """What makes two layers interchangeable for planning (same ops, same costs)."""
        return (
            self.attention,
            self.window_tokens,
            tuple(
                (
                    o.name,
                    o.weight_bytes,
                    o.flops_per_token,
                    o.state_bytes_per_context_token,
                    o.index_bytes_per_context_token,
                    o.weight_format,
                )
                for o in self.ops
            ),
        )


class PartitionBlock(Frozen):
    """The smallest repeating, layer-aligned operator pattern (paper §4, appendix B.1).

    The block repeats from layer ``prefix_layers`` on. Leading layers that differ only in their
    feed-forward (DeepSeek-V3's dense layers before the MoE ones) form the prefix: each is cut
    as the block layer it aligns with (``(i - prefix_layers) mod period_layers``), operator by
    operator of the same name, so a template's per-kind cut patterns hold for it too.
    """

    period_layers: int = Field(description="Layers per block.")
    num_full_blocks: int
    remainder_layers: int = Field(description="Layers of a trailing partial block.")
    op_names: tuple[OperatorName, ...] = Field(description="Operator sequence of one block.")
    op_layers: tuple[int, ...] = Field(description="Layer offset (0..period-1) of each op.")
    prefix_layers: int = Field(
        default=0, description="Irregular leading layers before the first block."
    )

    def block_layer(self, layer: int) -> tuple[int, int]:
        """``(block index, offset in the block)`` of a layer; prefix layers have negative
        block indices."""
        return divmod(layer - self.prefix_layers, self.period_layers)


class ModelSpec(Frozen):
    """A model as the cost model, planner and runtime see it."""

    name: str
    family: str = Field(
        description="The family the config resolved to (the text model's model_type, or the "
        "family its architecture names: Kimi-K2 is deepseek_v3)."
    )
    dtype: str
    bytes_per_param: float
    hidden_size: int
    vocab_size: int
    num_layers: int
    max_context_tokens: int
    pre_ops: tuple[OperatorSpec, ...]
    layers: tuple[LayerSpec, ...]
    post_ops: tuple[OperatorSpec, ...]
    block: PartitionBlock
    config_sha256: str = Field(description="Digest of the normalised source config.")
    arch: Architecture = Field(description="What the operators compute (the runtime's numerics).")
    precision: Precision = Field(
        default_factory=Precision,
        description="Weight formats and KV-cache dtype the model is served in.",
    )
    encoders_not_costed: tuple[str, ...] = Field(
        default=(),
        description="A multimodal checkpoint's encoder configs (e.g. vision_config): only its "
        "text model is costed, as vLLM serves it with --language-model-only.",
    )

    config_defaults: tuple[str, ...] = Field(
        default=(),
        description="Sizes the config leaves out, as key=value: read at the family's "
        "defaults, as transformers and vLLM load the config.",
    )

    @property
    def notes(self) -> tuple[str, ...]:
        """What the figures assume about the model beyond its config's own keys, in words."""
        defaults = None
        if self.config_defaults:
            pairs = [d.split("=", 1) for d in self.config_defaults]
            defaults = (
                f"model: config.json does not set {', '.join(k for k, _ in pairs)}; costed at "
                f"transformers' {self.family} defaults ({', '.join(v for _, v in pairs)}), as "
                "vLLM loads it; set them if the checkpoint differs"
            )
        return tuple(n for n in (self.scope_note, defaults) if n)

    @property
    def scope_note(self) -> str | None:
        """What a multimodal checkpoint's figures leave out, in words (None: nothing)."""
        if not self.encoders_not_costed:
            return None
        named = ", ".join(self.encoders_not_costed)
        return (
            f"model: the text model of a multimodal checkpoint: its encoders ({named}) are not "
            "costed, as vLLM serves it with --language-model-only; without that flag their "
            "weights take memory too"
        )

    @cached_property
    def operators(self) -> tuple[OperatorSpec, ...]:
        """All operators of one decode step, in execution order."""
        ops = list(self.pre_ops)
        for layer in self.layers:
            ops.extend(layer.ops)
        ops.extend(self.post_ops)
        return tuple(ops)

    @property
    def weight_bytes(self) -> int:
        """Resident weights; a tied embedding/head counts once."""
        seen: set[str] = set()
        total = 0
        for op in self.operators:
            if op.tied_to is not None:
                if op.tied_to in seen:
                    continue
                seen.add(op.tied_to)
            total += op.weight_bytes
        return total

    @property
    def gemm_flops_per_token(self) -> float:
        """FLOPs per token of every non-attention operator (active parameters only)."""
        return float(sum(o.flops_per_token for o in self.operators if o.name != "core_attn"))

    @property
    def attention_ops(self) -> tuple[OperatorSpec, ...]:
        return tuple(o for o in self.operators if o.holds_state)

    def state_bytes_per_request(self, context: ArrayLike) -> NDArray[np.float64]:
        """KV + recurrent state one request holds at context ``s`` (vectorised over ``s``)."""
        s = np.asarray(context, dtype=np.float64)
        total = np.zeros_like(s)
        for op in self.attention_ops:
            total = total + op.state_bytes(s)
        return total

    def attention_bytes_per_request(self, context: ArrayLike) -> NDArray[np.float64]:
        """State traffic one request causes per decode step (the attention memory term)."""
        s = np.asarray(context, dtype=np.float64)
        total = np.zeros_like(s)
        for op in self.attention_ops:
            total = total + op.state_bytes_read(s)
        return total

    def attention_flops_per_request(self, context: ArrayLike) -> NDArray[np.float64]:
        """FLOPs of the state-holding operators for one request per decode step."""
        s = np.asarray(context, dtype=np.float64)
        total = np.zeros_like(s)
        for op in self.attention_ops:
            total = total + op.flops(1.0, s)
        return total
