"""Softmax attention layers: ``qkv_proj``, ``core_attn`` (full or sliding window) and ``o_proj``.

``core_attn`` is the only operator here with per-request state. Full layers keep a growing KV cache;
sliding layers keep a ring buffer of exactly ``sliding_window`` slots, since a query at position
``p`` sees keys ``p - window < k <= p`` (transformers' sliding mask) and older slots are never read.
Keys are stored after RoPE, so slot order within the ring does not matter to the softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from opweave.costmodel import Architecture

from .batch import TokenBatch
from .ops import OpContext, Operator, RMSNorm, StatefulOperator, linear
from .tensor_parallel import Layout, TPComm

_MIN_CAPACITY = 16


class QkvProj(Operator):
    """Projects ``hidden`` to ``q``, ``k``, ``v`` ``[N, heads, head_dim]``, with per-head q/k norms.

    Qwen3-Next's ``q_proj`` is twice as wide: each head's second half is the output gate, passed on
    as ``attn_gate`` for ``core_attn``.
    """

    name, op_class = "qkv_proj", "gemm"
    linear_weights = ("wq", "wk", "wv")
    same_input = (linear_weights,)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        a, hd = self.arch, self.arch.head_dim
        where = f"L{layer}.qkv_proj"
        h0, h1 = self.shard.part(a.num_heads, f"{where}: attention heads")
        k0, k1 = self.shard.heads(a.num_kv_heads, f"{where}: key/value heads")
        self.num_heads, self.num_kv_heads = h1 - h0, k1 - k0
        qblock = hd * (2 if a.attn_output_gate else 1)
        q_rows = [(h0 * qblock, h1 * qblock)] if self.sharded else None
        kv_rows = [(k0 * hd, k1 * hd)] if self.sharded else None
        self.wq, self.bq = self._column_parallel("self_attn.q_proj", q_rows)
        self.wk, self.bk = self._column_parallel("self_attn.k_proj", kv_rows)
        self.wv, self.bv = self._column_parallel("self_attn.v_proj", kv_rows)
        self.q_norm = self.k_norm = None
        self.layer_norms: tuple[WideRMSNorm, WideRMSNorm] | None = None
        if a.qk_norm and a.qk_norm_per_layer:
            # MiniMax-M2: one norm over all heads' queries (keys); each rank holds its heads'
            # weights, a key/value head shared by several ranks counts once
            q_part = [(h0 * hd, h1 * hd)] if self.sharded else None
            q_norm = self._layer_tensor("self_attn.q_norm.weight", ranges=q_part)
            k_norm = self._layer_tensor("self_attn.k_norm.weight", ranges=kv_rows)
            shared_by = self.shard.size * (k1 - k0) // a.num_kv_heads
            self.layer_norms = (
                WideRMSNorm(q_norm, a.rms_norm_eps, a.num_heads * hd, self.comm, 1),
                WideRMSNorm(k_norm, a.rms_norm_eps, a.num_kv_heads * hd, self.comm, shared_by),
            )
        elif a.qk_norm:
            eps, gemma = a.rms_norm_eps, a.gemma_norms
            self.q_norm = RMSNorm(self._layer_tensor("self_attn.q_norm.weight"), eps, gemma=gemma)
            self.k_norm = RMSNorm(self._layer_tensor("self_attn.k_norm.weight"), eps, gemma=gemma)
        if self.sharded:
            self.tp_out = attention_layouts(a)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x = batch["hidden"]
        n, hd = x.shape[0], self.arch.head_dim
        q = linear(x, self.wq, self.bq)
        k = linear(x, self.wk, self.bk)
        if self.layer_norms is not None:
            q, k = self.layer_norms[0](q), self.layer_norms[1](k)
        k = k.view(n, -1, hd)
        v = linear(x, self.wv, self.bv).view(n, -1, hd)
        updates = {}
        if self.arch.attn_output_gate:
            q, gate = torch.chunk(q.view(n, -1, 2 * hd), 2, dim=-1)
            updates["attn_gate"] = gate.reshape(n, -1)
        q = q.reshape(n, -1, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return batch.replace(drop=("hidden",), q=q, k=k, v=v, **updates)


class WideRMSNorm:
    """RMSNorm over a whole layer's queries or keys (``[N, heads * head_dim]``), Llama's rounding.

    Under TP a rank holds ``width / tp`` of the channels: the sum of squares is all-reduced
    (divided by ``shared_by`` where ranks hold copies of the same key/value head), as vLLM's
    MiniMax attention does; without TP it is transformers' own mean.
    """

    def __init__(
        self, weight: torch.Tensor, eps: float, width: int, comm: TPComm | None, shared_by: int
    ) -> None:
        self.weight, self.eps, self.width = weight, eps, width
        self.comm, self.shared_by = comm, shared_by

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float32)
        if self.comm is None:
            variance = y.pow(2).mean(-1, keepdim=True)
        else:
            squares = self.comm.all_reduce(y.pow(2).sum(-1, keepdim=True))
            variance = squares / (self.shared_by * self.width)
        return self.weight * (y * torch.rsqrt(variance + self.eps)).to(x.dtype)


def attention_layouts(arch: Architecture) -> dict[str, Layout]:
    """How ``qkv_proj``'s outputs are sharded: by query heads and key/value heads."""
    heads, kv, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
    return {
        "q": Layout(1, (heads,)),
        "k": Layout(1, (kv,)),
        "v": Layout(1, (kv,)),
        "attn_gate": Layout(1, (heads * hd,)),
    }


class KvCache:
    """How a layer's keys and values are stored: in the compute dtype, or in FP8 E4M3 with a
    scale per tensor (1.0 unless the checkpoint ships ``k_scale``/``v_scale``), stored as
    ``x / scale`` rounded and read back as ``fp8 * scale`` in the compute dtype, as vLLM's
    ``kv_cache_dtype=fp8`` does. Attention always reads what the cache holds, the new tokens'
    keys and values included."""

    def __init__(self, dtype: torch.dtype, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self.dtype = dtype
        self.scales = (k_scale, v_scale)

    @property
    def quantised(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    def store(self, x: torch.Tensor, *, key: bool) -> torch.Tensor:
        if not self.quantised:
            return x
        scale = self.scales[0 if key else 1]
        return (x if scale == 1.0 else x / scale).to(self.dtype)

    def read(self, x: torch.Tensor, dtype: torch.dtype, *, key: bool) -> torch.Tensor:
        if not self.quantised:
            return x
        scale = self.scales[0 if key else 1]
        out = x.to(dtype)
        return out if scale == 1.0 else out * scale

    def round(self, x: torch.Tensor, *, key: bool) -> torch.Tensor:
        """``x`` as the cache will hold it, in ``x``'s dtype."""
        return self.read(self.store(x, key=key), x.dtype, key=key)


class _KvState:
    """One request's keys/values ``[kv_heads, capacity, head_dim]``.

    Capacity doubles as the context grows; with a ``window`` it stops at the window and position
    ``p`` then lives in slot ``p % window`` (before the first wrap, slot ``p`` too, so growing
    never reorders anything).
    """

    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        window: int | None,
        dtype: torch.dtype,
        device: torch.device,
        cache: KvCache | None = None,
    ) -> None:
        capacity = _MIN_CAPACITY if window is None else min(_MIN_CAPACITY, window)
        self.cache = cache or KvCache(dtype)
        stored = self.cache.dtype
        self.k = torch.empty(kv_heads, capacity, head_dim, dtype=stored, device=device)
        self.v = torch.empty_like(self.k)
        self.window = window
        self.length = 0  # tokens seen so far (positions 0..length-1)
        self.dtype = dtype

    def _reserve(self, needed: int) -> None:
        capacity = self.k.shape[1]
        if capacity >= needed:
            return
        capacity = max(needed, 2 * capacity)
        if self.window is not None:
            capacity = min(capacity, self.window)
        for attr in ("k", "v"):
            old = getattr(self, attr)
            new = old.new_empty(old.shape[0], capacity, old.shape[2])
            new[:, : self.length] = old[:, : self.length]
            setattr(self, attr, new)

    def ordered_window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys/values a new token may still see, oldest first (for multi-token steps)."""
        if self.window is None or self.length < self.window:
            return self._read(self.k[:, : self.length], self.v[:, : self.length])
        first = self.length - self.window + 1
        slots = torch.arange(first, self.length, device=self.k.device) % self.window
        return self._read(self.k[:, slots], self.v[:, slots])

    def _read(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.read(k, self.dtype, key=True), self.cache.read(v, self.dtype, key=False)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[kv_heads, n, head_dim]`` for positions ``length .. length+n-1``."""
        k, v = self.cache.store(k, key=True), self.cache.store(v, key=False)
        n = k.shape[1]
        end = self.length + n
        keep = n if self.window is None else min(n, self.window)
        self._reserve(end if self.window is None else min(end, self.window))
        if self.window is None or end <= self.window:
            self.k[:, end - keep : end] = k[:, n - keep :]
            self.v[:, end - keep : end] = v[:, n - keep :]
        else:
            slots = torch.arange(end - keep, end, device=k.device) % self.window
            self.k[:, slots] = k[:, n - keep :]
            self.v[:, slots] = v[:, n - keep :]
        self.length = end

    def visible(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored keys/values (after an append, exactly what a single new query attends to)."""
        used = min(self.length, self.k.shape[1])
        return self._read(self.k[:, :used], self.v[:, :used])


class CoreAttention(StatefulOperator):
    """Softmax attention over each request's cached keys; the operator that holds the KV cache."""

    name, op_class = "core_attn", "attention"
    slab_token_dim = 2  # [rows, kv_heads, capacity, head_dim]

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        assert layer is not None
        a = self.arch
        self.window = a.layer_window(layer)
        where = f"L{layer}.core_attn"
        h0, h1 = self.shard.part(a.num_heads, f"{where}: attention heads")
        k0, k1 = self.shard.heads(a.num_kv_heads, f"{where}: key/value heads")
        self.num_heads, self.num_kv_heads = h1 - h0, k1 - k0
        self.groups = self.num_heads // self.num_kv_heads
        # gpt-oss: a learned logit per head that joins every softmax and is then dropped
        self.sinks = None
        if a.attn_sinks:
            self.sinks = self._layer_tensor("self_attn.sinks", ranges=[(h0, h1)])
        self._states: dict[str, _KvState] = {}
        self.cache = KvCache(ctx.kv_cache_dtype or self.dtype, *self._kv_scales(ctx))
        if self.sharded:
            self.tp_in = attention_layouts(a)
            self.tp_out = {"hidden": Layout(1, (a.num_heads * a.head_dim,))}

        # the static decode step's state: one key and one value slab per layer
        # [rows + 1 (scratch), kv_heads, capacity, head_dim], stacked with the stage's other
        # layers of this window in a SlabPool; a request's _KvState becomes a view of its row
        # when it first decodes that way

    def _kv_scales(self, ctx: OpContext) -> tuple[float, float]:
        """An FP8 cache's key and value scales: the checkpoint's (vLLM's ``self_attn.k_scale``,
        or ModelOpt's ``k_proj.k_scale``), else 1.0."""
        if ctx.kv_cache_dtype is None:
            return 1.0, 1.0
        scales = []
        for kind in ("k", "v"):
            found = 1.0
            for suffix in (f"self_attn.{kind}_scale", f"self_attn.{kind}_proj.{kind}_scale"):
                tensor = self._optional_layer_tensor(suffix)
                if tensor is not None:
                    found = float(tensor.float().reshape(-1)[0])
                    break
            scales.append(found)
        return scales[0], scales[1]

    def _init_state(self, request_id: str) -> None:
        self._states[request_id] = _KvState(
            self.num_kv_heads, self.arch.head_dim, self.window, self.dtype, self.device, self.cache
        )

    def _drop_state(self, request_id: str) -> None:
        del self._states[request_id]

    # -- the static decode step (see .decode) --------------------------------------------------
    def reserve(self, rows: int, tokens: int) -> None:
        """Size the slabs for ``rows`` requests of ``tokens`` tokens (a sliding layer: at most
        its window) up front, so the step's shapes never change while serving."""
        self._grow_slabs(rows + 1, tokens)

    def slab_key(self) -> tuple[object, ...]:
        kv = self.cache.dtype
        return ("kv", self.window, self.num_kv_heads, self.arch.head_dim, kv, self.device)

    def slab_layout(self, rows: int, tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        shape = (rows, self.num_kv_heads, tokens, self.arch.head_dim)
        return [(shape, self.cache.dtype), (shape, self.cache.dtype)]

    def slab_token_limit(self) -> int | None:
        return self.window

    def _states_to_slabs(self) -> None:
        assert self._slabs is not None
        keys, values = self._slabs
        for rid, state in self._states.items():
            if rid not in self._outside:
                row = self._rows[rid]
                state.k, state.v = keys[row], values[row]

    def _grow_slabs_for(self, rows: int, tokens: int, span: int) -> None:
        # one slot of headroom: a span never fills the slab, so a compiled step's trace never
        # sees the two sizes equal (and recompiles when they are not)
        self._grow_slabs(rows, max(tokens, span) + 1)

    def _move_in(self, request_id: str, length: int) -> None:
        assert self._slabs is not None
        keys, values = self._slabs
        state, row = self._states[request_id], self._rows[request_id]
        used = min(length, state.k.shape[1])
        keys[row, :, :used] = state.k[:, :used]
        values[row, :, :used] = state.v[:, :used]
        state.k, state.v = keys[row], values[row]

    def _decode_static(self, batch: TokenBatch) -> TokenBatch:
        """One new token per row, all rows at once: store each row's key/value at its position's
        slot, attend over the row's first ``span`` slots (a sliding layer: its whole ring) with
        the slots past its position masked."""
        assert batch.step is not None and self._slab_pool is not None
        keys, values = self._slab_pool.tensors  # [layers, rows, kv_heads, capacity, head_dim]
        rows, pos = batch.step.rows, batch.step.positions
        layer = self._slab_rows(rows)
        slot = pos if self.window is None else pos % self.window
        keys[layer, rows, :, slot] = self.cache.store(batch["k"], key=True)
        values[layer, rows, :, slot] = self.cache.store(batch["v"], key=False)
        k, v = keys[layer, rows], values[layer, rows]  # [B, kv_heads, capacity, head_dim]
        if self.window is None:  # no row holds a slot past the span (begin_static_step grew them)
            k, v = k.narrow(2, 0, batch.step.span), v.narrow(2, 0, batch.step.span)
        dtype = batch["q"].dtype
        k, v = self.cache.read(k, dtype, key=True), self.cache.read(v, dtype, key=False)
        visible = torch.arange(k.shape[2], device=pos.device)[None, :] <= pos[:, None]
        q = batch["q"][:, :, None, :]  # [B, heads, 1, head_dim]
        if self.sinks is not None:
            k, v = (t.repeat_interleave(self.groups, dim=1) for t in (k, v))
            o = self._softmax_with_sinks(q @ k.transpose(-1, -2), visible[:, None, None, :]) @ v
        elif self.arch.attn_softcap is not None:
            k, v = (t.repeat_interleave(self.groups, dim=1) for t in (k, v))
            cap = self.arch.attn_softcap
            scores = torch.tanh((q @ k.transpose(-1, -2)) * self.arch.attn_scale / cap) * cap
            scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
            o = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        else:
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=visible[:, None, None, :],
                scale=self.arch.attn_scale,
                enable_gqa=self.groups > 1,
            )
        out = o.reshape(o.shape[0], -1)
        if self.arch.attn_output_gate:
            out = out * torch.sigmoid(batch["attn_gate"])
        return batch.replace(drop=("q", "k", "v", "attn_gate"), hidden=out)

    def _state_tensors(self, request_id: str) -> list[torch.Tensor]:
        state = self._states[request_id]
        return [state.k, state.v]

    def state_layout(self, length: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        used = length if self.window is None else min(length, self.window)
        shape = (self.num_kv_heads, used, self.arch.head_dim)
        return [(shape, self.cache.dtype), (shape, self.cache.dtype)]

    def state_shards(self) -> list[Layout | None]:
        heads = Layout(0, (self.arch.num_kv_heads,))  # key/value heads, as Shard.heads cuts them
        return [heads, heads]

    def export_state(self, request_id: str) -> list[torch.Tensor]:
        state = self._states[request_id]
        used = min(state.length, state.k.shape[1])  # a sliding layer's ring as it lies
        return [state.k[:, :used], state.v[:, :used]]

    def _load_state(self, request_id: str, length: int, tensors: Sequence[torch.Tensor]) -> None:
        state = self._states[request_id]
        k, v = tensors
        used = k.shape[1]
        state._reserve(used)
        state.k[:, :used] = k
        state.v[:, :used] = v
        state.length = length

    def forward(self, batch: TokenBatch) -> TokenBatch:
        if batch.step is not None:
            return self._decode_static(batch)
        q, k, v = batch["q"], batch["k"], batch["v"]
        meta = batch.meta
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for i, rid in enumerate(meta.request_ids):
            lo, hi = meta.row_offsets[i], meta.row_offsets[i + 1]
            self._advance(rid, meta.context_lens[i], hi - lo)
            state = self._states[rid]
            state.length = meta.context_lens[i]  # static steps count in _context_lens alone
            held = state.k
            # [n, heads, d] -> [heads, n, d]
            q_r, k_r, v_r = (t[lo:hi].transpose(0, 1) for t in (q, k, v))
            if self.cache.quantised:  # the new tokens are attended to as the cache holds them
                k_r, v_r = self.cache.round(k_r, key=True), self.cache.round(v_r, key=False)
            if hi - lo == 1:
                state.append(k_r, v_r)
                keys, values = state.visible()
                o = self._attend(q_r, keys, values, mask=None)
            else:
                past_k, past_v = state.ordered_window()
                keys, values = torch.cat((past_k, k_r), dim=1), torch.cat((past_v, v_r), dim=1)
                mask = self._mask(state.length, past_k.shape[1], hi - lo)
                state.append(k_r, v_r)
                o = self._attend(q_r, keys, values, mask=mask)
            out[lo:hi] = o.transpose(0, 1).reshape(hi - lo, -1)
            if state.k is not held:  # it outgrew its slab row (or had none): not in the slab
                self._outside.add(rid)
        if self.arch.attn_output_gate:
            out = out * torch.sigmoid(batch["attn_gate"])
        return batch.replace(drop=("q", "k", "v", "attn_gate"), hidden=out)

    def _mask(self, start: int, num_past: int, n: int) -> torch.Tensor | None:
        """Boolean ``[n, num_past + n]`` mask (True = attend) for ``n`` queries after ``start``."""
        if num_past == 0 and (self.window is None or n <= self.window):
            return None  # plain causal
        q_pos = torch.arange(start, start + n, device=self.device)[:, None]
        k_pos = torch.arange(start - num_past, start + n, device=self.device)[None, :]
        mask = k_pos <= q_pos
        if self.window is not None:
            mask &= k_pos > q_pos - self.window
        return mask

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``q [heads, n, d]`` against ``k``/``v`` ``[kv_heads, m, d]``."""
        n = q.shape[1]
        causal = mask is None and n > 1
        if self.sinks is not None:
            if causal:
                mask = torch.ones(n, k.shape[1], dtype=torch.bool, device=q.device).tril()
            k, v = (t.repeat_interleave(self.groups, dim=0) for t in (k, v))
            return self._softmax_with_sinks(q @ k.transpose(-1, -2), mask) @ v
        if self.arch.attn_softcap is not None:
            return self._attend_softcapped(q, k, v, mask, causal)
        if mask is None:
            return F.scaled_dot_product_attention(
                q[None],
                k[None],
                v[None],
                is_causal=causal,
                scale=self.arch.attn_scale,
                enable_gqa=self.groups > 1,
            )[0]
        k, v = (t.repeat_interleave(self.groups, dim=0) for t in (k, v))
        return F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=self.arch.attn_scale
        )[0]

    def _softmax_with_sinks(self, qk: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention weights over the keys with each head's sink logit in the softmax (then
        dropped), so a head may attend to nothing (gpt-oss; transformers' eager path, which
        also subtracts the row maximum first)."""
        assert self.sinks is not None
        scores = qk * self.arch.attn_scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        heads = scores.shape[-3]
        sinks = self.sinks.reshape(heads, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        logits = torch.cat((scores, sinks), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)
        return probs[..., :-1].to(qk.dtype)

    def _attend_softcapped(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """Explicit softmax path: tanh soft-capping of the scores has no fused kernel."""
        cap = self.arch.attn_softcap
        assert cap is not None
        k, v = (t.repeat_interleave(self.groups, dim=0) for t in (k, v))
        scores = torch.tanh((q @ k.transpose(-1, -2)) * self.arch.attn_scale / cap) * cap
        if causal:
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class OProj(Operator):
    """Output projection, Gemma's post-attention norm, and the residual add ending attention."""

    name, op_class = "o_proj", "gemm"
    linear_weights = ("weight",)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        a = self.arch
        width = a.num_heads * a.head_dim
        cols = None
        if self.sharded:
            h0, h1 = self.shard.part(a.num_heads, f"L{layer}.o_proj: attention heads")
            cols = [(h0 * a.head_dim, h1 * a.head_dim)]
            self.tp_in = {"hidden": Layout(1, (width,))}
        self.weight, self.bias = self._row_parallel("self_attn.o_proj", cols)
        self.post_norm = None
        if a.sandwich_norms:
            weight = self._layer_tensor("post_attention_layernorm.weight")
            self.post_norm = RMSNorm(weight, a.rms_norm_eps, gemma=True)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        out = self._project_back(batch["hidden"], self.weight, self.bias)
        if self.post_norm is not None:
            out = self.post_norm(out)
        return batch.replace(drop=("residual",), hidden=batch["residual"] + out)
