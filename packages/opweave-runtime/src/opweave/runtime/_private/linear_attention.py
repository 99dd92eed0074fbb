"""Qwen3-Next and Qwen3.5 linear-attention (gated DeltaNet) layers: ``qkv_proj``, ``core_attn``,
``o_proj``.

Per request the layer keeps a short causal-conv window (``conv_kernel - 1`` inputs) and a recurrent
state ``[v_heads, k_head_dim, v_head_dim]`` whose size does not grow with context: the reason these
layers are cheap to hold and why plans may place them apart from full attention.

Multi-token steps use the chunked (WY / UT-transform) form of the gated delta rule and single-token
steps the recurrent form, as transformers does; the two agree up to float rounding only, so using
the same form at the same step keeps tokens identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from opweave.costmodel import LinearAttentionSpec

from ..errors import UnsupportedModelError
from .batch import TokenBatch
from .ops import OpContext, Operator, StatefulOperator, activation, linear
from .tensor_parallel import Layout

_CHUNK = 64


def local_geometry(op: Operator) -> tuple[LinearAttentionSpec, tuple[int, int]]:
    """This rank's gated-DeltaNet geometry (its key heads, each with its value heads) and its
    key-head range; the whole layer without TP."""
    la = op.arch.linear_attn
    if la is None:
        raise UnsupportedModelError(f"{op.arch.family} config has no linear-attention geometry")
    k0, k1 = op.shard.part(la.num_k_heads, f"L{op.layer}.{op.name}: linear key heads")
    r = la.num_v_heads // la.num_k_heads
    local = la.model_copy(update={"num_k_heads": k1 - k0, "num_v_heads": (k1 - k0) * r})
    return local, (k0, k1)


def linear_layouts(la: LinearAttentionSpec) -> dict[str, Layout]:
    """How the input projections' outputs are sharded: by key heads (and their value heads)."""
    nv = la.num_v_heads
    return {
        "mixed_qkv": Layout(1, (la.key_dim, la.key_dim, la.value_dim)),
        "z": Layout(1, (nv,)),
        "b": Layout(1, (nv,)),
        "a": Layout(1, (nv,)),
    }


class LinearQkvProj(Operator):
    """``in_proj_qkvz`` and ``in_proj_ba``, regrouped from per-key-head order to flat q | k | v."""

    name, op_class = "qkv_proj", "gemm"
    linear_weights = ("w_qkvz", "w_ba")
    same_input = (linear_weights,)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        self.la, (k0, k1) = local_geometry(self)
        full = self.arch.linear_attn
        assert full is not None
        r = full.num_v_heads // full.num_k_heads
        block = 2 * full.k_head_dim + 2 * r * full.v_head_dim  # rows per key head
        qkvz = [(k0 * block, k1 * block)] if self.sharded else None
        ba = [(k0 * 2 * r, k1 * 2 * r)] if self.sharded else None
        self.w_qkvz = self._layer_tensor("linear_attn.in_proj_qkvz.weight", ranges=qkvz)
        self.w_ba = self._layer_tensor("linear_attn.in_proj_ba.weight", ranges=ba)
        if self.sharded:
            self.tp_out = linear_layouts(full)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        la = self.la
        x = batch["hidden"]
        n, nk, r = x.shape[0], la.num_k_heads, la.num_v_heads // la.num_k_heads
        qkvz = linear(x, self.w_qkvz).view(n, nk, 2 * la.k_head_dim + 2 * r * la.v_head_dim)
        ba = linear(x, self.w_ba).view(n, nk, 2 * r)
        q, k, v, z = torch.split(
            qkvz, [la.k_head_dim, la.k_head_dim, r * la.v_head_dim, r * la.v_head_dim], dim=-1
        )
        b, a = torch.split(ba, [r, r], dim=-1)
        mixed = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
        return batch.replace(
            drop=("hidden",),
            mixed_qkv=mixed,
            z=z.reshape(n, la.num_v_heads, la.v_head_dim),
            b=b.reshape(n, la.num_v_heads),
            a=a.reshape(n, la.num_v_heads),
        )


class SplitLinearQkvProj(Operator):
    """Qwen3.5's four input projections (``in_proj_qkv`` flat q | k | v, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``); under TP each rank reads its key heads' rows of q and k and
    their value heads' rows of the rest."""

    name, op_class = "qkv_proj", "gemm"
    linear_weights = ("w_qkv", "w_z", "w_b", "w_a")
    same_input = (linear_weights,)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        self.la, (k0, k1) = local_geometry(self)
        full = self.arch.linear_attn
        assert full is not None
        r, dk, dv = full.num_v_heads // full.num_k_heads, full.k_head_dim, full.v_head_dim
        qkv = z = ba = None
        if self.sharded:
            v0 = 2 * full.key_dim
            qkv = [
                (k0 * dk, k1 * dk),
                (full.key_dim + k0 * dk, full.key_dim + k1 * dk),
                (v0 + k0 * r * dv, v0 + k1 * r * dv),
            ]
            z, ba = [(k0 * r * dv, k1 * r * dv)], [(k0 * r, k1 * r)]
            self.tp_out = linear_layouts(full)
        self.w_qkv = self._layer_tensor("linear_attn.in_proj_qkv.weight", ranges=qkv)
        self.w_z = self._layer_tensor("linear_attn.in_proj_z.weight", ranges=z)
        self.w_b = self._layer_tensor("linear_attn.in_proj_b.weight", ranges=ba)
        self.w_a = self._layer_tensor("linear_attn.in_proj_a.weight", ranges=ba)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        la = self.la
        x = batch["hidden"]
        n = x.shape[0]
        return batch.replace(
            drop=("hidden",),
            mixed_qkv=linear(x, self.w_qkv),
            z=linear(x, self.w_z).view(n, la.num_v_heads, la.v_head_dim),
            b=linear(x, self.w_b),
            a=linear(x, self.w_a),
        )


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def recurrent_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """One token of the gated delta rule: updates ``state [..., H, dk, dv]`` in place
    (``q``/``k`` ``[..., H, dk]``, ``v`` ``[..., H, dv]``, ``g``/``beta`` ``[..., H]``).

    Decay the memory, read what it predicts for ``k``, write back ``beta`` of the error. ``q`` is
    scaled by division here but by multiplication in the chunked form, as in transformers.
    """
    q = q / q.shape[-1] ** 0.5
    state.mul_(g.exp()[..., None, None])
    predicted = (state * k[..., :, None]).sum(dim=-2)
    delta = (v - predicted) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return (state * q[..., :, None]).sum(dim=-2)


def chunked_delta_rule(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule over ``T`` tokens.

    Shapes: ``q``/``k`` ``[H, T, dk]``, ``v`` ``[H, T, dv]``, ``g``/``beta`` ``[H, T]``.

    Within a chunk the sequential updates collapse into a unit lower-triangular solve, so the loop
    runs over chunks instead of tokens. ``state`` ``[H, dk, dv]`` is updated in place.
    """
    q = q * q.shape[-1] ** -0.5
    length = q.shape[1]
    pad = (-length) % _CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    heads, chunks = q.shape[0], q.shape[1] // _CHUNK
    q, k, v = (t.reshape(heads, chunks, _CHUNK, -1) for t in (q, k, v))
    g = g.reshape(heads, chunks, _CHUNK).cumsum(dim=-1)
    beta = beta.reshape(heads, chunks, _CHUNK, 1)
    k_beta, v_beta = k * beta, v * beta

    future = torch.ones(_CHUNK, _CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    g_exp = g.exp()[..., None]
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * g_exp, upper=False, unitriangular=True
    )

    q_decayed = q * g_exp
    k_to_end = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for c in range(chunks):
        v_new = new_values[:, c] - k_cumdecay[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ v_new
        state.copy_(state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ v_new)
    return out.reshape(heads, chunks * _CHUNK, -1)[:, :length]


class LinearCoreAttention(StatefulOperator):
    """Causal conv1d + gated delta rule + gated RMSNorm; holds the conv and recurrent state."""

    name, op_class = "core_attn", "attention"

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        self.la, (k0, k1) = local_geometry(self)
        full = self.arch.linear_attn
        assert full is not None
        channels = v_heads = None
        if self.sharded:
            dk, dv, r = full.k_head_dim, full.v_head_dim, full.num_v_heads // full.num_k_heads
            v0, v1 = k0 * r, k1 * r
            channels = [
                (k0 * dk, k1 * dk),  # q
                (full.key_dim + k0 * dk, full.key_dim + k1 * dk),  # k
                (2 * full.key_dim + v0 * dv, 2 * full.key_dim + v1 * dv),  # v
            ]
            v_heads = [(v0, v1)]
            self.tp_in = linear_layouts(full)
            self.tp_out = {"hidden": Layout(1, (full.value_dim,))}
        self.conv_weight = self._layer_tensor(
            "linear_attn.conv1d.weight", ranges=channels
        )  # [conv_dim, 1, K]
        self.conv_bias = self._optional_layer_tensor("linear_attn.conv1d.bias", ranges=channels)
        self.neg_a = -self._layer_tensor("linear_attn.A_log", ranges=v_heads).float().exp()
        self.dt_bias = self._layer_tensor("linear_attn.dt_bias", ranges=v_heads)
        self.norm_weight = self._layer_tensor("linear_attn.norm.weight")
        self.act = activation(self.arch.hidden_act)
        self._conv: dict[str, torch.Tensor] = {}
        self._recurrent: dict[str, torch.Tensor] = {}
        self._kv_repeat = self.la.num_v_heads // self.la.num_k_heads
        # the static decode step's state: conv [rows + 1, conv_dim, conv_kernel - 1] and
        # recurrent [rows + 1, v_heads, k_head_dim, v_head_dim] slabs per layer, stacked with the
        # stage's other linear-attention layers in a SlabPool; a request's entries become views
        # of its row when it first decodes that way

    @property
    def conv_shape(self) -> tuple[int, int]:
        """One request's conv state: its last ``conv_kernel - 1`` inputs per channel."""
        return self.la.conv_dim, self.la.conv_kernel - 1

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        """One request's recurrent state (float32): ``[v_heads, k_head_dim, v_head_dim]``."""
        la = self.la
        return la.num_v_heads, la.k_head_dim, la.v_head_dim

    def _init_state(self, request_id: str) -> None:
        self._conv[request_id] = torch.zeros(self.conv_shape, dtype=self.dtype, device=self.device)
        self._recurrent[request_id] = torch.zeros(
            self.recurrent_shape, dtype=torch.float32, device=self.device
        )

    def _drop_state(self, request_id: str) -> None:
        del self._conv[request_id], self._recurrent[request_id]

    def _state_tensors(self, request_id: str) -> list[torch.Tensor]:
        return [self._conv[request_id], self._recurrent[request_id]]

    def state_layout(self, length: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        del length  # a recurrent state has no length
        return [(self.conv_shape, self.dtype), (self.recurrent_shape, torch.float32)]

    def state_shards(self) -> list[Layout | None]:
        full = self.arch.linear_attn
        assert full is not None
        conv = Layout(0, (full.key_dim, full.key_dim, full.value_dim))  # q, k, v channels
        return [conv, Layout(0, (full.num_v_heads,))]

    def export_state(self, request_id: str) -> list[torch.Tensor]:
        return self._state_tensors(request_id)

    def _load_state(self, request_id: str, length: int, tensors: Sequence[torch.Tensor]) -> None:
        del length
        conv, recurrent = tensors
        self._conv[request_id].copy_(conv)
        self._recurrent[request_id].copy_(recurrent)

    # -- the static decode step (see .decode) --------------------------------------------------
    def reserve(self, rows: int, tokens: int) -> None:
        """Size the slabs for ``rows`` requests (the state does not grow with ``tokens``)."""
        self._grow_slabs(rows + 1)

    def slab_key(self) -> tuple[object, ...]:
        return ("linear", self.conv_shape, self.recurrent_shape, self.dtype, self.device)

    def slab_layout(self, rows: int, tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        del tokens  # a recurrent state has no length
        return [
            ((rows, *self.conv_shape), self.dtype),
            ((rows, *self.recurrent_shape), torch.float32),
        ]

    def _states_to_slabs(self) -> None:
        assert self._slabs is not None
        conv, recurrent = self._slabs
        for rid, row in self._rows.items():
            if rid not in self._outside:
                self._conv[rid], self._recurrent[rid] = conv[row], recurrent[row]

    def _grow_slabs_for(self, rows: int, tokens: int, span: int) -> None:
        del tokens, span  # a recurrent state has no length
        self._grow_slabs(rows)

    def _move_in(self, request_id: str, length: int) -> None:
        del length
        assert self._slabs is not None
        conv, recurrent = self._slabs
        row = self._rows[request_id]
        conv[row] = self._conv[request_id]
        recurrent[row] = self._recurrent[request_id]
        self._conv[request_id], self._recurrent[request_id] = conv[row], recurrent[row]

    def _decode_static(self, batch: TokenBatch) -> TokenBatch:
        """One new token per row, all rows at once, each on its row of the slabs."""
        assert batch.step is not None and self._slab_pool is not None
        la, rows = self.la, batch.step.rows
        conv_slab, recurrent_slab = self._slab_pool.tensors  # [layers, rows, ...]
        layer = self._slab_rows(rows)
        mixed = batch["mixed_qkv"]
        n = mixed.shape[0]
        past = conv_slab[layer, rows]
        window = torch.cat((past, mixed[:, :, None].to(conv_slab.dtype)), dim=-1)
        conv_slab[layer, rows] = window[:, :, 1:]
        conv = F.conv1d(window, self.conv_weight, self.conv_bias, groups=window.shape[1])
        conv = self.act(conv)[:, :, 0].to(mixed.dtype)
        q, k, v = torch.split(conv, [la.key_dim, la.key_dim, la.value_dim], -1)
        q, k = (
            _l2norm(t.reshape(n, la.num_k_heads, -1).repeat_interleave(self._kv_repeat, 1).float())
            for t in (q, k)
        )
        v = v.reshape(n, la.num_v_heads, -1).float()
        g = self.neg_a * F.softplus(batch["a"].float() + self.dt_bias)
        state = recurrent_slab[layer, rows]
        core = recurrent_step(state, q, k, v, g, batch["b"].sigmoid().float())
        recurrent_slab[layer, rows] = state
        hidden = self._gated_norm(core.to(self.dtype), batch["z"]).reshape(n, -1)
        return batch.replace(drop=("mixed_qkv", "z", "b", "a"), hidden=hidden)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        if batch.step is not None:
            return self._decode_static(batch)
        la, meta = self.la, batch.meta
        beta = batch["b"].sigmoid()
        g = self.neg_a * F.softplus(batch["a"].float() + self.dt_bias)
        mixed = batch["mixed_qkv"]
        core = torch.empty(
            mixed.shape[0], la.num_v_heads, la.v_head_dim, dtype=self.dtype, device=self.device
        )
        for i, rid in enumerate(meta.request_ids):
            rows = slice(meta.row_offsets[i], meta.row_offsets[i + 1])
            self._advance(rid, meta.context_lens[i], rows.stop - rows.start)
            first_step = meta.context_lens[i] == 0
            core[rows] = self._mix(rid, mixed[rows], g[rows], beta[rows], first_step=first_step)
        hidden = self._gated_norm(core, batch["z"]).reshape(core.shape[0], -1)
        return batch.replace(drop=("mixed_qkv", "z", "b", "a"), hidden=hidden)

    def _mix(
        self,
        request_id: str,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        first_step: bool,
    ) -> torch.Tensor:
        """Conv and delta rule over one request's rows; returns ``[n, v_heads, v_head_dim]``."""
        la, n = self.la, mixed.shape[0]
        q, k, v = torch.split(
            self._conv_step(request_id, mixed), [la.key_dim, la.key_dim, la.value_dim], -1
        )
        # -> [heads, n, d] in float32; each key head serves `_kv_repeat` consecutive value heads
        q, k = (
            _l2norm(
                t.reshape(n, la.num_k_heads, -1)
                .repeat_interleave(self._kv_repeat, 1)
                .transpose(0, 1)
                .float()
            )
            for t in (q, k)
        )
        v = v.reshape(n, la.num_v_heads, -1).transpose(0, 1).float()
        g, beta = g.T.contiguous(), beta.T.float()
        state = self._recurrent[request_id]
        if n == 1 and not first_step:
            out = recurrent_step(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])[:, None]
        else:
            out = chunked_delta_rule(state, q, k, v, g, beta)
        return out.transpose(0, 1).to(self.dtype)

    def _conv_step(self, request_id: str, x: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv of ``x [n, conv_dim]``, continuing the request's last inputs."""
        history = self._conv[request_id]
        window = torch.cat((history, x.T.to(history.dtype)), dim=-1)
        history.copy_(window[:, window.shape[1] - history.shape[1] :])
        out = F.conv1d(window[None], self.conv_weight, self.conv_bias, groups=window.shape[0])[0]
        return self.act(out).T.to(x.dtype)

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm with a plain ``w`` scale, then ``* silu(gate)`` in float32 (RMSNormGated)."""
        y = x.to(torch.float32)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps)
        y = self.norm_weight * y.to(x.dtype)
        return (y * F.silu(gate.to(torch.float32))).to(x.dtype)


class LinearOProj(Operator):
    """``out_proj`` and the residual add."""

    name, op_class = "o_proj", "gemm"
    linear_weights = ("weight",)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        la, (k0, k1) = local_geometry(self)
        full = self.arch.linear_attn
        assert full is not None
        cols = None
        if self.sharded:
            per_key = (full.num_v_heads // full.num_k_heads) * full.v_head_dim
            cols = [(k0 * per_key, k1 * per_key)]
            self.tp_in = {"hidden": Layout(1, (full.value_dim,))}
        del la
        self.weight = self._layer_tensor("linear_attn.out_proj.weight", dim=1, ranges=cols)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        out = self._project_back(batch["hidden"], self.weight, None)
        return batch.replace(drop=("residual",), hidden=batch["residual"] + out)
