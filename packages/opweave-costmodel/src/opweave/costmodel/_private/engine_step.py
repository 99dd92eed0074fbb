"""One step of a serving engine that mixes prefill chunks with decodes (vLLM V1, SGLang).

A step runs every operator once over the step's tokens: the running requests' decode tokens and
the prefill chunks the scheduler added under its token budget. The cost of each part:

- **GEMMs and other per-token operators** run over all the step's tokens at once, on the
  roofline of :mod:`.parallelism` (weights read once per step, FLOPs at the weight format's
  tensor-core rate, :func:`~.quantize.compute_s`), with their TP collectives and fixed costs.
  ``lm_head`` and ``sample`` run over one position per scheduled request: vLLM's model runner
  computes logits only at ``logits_indices``, the last scheduled token of each request
  (``vllm/v1/worker/gpu_model_runner.py``).
- **attention** over each request's own context: a decode reads its whole KV cache (memory-bound);
  a prefill chunk of ``c`` tokens starting at position ``p`` attends causally, token ``i`` to
  ``p + i`` positions (``min(., window)`` for a sliding window), and reads the cache of the prompt
  so far once. One varlen kernel runs both (FlashAttention's ``flash_attn_varlen_func``, as
  vLLM V1's FlashAttention backend calls it), so each attention operator costs the roofline of
  their summed bytes and FLOPs. Attention FLOPs run on the compute dtype's tensor cores at the
  catalog's efficiency (FlashAttention-3 reaches 740 of the H100's 989 TFLOPS, 75%:
  arXiv:2407.08608 §4.1).
- **multi-head latent attention** prefills in its expanded form: vLLM's MLA backends up-project
  the latent cache into per-head keys and values for prefill (the "compute-friendly approach" of
  ``vllm/v1/attention/backends/mla/common.py``) and attend with ``qk_head_dim`` /
  ``v_head_dim`` heads, while decode attends over the latent (:mod:`.mla`). A chunk after the
  first also up-projects the prompt's earlier latents (that file's context chunks).

An engine that runs steps with prompt chunks eagerly (``HardwareSpec.eager_launch_s``, set by
a host profile: SGLang, TensorRT-LLM) enqueues each of their kernels from the host, ahead of the
GPU: such a step takes the longer of its GPU time and its launches' host time ([EAGER-PREFILL]
in :mod:`.host`). Decode-only steps replay CUDA graphs.

With data-parallel attention each rank runs its own scheduler (one engine core per DP rank in
vLLM); this module costs one rank's step with every rank carrying the same load (the experts
see ``dp`` times its tokens), as ranks step in lockstep to meet in the experts' collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import NDArray

from .fixed_costs import launch_s
from .hardware import HardwareSpec
from .kernel_rates import prefill_attention_fraction
from .model import LayerSpec, ModelSpec, OperatorSpec
from .parallelism import Parallelism, parallel_op_terms_s, weight_bytes_per_gpu
from .roofline import (
    op_bytes_and_flops,
    profile_activation_bytes,
    shard_fraction,
    state_shard_fraction,
)
from .workload import CacheBudget, GraphBatches

# Operators that run over one position per scheduled request, not over every token.
PER_REQUEST_OPS = frozenset({"lm_head", "sample"})
# Token counts up to this are costed exactly; above, on a geometric grid (2% apart) with linear
# interpolation in between: the roofline is piecewise linear in tokens, so the interpolation
# stays within a fraction of a percent of the exact value while the planner's many calls reuse
# the grid's points.
EXACT_TOKENS = 256
GRID_RATIO = 1.02

Chunk = tuple[int, int]  # (start position, tokens) of one prefill chunk


def causal_pairs(start: float, tokens: float, window: float = math.inf) -> float:
    """Query-key pairs a chunk of ``tokens`` prompt tokens from position ``start`` attends:
    token ``i`` (1-based) attends ``min(start + i, window)`` positions.

    >>> causal_pairs(0, 4), causal_pairs(2, 2), causal_pairs(0, 4, window=2)
    (10.0, 7.0, 7.0)
    """
    inside = max(0.0, min(start + tokens, window) - start)
    beyond = (tokens - inside) * window if tokens > inside else 0.0
    return float(inside * start + inside * (inside + 1) / 2 + beyond)


@dataclass(frozen=True)
class AttentionKind:
    """One kind of state-holding operator (full, sliding, linear, MLA) on one rank: its
    per-request bytes and FLOPs as affine functions of the tokens it attends."""

    count: int
    window: float
    fixed_s: float
    bytes_per_request: float  # activations and recurrent-state traffic of one decode
    bytes_per_attended: float  # KV read per attended position
    act_bytes_per_token: float
    flops_per_token: float
    flops_per_attended: float  # decode: per attended position
    prefill_flops_per_pair: float  # prefill: per query-key pair
    prefill_flops_per_prefix_token: float  # MLA: up-projecting an earlier latent per chunk
    kv_bytes_per_token: float  # resident state per attended position
    kv_bytes_fixed: float  # resident state per request
    weight_bytes: float = 0.0  # read once per step (a linear-attention layer's conv weights)
    fp8_math: bool = False  # its FLOPs run on FP8 tensor cores (a DSA indexer's scoring)
    fp32_math: bool = False  # its FLOPs run at the FP32 rate (a model computing in float32)
    head_dim: float = 0.0  # the prefill kernel's head width ([AIC-ATTN]); 0: no such kernel

    def attended(self, context: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.minimum(context, self.window)


def _attention_kind(model: ModelSpec, op: OperatorSpec, tp: int, count: int) -> AttentionKind:
    share, state = shard_fraction(op, tp), state_shard_fraction(op, tp)
    pair = op.attn_flops_per_context_token * share
    prefix = 0.0
    mla = model.arch.mla
    if mla is not None and op.attn_flops_per_context_token > 0:
        heads = model.arch.num_heads * share
        pair = heads * 2.0 * (mla.qk_head_dim + mla.v_head_dim)
        prefix = heads * 2.0 * mla.kv_lora_rank * (mla.qk_nope_head_dim + mla.v_head_dim)
    act = op.activation_bytes_per_token * share
    window = math.inf if op.state_window_tokens is None else float(op.state_window_tokens)
    return AttentionKind(
        count=count,
        window=window,
        fixed_s=0.0,
        bytes_per_request=act + 2.0 * op.state_bytes_fixed * state,
        bytes_per_attended=op.state_bytes_per_context_token * state,
        act_bytes_per_token=act,
        flops_per_token=op.flops_per_token * share,
        flops_per_attended=op.attn_flops_per_context_token * share,
        prefill_flops_per_pair=pair,
        prefill_flops_per_prefix_token=prefix,
        kv_bytes_per_token=op.state_bytes_per_context_token * state,
        kv_bytes_fixed=op.state_bytes_fixed * state,
        weight_bytes=op.weight_bytes * share,
        head_dim=float(model.arch.head_dim),  # MLA's prefill: nope + rope
        fp32_math=op.fp32_math,
    )


def _attention_kinds(
    model: ModelSpec, op: OperatorSpec, tp: int, count: int
) -> list[AttentionKind]:
    """``op``'s attention kinds. A DSA layer's is two: MLA over the top-k tokens (a window of
    ``index_topk`` for what it reads and computes, holding nothing itself), and the indexer
    over the whole context, which holds the layer's cache (the latent and the index keys) and
    scores every position, whole on every rank."""
    kind = _attention_kind(model, op, tp, count)
    if op.sparse_attended_tokens is None:
        return [kind]
    state = state_shard_fraction(op, tp)
    top_k = float(op.sparse_attended_tokens)
    # sparse MLA (FlashMLA's sparse kernels) attends the latent itself in prefill as in
    # decode, the absorbed form: no up-projection of the prompt so far
    sparse = replace(
        kind,
        window=top_k,
        kv_bytes_per_token=0.0,
        prefill_flops_per_pair=kind.flops_per_attended,
        prefill_flops_per_prefix_token=0.0,
        head_dim=float(model.arch.mla.latent_dim) if model.arch.mla else kind.head_dim,
    )
    index = AttentionKind(
        count=count,
        window=math.inf,
        fixed_s=0.0,
        bytes_per_request=0.0,
        bytes_per_attended=op.index_bytes_per_context_token * state,
        act_bytes_per_token=0.0,
        flops_per_token=0.0,
        flops_per_attended=op.index_flops_per_context_token,
        prefill_flops_per_pair=op.index_flops_per_context_token,
        prefill_flops_per_prefix_token=0.0,
        kv_bytes_per_token=(op.state_bytes_per_context_token + op.index_bytes_per_context_token)
        * state,
        kv_bytes_fixed=0.0,
        fp8_math=True,
    )
    return [sparse, index]


def _unique_ops(model: ModelSpec) -> list[tuple[OperatorSpec, int]]:
    """Each distinct operator once, with how many layers run it (layers grouped by their
    signature, as the planner groups them)."""
    first: dict[tuple[object, ...], LayerSpec] = {}
    counts: dict[tuple[object, ...], int] = {}
    for layer in model.layers:
        first.setdefault(layer.signature, layer)
        counts[layer.signature] = counts.get(layer.signature, 0) + 1
    out: list[tuple[OperatorSpec, int]] = [(op, 1) for op in model.pre_ops]
    for signature, layer in first.items():
        out.extend((op, counts[signature]) for op in layer.ops)
    out.extend((op, 1) for op in model.post_ops)
    return out


@dataclass
class EngineStepCost:
    """Step times of one engine (one DP rank of a replica) of ``model`` at ``par`` on
    ``hardware``; build with :meth:`build` and reuse it (it caches per-token costs).

    >>> from opweave.costmodel import default_catalog, load_model
    >>> cost = EngineStepCost.build(load_model("qwen3-32b"), default_catalog().get("h100"),
    ...                             Parallelism(tp=4))
    >>> decode = cost.step_s(np.full(64, 4608.0), [])
    >>> mixed = cost.step_s(np.full(63, 4608.0), [(0, 4096)])
    >>> round(decode * 1e3, 1), mixed > 4 * decode
    (16.3, True)
    """

    model: ModelSpec
    hardware: HardwareSpec
    par: Parallelism
    body: list[tuple[OperatorSpec, int]]
    head: list[tuple[OperatorSpec, int]]
    kinds: list[AttentionKind]
    kernels: int  # launched by one forward (every operator once per layer that runs it)
    # the decode batches replayed as CUDA graphs (None: every decode step is graphed)
    graphs: GraphBatches | None = None
    _memo: dict[tuple[bool, float], float] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, model: ModelSpec, hardware: HardwareSpec, par: Parallelism) -> EngineStepCost:
        body, head, kinds = [], [], []
        ops = _unique_ops(model)
        for op, count in ops:
            if op.holds_state:
                first, *rest = _attention_kinds(model, op, par.tp, count)
                fixed = launch_s(op, hardware) * count
                kinds.extend([replace(first, fixed_s=fixed), *rest])
            elif op.name in PER_REQUEST_OPS:
                head.append((op, count))
            else:
                body.append((op, count))
        kernels = sum(op.kernels * count for op, count in ops)
        return cls(model, hardware, par, body, head, kinds, kernels)

    # -- per-token operators -------------------------------------------------------------------
    def _exact(self, per_request: bool, rank_tokens: float) -> float:
        key = (per_request, rank_tokens)
        got = self._memo.get(key)
        if got is None:
            hw, par, model = self.hardware, self.par, self.model
            ops = self.head if per_request else self.body
            got = sum(
                count
                * sum(parallel_op_terms_s(hw, model, op, par, rank_tokens * par.dp, 0.0).values())
                for op, count in ops
            )
            self._memo[key] = got
        return got

    def _tokens_s(self, per_request: bool, rank_tokens: float) -> float:
        if rank_tokens <= 0:
            return 0.0
        if rank_tokens <= EXACT_TOKENS:
            return self._exact(per_request, float(math.ceil(rank_tokens)))
        k = math.floor(math.log(rank_tokens / EXACT_TOKENS, GRID_RATIO))
        lo = EXACT_TOKENS * GRID_RATIO**k
        hi = lo * GRID_RATIO
        y0, y1 = self._exact(per_request, lo), self._exact(per_request, hi)
        return y0 + (y1 - y0) * (rank_tokens - lo) / (hi - lo)

    def tokens_s(self, tokens: float, requests: float) -> float:
        """Time of every operator but attention in a step of ``tokens`` tokens from
        ``requests`` scheduled requests (one rank)."""
        return self._tokens_s(False, tokens) + self._tokens_s(True, requests)

    # -- attention -----------------------------------------------------------------------------
    def _prefill_work(
        self, kind: AttentionKind, chunks: Sequence[Chunk]
    ) -> tuple[float, float, float]:
        """FLOPs outside the prompt's query-key pairs, FLOPs over those pairs (the prefill
        attention kernel's), and bytes of ``chunks``."""
        flops = pair_flops = num_bytes = 0.0
        for start, tokens in chunks:
            pairs = causal_pairs(start, tokens, kind.window)
            pair_flops += pairs * kind.prefill_flops_per_pair
            flops += tokens * kind.flops_per_token + start * kind.prefill_flops_per_prefix_token
            # the chunk's activations, its recurrent state read and written once, the cache of
            # the prompt so far read once and the chunk's own entries written
            attended = min(start + tokens, kind.window)
            num_bytes += (
                tokens * kind.act_bytes_per_token
                + (kind.bytes_per_request - kind.act_bytes_per_token)
                + attended * kind.bytes_per_attended
                + min(tokens, kind.window) * kind.kv_bytes_per_token
            )
        return flops, pair_flops, num_bytes

    def attention_s(
        self, requests: int, attended: Sequence[NDArray[np.float64]], chunks: Sequence[Chunk]
    ) -> NDArray[np.float64]:
        """Attention time of steps with ``requests`` decodes whose attended positions sum to
        ``attended[k]`` for each kind ``k`` (arrays: one entry per step), plus ``chunks``."""
        hw = self.hardware
        total = np.zeros_like(attended[0]) if attended else np.zeros(1)
        for kind, summed in zip(self.kinds, attended, strict=True):
            pre_flops, pair_flops, pre_bytes = self._prefill_work(kind, chunks)
            num_bytes = requests * kind.bytes_per_request + summed * kind.bytes_per_attended
            num_bytes = num_bytes + (kind.weight_bytes if requests or chunks else 0.0)
            flops = requests * kind.flops_per_token + summed * kind.flops_per_attended
            if kind.fp8_math:
                rate = hw.effective_fp8_flops or hw.effective_flops
            else:
                rate = hw.effective_fp32_flops if kind.fp32_math else hw.effective_flops
            # the prompt's attention at the prefill kernels' measured fraction of the rate (a
            # DSA indexer's FP8 scoring has no such kernel: head_dim 0, the whole rate)
            prefill = prefill_attention_fraction(kind.head_dim, hw)
            seconds = np.maximum(
                (num_bytes + pre_bytes) / hw.effective_bandwidth,
                (flops + pre_flops + pair_flops / prefill) / rate,
            )
            total = total + kind.count * seconds + kind.fixed_s
        return total

    def attended_sums(self, contexts: NDArray[np.float64], steps: int = 1) -> list[NDArray]:
        """Per kind, the attended positions of decodes at ``contexts`` summed, for each of
        ``steps`` consecutive steps (every context one longer each step)."""
        j = np.arange(steps, dtype=np.float64)
        out = []
        ordered = np.sort(contexts)
        prefix = np.concatenate(([0.0], np.cumsum(ordered)))
        n = float(len(contexts))
        for kind in self.kinds:
            if math.isinf(kind.window):
                out.append(prefix[-1] + n * j)
                continue
            # contexts still below the window after j steps count s + j, the rest the window
            below = np.searchsorted(ordered, kind.window - j, side="left")
            out.append(prefix[below] + below * j + (n - below) * kind.window)
        return out

    def prefill_work(self, start: int, tokens: int) -> tuple[float, float]:
        """FLOPs and bytes one GPU of the rank spends on a prefill chunk of ``tokens`` from
        position ``start`` in a step of its own (logits at its last position)."""
        flops = num_bytes = 0.0
        for ops, batch in ((self.body, tokens), (self.head, 1)):
            for op, count in ops:
                b, f = op_bytes_and_flops(op, self.par.tp, batch, 0.0)
                flops += count * f
                num_bytes += count * b
        for kind in self.kinds:
            f, pair_f, b = self._prefill_work(kind, [(start, tokens)])
            flops += kind.count * (f + pair_f)
            num_bytes += kind.count * (b + kind.weight_bytes)
        return flops, num_bytes

    # -- whole steps ---------------------------------------------------------------------------
    def step_s(self, contexts: NDArray[np.float64], chunks: Sequence[Chunk]) -> float:
        """One step: decodes at ``contexts`` (positions each attends, its new token included)
        and prefill ``chunks``."""
        n = len(contexts)
        tokens = n + sum(c for _, c in chunks)
        attn = self.attention_s(n, self.attended_sums(contexts), chunks)
        gpu_s = float(attn[0]) + self.tokens_s(tokens, n + len(chunks))
        if not chunks and not self._eager_decode(n):
            return gpu_s
        return max(gpu_s, self.kernels * self.hardware.eager_launch_s)

    def decode_run_s(self, contexts: NDArray[np.float64], steps: int) -> NDArray[np.float64]:
        """Times of ``steps`` consecutive decode-only steps from ``contexts``."""
        n = len(contexts)
        attn = self.attention_s(n, self.attended_sums(contexts, steps), [])
        gpu_s = attn + self.tokens_s(n, n)
        if not self._eager_decode(n):
            return gpu_s
        return np.maximum(gpu_s, self.kernels * self.hardware.eager_launch_s)

    def _eager_decode(self, requests: int) -> bool:
        """Whether a decode step of ``requests`` runs outside the engine's CUDA graphs."""
        return self.graphs is not None and not self.graphs.graphs(requests)

    # -- memory --------------------------------------------------------------------------------
    def kv_bytes(self, contexts: NDArray[np.float64] | float) -> NDArray[np.float64]:
        """Resident state per GPU of requests at ``contexts`` (each)."""
        s = np.asarray(contexts, dtype=np.float64)
        total = np.zeros_like(s)
        for kind in self.kinds:
            total = total + kind.count * (
                kind.kv_bytes_per_token * np.minimum(s, kind.window) + kind.kv_bytes_fixed
            )
        return total

    def kv_capacity_bytes(
        self, batched_tokens: int, max_num_seqs: int, budget: CacheBudget | None = None
    ) -> float:
        """Memory per GPU left for state: usable memory less the weights and the activations of
        a full step, which vLLM's start-up profile run reserves (``determine_available_memory``
        runs ``max_num_batched_tokens`` dummy tokens, and logits for ``max_num_seqs`` of them:
        :func:`~.roofline.profile_activation_bytes`); or as an engine's ``budget`` says
        (:meth:`.Workload.cache_budget`)."""
        ops = self.model.operators
        weights = weight_bytes_per_gpu(ops, self.par)
        activations = profile_activation_bytes(ops, batched_tokens, max_num_seqs)
        if budget is None:
            return max(0.0, self.hardware.usable_memory_bytes - weights - activations)
        return budget.kv_bytes(self.hardware.memory_bytes, weights, activations)
