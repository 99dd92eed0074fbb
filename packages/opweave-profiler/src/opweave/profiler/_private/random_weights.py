"""Random weights of the right shapes, served under a checkpoint's tensor names.

Profiling a 27B or 80B model must not need its weights: timing depends on shapes and dtype, not
values. The runtime's operators read their tensors by Hugging Face name through a checkpoint
object (``get``, ``has``, ``layer_name``, ...). :class:`RandomCheckpoint` answers the same calls
from a config alone, creating each tensor only when an operator asks for it, so building one
partition block (plus embed and head) allocates only that block's weights, directly on the
target device and in the requested dtype.

Values are uniform with variance ``1 / fan_in`` (norm vectors near 1), so activations stay O(1)
and no timing is distorted by NaNs, infinities or denormals.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from opweave.costmodel import Architecture
from opweave.runtime import TensorSource
from opweave.runtime.errors import CheckpointError

_PREFIX = "model."
_LINEAR = "linear_attention"


def tensor_shapes(
    spec: Architecture, layers: range | list[int] | None = None
) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of ``layers`` (default all) plus embed and head.

    Experts use transformers 5's fused layout (``experts.gate_up_proj [E, 2I, H]``), which the
    runtime reads directly.
    """
    h, nq, nkv, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        f"{_PREFIX}embed_tokens.weight": (spec.vocab_size, h),
        f"{_PREFIX}norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    qkv_bias, o_bias, mlp_bias = spec.qkv_bias, spec.o_bias, spec.mlp_bias
    for i in range(spec.num_layers) if layers is None else layers:
        p = f"{_PREFIX}layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if spec.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        shapes.update({f"{p}{n}.weight": (h,) for n in norms})
        if spec.layer_types[i] == _LINEAR:
            la = spec.linear_attn
            assert la is not None
            a = f"{p}linear_attn."
            if la.split_projections:  # Qwen3.5's four input projections
                shapes[f"{a}in_proj_qkv.weight"] = (la.conv_dim, h)
                shapes[f"{a}in_proj_z.weight"] = (la.value_dim, h)
                shapes[f"{a}in_proj_b.weight"] = (la.num_v_heads, h)
                shapes[f"{a}in_proj_a.weight"] = (la.num_v_heads, h)
            else:
                shapes[f"{a}in_proj_qkvz.weight"] = (2 * la.key_dim + 2 * la.value_dim, h)
                shapes[f"{a}in_proj_ba.weight"] = (2 * la.num_v_heads, h)
            shapes[f"{a}conv1d.weight"] = (la.conv_dim, 1, la.conv_kernel)
            shapes[f"{a}A_log"] = (la.num_v_heads,)
            shapes[f"{a}dt_bias"] = (la.num_v_heads,)
            shapes[f"{a}norm.weight"] = (la.v_head_dim,)
            shapes[f"{a}out_proj.weight"] = (h, la.value_dim)
        elif spec.mla is not None:
            shapes.update(_mla_shapes(spec, f"{p}self_attn."))
        else:
            a = f"{p}self_attn."
            q_out = nq * d * (2 if spec.attn_output_gate else 1)
            for name, rows in (("q_proj", q_out), ("k_proj", nkv * d), ("v_proj", nkv * d)):
                shapes[f"{a}{name}.weight"] = (rows, h)
                if qkv_bias:
                    shapes[f"{a}{name}.bias"] = (rows,)
            shapes[f"{a}o_proj.weight"] = (h, nq * d)
            if o_bias:
                shapes[f"{a}o_proj.bias"] = (h,)
            if spec.qk_norm:  # per head, or (MiniMax-M2) one norm over all heads
                wide = spec.qk_norm_per_layer
                shapes[f"{a}q_norm.weight"] = (nq * d,) if wide else (d,)
                shapes[f"{a}k_norm.weight"] = (nkv * d,) if wide else (d,)
            if spec.attn_sinks:
                shapes[f"{a}sinks"] = (nq,)
        if spec.is_moe_layer(i):
            moe = spec.moe
            assert moe is not None
            m, e, inter = f"{p}mlp.", moe.num_experts, moe.intermediate_size
            if moe.expert_bias:  # gpt-oss: biased router, experts stored [E, in, out]
                shapes[f"{m}router.weight"] = (e, h)
                shapes[f"{m}router.bias"] = (e,)
                shapes[f"{m}experts.gate_up_proj"] = (e, h, 2 * inter)
                shapes[f"{m}experts.gate_up_proj_bias"] = (e, 2 * inter)
                shapes[f"{m}experts.down_proj"] = (e, inter, h)
                shapes[f"{m}experts.down_proj_bias"] = (e, h)
            else:
                shapes[f"{m}gate.weight"] = (e, h)
                shapes[f"{m}experts.gate_up_proj"] = (e, 2 * inter, h)
                shapes[f"{m}experts.down_proj"] = (e, h, inter)
            if moe.score_correction_bias:
                shapes[f"{m}gate.e_score_correction_bias"] = (e,)
            if moe.shared_intermediate_size:
                si = moe.shared_intermediate_size
                shapes[f"{m}shared_expert.gate_proj.weight"] = (si, h)
                shapes[f"{m}shared_expert.up_proj.weight"] = (si, h)
                shapes[f"{m}shared_expert.down_proj.weight"] = (h, si)
                if moe.shared_expert_gate:
                    shapes[f"{m}shared_expert_gate.weight"] = (1, h)
        else:
            m, inter = f"{p}mlp.", spec.intermediate_size
            for name, shape in (
                ("gate_proj", (inter, h)),
                ("up_proj", (inter, h)),
                ("down_proj", (h, inter)),
            ):
                shapes[f"{m}{name}.weight"] = shape
                if mlp_bias:
                    shapes[f"{m}{name}.bias"] = (shape[0],)
    return shapes


def _mla_shapes(spec: Architecture, a: str) -> dict[str, tuple[int, ...]]:
    """An MLA layer's attention tensors (DeepSeek-V3's names), from its latent geometry."""
    m, h, nq = spec.mla, spec.hidden_size, spec.num_heads
    assert m is not None
    q_out = nq * m.qk_head_dim
    shapes = {
        f"{a}kv_a_proj_with_mqa.weight": (m.latent_dim, h),
        f"{a}kv_a_layernorm.weight": (m.kv_lora_rank,),
        f"{a}kv_b_proj.weight": (nq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        f"{a}o_proj.weight": (h, nq * m.v_head_dim),
    }
    if m.q_lora_rank:
        shapes |= {
            f"{a}q_a_proj.weight": (m.q_lora_rank, h),
            f"{a}q_a_layernorm.weight": (m.q_lora_rank,),
            f"{a}q_b_proj.weight": (q_out, m.q_lora_rank),
        }
    else:
        shapes[f"{a}q_proj.weight"] = (q_out, h)
    return shapes


class RandomCheckpoint(TensorSource):
    """Drop-in for the runtime's ``Checkpoint`` that invents every tensor it is asked for.

    The runtime's :class:`TensorSource` supplies ``get`` (with the accounting, and ``shared=True``
    tensors such as a tied embedding created once and reused, as the real checkpoint does) and
    the name mapping; this class says how a tensor is made.
    """

    def __init__(self, spec: Architecture, *, seed: int = 0, name: str = "random") -> None:
        super().__init__()
        self.model_dir = Path(name)
        self.prefix = _PREFIX
        self._shapes = tensor_shapes(spec)
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def has(self, name: str) -> bool:
        return name in self._shapes

    def _fetch(
        self,
        name: str,
        dtype: torch.dtype | None,
        device: torch.device,
        dim: int = 0,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """A new tensor of the name's shape (of its ``ranges`` along ``dim``: a
        tensor-parallel shard), made directly on ``device`` in ``dtype``."""
        shape = self._shapes.get(name)
        if shape is None:
            raise CheckpointError(
                f"random weights: no shape known for tensor {name!r}; the runtime reads a "
                "tensor this profiler does not know how to invent (update tensor_shapes)"
            )
        if ranges is not None:
            shape = (*shape[:dim], sum(hi - lo for lo, hi in ranges), *shape[dim + 1 :])
        tensor = torch.empty(shape, dtype=dtype or torch.float32, device=device)
        gen = self._generator(device)
        with torch.no_grad():
            if len(shape) == 1:
                tensor.uniform_(0.5, 1.5, generator=gen)
            else:
                bound = (3.0 / shape[-1]) ** 0.5
                tensor.uniform_(-bound, bound, generator=gen)
        self._account(name, tensor)
        return tensor

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(str(device))
        if gen is None:
            gen = self._generators[str(device)] = torch.Generator(device=device)
            gen.manual_seed(self._seed)
        return gen

    # --- the runtime Checkpoint's name mapping ---------------------------------------------

    def lm_head_name(self) -> str:
        return (
            "lm_head.weight"
            if self.has("lm_head.weight")
            else self.model_name("embed_tokens.weight")
        )

    def moe_module(self, layer: int) -> str:
        del layer
        return "mlp."

    def load_experts(
        self,
        layer: int,
        num_experts: int,
        intermediate: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        channels: tuple[int, int] | None = None,
        experts: tuple[int, int] | None = None,
        in_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        del num_experts, in_out  # random weights are made in the compute layout
        base = self.layer_name(layer, "mlp.experts.")
        if experts is not None:
            return (
                self.get(f"{base}gate_up_proj", dtype=dtype, device=device, ranges=[experts]),
                self.get(f"{base}down_proj", dtype=dtype, device=device, ranges=[experts]),
            )
        if channels is None:
            return (
                self.get(f"{base}gate_up_proj", dtype=dtype, device=device),
                self.get(f"{base}down_proj", dtype=dtype, device=device),
            )
        lo, hi = channels
        gate_up = [(lo, hi), (intermediate + lo, intermediate + hi)]
        return (
            self.get(f"{base}gate_up_proj", dtype=dtype, device=device, dim=1, ranges=gate_up),
            self.get(f"{base}down_proj", dtype=dtype, device=device, dim=2, ranges=[channels]),
        )
