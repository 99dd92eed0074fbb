"""Multi-head latent attention (DeepSeek-V3, -R1, -V3.1, Kimi-K2): ``qkv_proj``, ``rope``,
``core_attn`` and ``o_proj`` of an MLA layer, over the compressed latent KV cache.

A token's cache entry is its normalised latent ``c_KV`` (``kv_lora_rank`` values) and its
rotated RoPE key (``qk_rope_head_dim``), shared by every head (DeepSeek-V2, arXiv:2405.04434,
§2.1.2-2.1.3). Attention runs in the absorbed form the cost model plans
(:mod:`opweave.costmodel` ``mla.py``): ``qkv_proj`` multiplies each head's ``q_nope`` by
``W_UK`` (the key rows of ``kv_b_proj``) into the latent space, so ``core_attn`` is
multi-query attention of ``[q_latent, q_pe]`` against the cached ``[c_KV, k_pe]`` with the
latent as the value, and ``o_proj`` applies ``W_UV`` (the value rows) before ``o_proj``. Since
``q_nope . (W_UK c) = (W_UK^T q_nope) . c`` this equals the expanded form transformers runs up
to float rounding. Prefill takes the same path: ``core_attn`` holds no weights in the plan (a
CAD owner of core attention has no ``kv_b_proj``), so it cannot expand the cache itself.

Under tensor parallelism the heads split (``q_b_proj``/``q_proj`` rows, ``W_UK``/``W_UV``
heads, ``o_proj`` columns); the latent does not: ``q_a_proj`` and ``kv_a_proj_with_mqa`` run
whole on every rank and every rank holds the whole cache, as vLLM's MLA does (one KV head,
``OperatorSpec.state_tp_replicated``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from opweave.costmodel import MLASpec

from .batch import TokenBatch
from .ops import OpContext, Operator, RMSNorm, StatefulOperator, linear
from .rope import attention_scaling, inverse_frequencies, rotate
from .tensor_parallel import Layout

_MIN_CAPACITY = 16


def _mla(op: Operator) -> MLASpec:
    mla = op.arch.mla
    assert mla is not None
    return mla


def _head_rows(h0: int, h1: int, stride: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """Rows ``[lo, hi)`` of each head ``h0 .. h1 - 1`` of a weight with ``stride`` rows a head."""
    return [(h * stride + lo, h * stride + hi) for h in range(h0, h1)]


def _kv_b_part(
    op: Operator, heads: tuple[int, int], rows: tuple[int, int], part: str
) -> torch.Tensor:
    """Rows ``rows`` of each local head's block of ``kv_b_proj`` (``W_UK`` or ``W_UV``),
    counted under their own name: ``qkv_proj`` and ``o_proj`` each hold a disjoint part of the
    one tensor, and a stage holding both holds it once (a stage's weights are summed by name)."""
    m = _mla(op)
    assert op.layer is not None
    name = op._ckpt.layer_name(op.layer, "self_attn.kv_b_proj.weight")
    stride = m.qk_nope_head_dim + m.v_head_dim
    tensor = op._tensor(name, ranges=_head_rows(*heads, stride, *rows))
    op.weight_sizes[f"{name}:{part}"] = op.weight_sizes.pop(name)
    return tensor


def _local_heads(op: Operator) -> tuple[int, int]:
    return op.shard.part(op.arch.num_heads, f"L{op.layer}.{op.name}: attention heads")


class MlaQkvProj(Operator):
    """``hidden`` -> the absorbed query ``q [N, heads, kv_lora_rank + rope]`` (``q_pe`` not yet
    rotated) and the token's cache entry ``kv [N, kv_lora_rank + rope]`` (``k_pe`` not yet
    rotated)."""

    name, op_class = "qkv_proj", "gemm"
    linear_weights = ("wq_a", "wq_b", "wq", "wkv_a")
    same_input = (("wq_a", "wkv_a"),)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        m, a = _mla(self), self.arch
        h0, h1 = _local_heads(self)
        self.num_heads = h1 - h0
        q_rows = [(h0 * m.qk_head_dim, h1 * m.qk_head_dim)] if self.sharded else None
        self.wq_a = self.bq_a = self.wq_b = self.wq = None
        self.q_a_norm = None
        if m.q_lora_rank:
            self.wq_a, self.bq_a = self._column_parallel("self_attn.q_a_proj", None)
            self.q_a_norm = RMSNorm(
                self._layer_tensor("self_attn.q_a_layernorm.weight"), a.rms_norm_eps, gemma=False
            )
            self.wq_b, _ = self._column_parallel("self_attn.q_b_proj", q_rows)
        else:
            self.wq, _ = self._column_parallel("self_attn.q_proj", q_rows)
        self.wkv_a, self.bkv_a = self._column_parallel("self_attn.kv_a_proj_with_mqa", None)
        self.kv_a_norm = RMSNorm(
            self._layer_tensor("self_attn.kv_a_layernorm.weight"), a.rms_norm_eps, gemma=False
        )
        # W_UK: the key rows of each local head of kv_b_proj, [heads, qk_nope_head_dim, latent]
        w_uk = _kv_b_part(self, (h0, h1), (0, m.qk_nope_head_dim), "W_UK")
        self.w_uk = w_uk.view(self.num_heads, m.qk_nope_head_dim, m.kv_lora_rank)
        if self.sharded:
            self.tp_out = {"q": Layout(1, (a.num_heads,))}

    def forward(self, batch: TokenBatch) -> TokenBatch:
        m = _mla(self)
        x = batch["hidden"]
        n = x.shape[0]
        if self.q_a_norm is not None:
            assert self.wq_a is not None and self.wq_b is not None
            q = linear(self.q_a_norm(linear(x, self.wq_a, self.bq_a)), self.wq_b)
        else:
            assert self.wq is not None
            q = linear(x, self.wq)
        q_nope, q_pe = torch.split(
            q.view(n, self.num_heads, m.qk_head_dim), [m.qk_nope_head_dim, m.qk_rope_head_dim], -1
        )
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        latent, k_pe = torch.split(
            linear(x, self.wkv_a, self.bkv_a), [m.kv_lora_rank, m.qk_rope_head_dim], -1
        )
        kv = torch.cat((self.kv_a_norm(latent), k_pe), dim=-1)
        return batch.replace(drop=("hidden",), q=torch.cat((q_latent, q_pe), dim=-1), kv=kv)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout, vLLM's
    ``is_neox_style=False``), written out as the rotated even then odd channels, as
    transformers' ``apply_rotary_pos_emb_interleave`` does (queries and keys alike, so the
    scores are the same). ``cos``/``sin``: one per pair."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the pairs ``(x_i, x_{i + d/2})`` (``rope_interleave: false``)."""
    return rotate(x, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))


class MlaRope(Operator):
    """Rotates the RoPE part (the last ``qk_rope_head_dim`` channels) of ``q`` and ``kv``."""

    name, op_class = "rope", "small"

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        assert layer is not None
        m = _mla(self)
        rope = self.arch.rope[self.arch.layer_types[layer]]
        whole = rope.model_copy(update={"partial_rotary_factor": 1.0})
        self.inv_freq = inverse_frequencies(whole, m.qk_rope_head_dim).to(self.device)
        self.scaling = attention_scaling(rope)
        self.latent = m.kv_lora_rank
        self.rotate = rotate_interleaved if m.rope_interleave else _rotate_halves
        self._table_key = ("mla_rope", rope.model_dump_json(), m.qk_rope_head_dim, str(self.dtype))
        if self.sharded:  # head-wise: works on full or sharded heads alike
            self.tp_pass = frozenset(("q", "kv"))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.device).float()[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(self.dtype), sin.to(self.dtype)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        meta = batch.step or batch.meta
        cos, sin = meta.shared(self._table_key, lambda: self.cos_sin(meta.positions))
        q, kv, lat = batch["q"], batch["kv"], self.latent
        q = torch.cat((q[..., :lat], self.rotate(q[..., lat:], cos[:, None], sin[:, None])), -1)
        kv = torch.cat((kv[..., :lat], self.rotate(kv[..., lat:], cos, sin)), -1)
        return batch.replace(q=q, kv=kv)


class _LatentState:
    """One request's cache ``[capacity, kv_lora_rank + rope]``; capacity doubles as it grows."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.c = torch.empty(_MIN_CAPACITY, width, dtype=dtype, device=device)
        self.length = 0

    def append(self, entries: torch.Tensor) -> None:
        end = self.length + entries.shape[0]
        if end > self.c.shape[0]:
            grown = self.c.new_empty(max(end, 2 * self.c.shape[0]), self.c.shape[1])
            grown[: self.length] = self.c[: self.length]
            self.c = grown
        self.c[self.length : end] = entries
        self.length = end


class MlaCoreAttention(StatefulOperator):
    """Multi-query attention of the absorbed queries over each request's latent cache."""

    name, op_class = "core_attn", "attention"
    slab_token_dim = 1  # [rows, capacity, kv_lora_rank + rope]

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        m, a = _mla(self), self.arch
        h0, h1 = _local_heads(self)
        self.num_heads = h1 - h0
        self.latent, self.width = m.kv_lora_rank, m.latent_dim
        self._states: dict[str, _LatentState] = {}
        if self.sharded:
            self.tp_in = {"q": Layout(1, (a.num_heads,))}
            self.tp_out = {"hidden": Layout(1, (a.num_heads * m.kv_lora_rank,))}

    def _init_state(self, request_id: str) -> None:
        self._states[request_id] = _LatentState(self.width, self.dtype, self.device)

    def _drop_state(self, request_id: str) -> None:
        del self._states[request_id]

    def _state_tensors(self, request_id: str) -> list[torch.Tensor]:
        return [self._states[request_id].c]

    def state_layout(self, length: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((length, self.width), self.dtype)]

    def state_shards(self) -> list[Layout | None]:
        return [None]  # the latent is every head's: each rank holds it whole

    def export_state(self, request_id: str) -> list[torch.Tensor]:
        state = self._states[request_id]
        return [state.c[: state.length]]

    def _load_state(self, request_id: str, length: int, tensors: Sequence[torch.Tensor]) -> None:
        state = self._states[request_id]
        state.append(tensors[0])
        state.length = length

    def _attend(
        self, q: torch.Tensor, cache: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """``q [B, heads, n, width]`` against ``cache [B, m, width]`` (values: its latent)."""
        k = cache[:, None].expand(-1, q.shape[1], -1, -1)
        return F.scaled_dot_product_attention(
            q,
            k,
            k[..., : self.latent],
            attn_mask=mask,
            is_causal=causal,
            scale=self.arch.attn_scale,
        )

    def forward(self, batch: TokenBatch) -> TokenBatch:
        if batch.step is not None:
            return self._decode_static(batch)
        q, kv, meta = batch["q"], batch["kv"], batch.meta
        out = torch.empty(q.shape[0], self.num_heads * self.latent, dtype=q.dtype, device=q.device)
        for i, rid in enumerate(meta.request_ids):
            lo, hi = meta.row_offsets[i], meta.row_offsets[i + 1]
            start = meta.context_lens[i]
            self._advance(rid, start, hi - lo)
            state = self._states[rid]
            state.length = start  # static steps count in _context_lens alone
            held = state.c
            state.append(kv[lo:hi])
            n = hi - lo
            mask = None
            if n > 1 and start > 0:
                q_pos = torch.arange(start, start + n, device=self.device)[:, None]
                mask = torch.arange(start + n, device=self.device)[None, :] <= q_pos
            o = self._attend(
                q[lo:hi].transpose(0, 1)[None],
                state.c[None, : state.length],
                mask,
                n > 1 and start == 0,
            )
            out[lo:hi] = o[0].transpose(0, 1).reshape(n, -1)
            if state.c is not held:  # it outgrew its slab row (or had none): not in the slab
                self._outside.add(rid)
        return batch.replace(drop=("q", "kv"), hidden=out)

    # -- the static decode step (see .decode) --------------------------------------------------
    def reserve(self, rows: int, tokens: int) -> None:
        self._grow_slabs(rows + 1, tokens)

    def slab_key(self) -> tuple[object, ...]:
        return ("mla", self.width, self.dtype, self.device)

    def slab_layout(self, rows: int, tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((rows, tokens, self.width), self.dtype)]

    def _states_to_slabs(self) -> None:
        assert self._slabs is not None
        (slab,) = self._slabs
        for rid, state in self._states.items():
            if rid not in self._outside:
                state.c = slab[self._rows[rid]]

    def _grow_slabs_for(self, rows: int, tokens: int, span: int) -> None:
        # one slot of headroom, as CoreAttention: a compiled step never sees span == capacity
        self._grow_slabs(rows, max(tokens, span) + 1)

    def _move_in(self, request_id: str, length: int) -> None:
        assert self._slabs is not None
        (slab,) = self._slabs
        state, row = self._states[request_id], self._rows[request_id]
        slab[row, :length] = state.c[:length]
        state.c = slab[row]

    def _decode_static(self, batch: TokenBatch) -> TokenBatch:
        """One new token per row: store each row's entry at its position, attend over the
        first ``span`` slots with the slots past its position masked."""
        assert batch.step is not None and self._slab_pool is not None
        (slabs,) = self._slab_pool.tensors  # [layers, rows, capacity, width]
        rows, pos = batch.step.rows, batch.step.positions
        layer = self._slab_rows(rows)
        slabs[layer, rows, pos] = batch["kv"]
        cache = slabs[layer, rows].narrow(1, 0, batch.step.span)
        visible = torch.arange(cache.shape[1], device=pos.device)[None, :] <= pos[:, None]
        o = self._attend(batch["q"][:, :, None, :], cache, visible[:, None, None, :], False)
        return batch.replace(drop=("q", "kv"), hidden=o.reshape(o.shape[0], -1))


class MlaOProj(Operator):
    """The attention output times ``W_UV`` per head, ``o_proj``, and the residual add."""

    name, op_class = "o_proj", "gemm"
    linear_weights = ("weight",)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        m, a = _mla(self), self.arch
        h0, h1 = _local_heads(self)
        self.num_heads = h1 - h0
        stride = m.qk_nope_head_dim + m.v_head_dim
        w_uv = _kv_b_part(self, (h0, h1), (m.qk_nope_head_dim, stride), "W_UV")
        # [heads, latent, v_head_dim]: the output's latent times it gives each head's value
        self.w_uv = w_uv.view(self.num_heads, m.v_head_dim, m.kv_lora_rank).transpose(1, 2)
        cols = [(h0 * m.v_head_dim, h1 * m.v_head_dim)] if self.sharded else None
        self.weight, self.bias = self._row_parallel("self_attn.o_proj", cols)
        if self.sharded:
            self.tp_in = {"hidden": Layout(1, (a.num_heads * m.kv_lora_rank,))}

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x = batch["hidden"]
        n = x.shape[0]
        heads = x.view(n, self.num_heads, -1).transpose(0, 1)  # [heads, N, latent]
        values = torch.bmm(heads, self.w_uv).transpose(0, 1).reshape(n, -1)
        out = self._project_back(values, self.weight, self.bias)
        return batch.replace(drop=("residual",), hidden=batch["residual"] + out)
