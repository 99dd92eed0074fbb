# pyright: reportMissingImports=false
# (vLLM is an optional extra: imported lazily, absent from the locked dev environment)
"""The operators built on vLLM's CPU kernels, each a subclass of the runtime's operator it
stands for (see :mod:`._kernels` for when each applies and how a run enables them).

A kernel-backed operator is built as the runtime's (its weights read from the checkpoint
alike), then set up for its kernel; its contract is the runtime's: the same
:class:`~opweave.runtime.TokenBatch` fields in and out, the same per-request state lifecycle
(``admit``/``free``, ``state_bytes``), the same schedule checks.

Everything here imports vLLM lazily, so this module imports without vLLM installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .._private.attention import CoreAttention
from .._private.batch import TokenBatch
from .._private.linear_attention import LinearCoreAttention
from .._private.mlp import Experts
from .._private.ops import OpContext, Operator

if TYPE_CHECKING:
    from opweave.costmodel import Architecture

_BLOCK_SIZE = 32  # tokens per KV block (the CPU kernels' blocks are multiples of 32)
_MIN_BLOCKS = 8
_GDN_HEAD_DIMS = (64, 128)
_GDN_EPS = 1e-6  # transformers' l2norm eps (the kernel's default is 1e-5)
_MOE_ALIGN = 32
_MOE_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


def vllm_ops() -> Any:
    """vLLM's custom operators (``vllm._custom_ops``), imported on first use."""
    from vllm import _custom_ops

    return _custom_ops


class KernelOperator:
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
        schedule = vllm_ops().cpu_attn_get_scheduler_metadata(
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


class PagedCoreAttention(KernelOperator, CoreAttention):
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
        if arch.attn_sinks:
            return "attention sinks"
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
        ops = vllm_ops()
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


class FusedMoeExperts(KernelOperator, Experts):
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
        ops = vllm_ops()
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

    def _routed(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, static: bool
    ) -> torch.Tensor:
        # row-major strides: a one-row view of EP's received pairs counts as contiguous but
        # keeps the pairs' wider row stride, which the kernel rejects
        if x.stride() != (x.shape[1], 1):
            x = x.clone(memory_format=torch.contiguous_format)
        out = torch.empty_like(x)
        ids = ids.clamp(min=0)  # an expert held elsewhere: held expert 0, at weight zero
        if x.shape[0]:
            vllm_ops().cpu_fused_moe(
                out,
                x,
                self.gate_up,
                self.down,
                None,
                None,
                weights.to(torch.float32).contiguous(),
                ids.to(torch.int32).contiguous(),
                self._act,
                self._isa,
            )
        return out


class ChunkedDeltaRuleAttention(KernelOperator, LinearCoreAttention):
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
        core, _ = vllm_ops().chunk_gated_delta_rule_cpu(
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
KERNEL_OPERATORS: dict[type[Operator], Any] = {
    CoreAttention: PagedCoreAttention,
    Experts: FusedMoeExperts,
    LinearCoreAttention: ChunkedDeltaRuleAttention,
}
