"""Rotary position embeddings: the ``rope`` operator and its frequency tables.

Frequencies are computed in float32 from absolute positions every step (not looked up from a
table) because transformers does exactly that and a cached table would round differently.
"""

from __future__ import annotations

import math

import torch

from opweave.costmodel import RopeSpec

from ..errors import UnsupportedModelError
from .batch import TokenBatch
from .ops import OpContext, Operator

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies (float32) for ``default``, ``linear``, ``llama3`` and
    ``yarn`` RoPE."""
    dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return _yarn_frequencies(rope, dim)
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


def _yarn_frequencies(rope: RopeSpec, dim: int) -> torch.Tensor:
    """YaRN (arXiv:2309.00071, §3.2 "NTK-by-parts"): dimensions that turn fewer than
    ``beta_slow`` times over the original context are interpolated (divided by ``factor``),
    those turning more than ``beta_fast`` times kept, a linear ramp between, the band edges
    rounded outwards unless ``truncate`` is false (gpt-oss)."""
    base, old_len = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp: a step
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_scaling(rope: RopeSpec) -> float:
    """What YaRN multiplies cos and sin by: ``attention_factor`` where the config gives it,
    else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given
    (DeepSeek's, usually 1), else ``0.1 ln(factor) + 1`` (the paper's sqrt(1/t)), as
    transformers' ``_compute_yarn_parameters`` does; 1 for every other RoPE type."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(m: float) -> float:
        return 1.0 if rope.factor <= 1 else 0.1 * m * math.log(rope.factor) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.mscale) / mscale(rope.mscale_all_dim)
    return mscale(1.0)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels (half-split pairs), pass the rest."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated_half = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated_half * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)


class Rope(Operator):
    """Applies RoPE to ``q`` ``[N, heads, head_dim]`` and ``k`` at each row's absolute position."""

    name, op_class = "rope", "small"

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        assert layer is not None
        # Gemma 3's sliding layers use their own base frequency (rope_local_base_freq).
        rope = self.arch.rope[self.arch.layer_types[layer]]
        if rope.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rope.rope_type!r} is not implemented ({', '.join(ROPE_TYPES)} are)"
            )
        self.inv_freq = inverse_frequencies(rope, self.arch.head_dim).to(self.device)
        self.scaling = attention_scaling(rope)
        # plain strings, so a compiled step's trace can hash it
        self._table_key = ("rope", rope.model_dump_json(), self.arch.head_dim, str(self.dtype))
        if self.sharded:  # head-wise: works on full or sharded heads alike
            self.tp_pass = frozenset(("q", "k", "v", "attn_gate"))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.device).float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        # [N, 1, rot_dim] broadcasts over heads.
        return cos.to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :]

    def forward(self, batch: TokenBatch) -> TokenBatch:
        meta = batch.step or batch.meta  # layers with the same RoPE share one cos/sin per step
        cos, sin = meta.shared(self._table_key, lambda: self.cos_sin(meta.positions))
        return batch.replace(q=rotate(batch["q"], cos, sin), k=rotate(batch["k"], cos, sin))
