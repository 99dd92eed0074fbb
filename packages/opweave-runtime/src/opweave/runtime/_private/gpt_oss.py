"""gpt-oss's feed-forward: a biased router with a softmax over the top-k logits, and experts
with biases and a clamped SwiGLU, stored as transformers stores them (``gate_up_proj``
``[E, hidden, 2I]`` with gate and up interleaved channel by channel, ``down_proj``
``[E, I, hidden]``), from BF16/FP32 checkpoints or the released MXFP4 ones, whose packed
experts are stored the other way round (``[E, out, in / 32, 16]``, as transformers reads them).

A rank holds its experts' intermediate channels ``[lo, hi)`` (the interleaved gate/up columns
``[2 lo, 2 hi)``): every expert's under TP, its expert set's under expert parallelism; the down
projection's partial sums are summed over the group and the down bias is added by the first
rank of each expert set only, so it is counted once.
"""

from __future__ import annotations

import torch

from .batch import TokenBatch
from .expert_parallel import ExpertShard
from .mlp import Experts
from .ops import OpContext, Operator, linear


class GptOssRouter(Operator):
    """``topk`` of the biased router logits, then a softmax over those k (transformers'
    ``GptOssTopKRouter``), in the model's dtype. Replicated under TP."""

    name, op_class = "router", "gemm"
    linear_weights = ("weight",)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        assert layer is not None
        module = ctx.ckpt.moe_module(layer)
        self.weight = self._layer_tensor(f"{module}router.weight")
        self.bias = self._layer_tensor(f"{module}router.bias")

    def forward(self, batch: TokenBatch) -> TokenBatch:
        moe = self.arch.moe
        assert moe is not None
        logits = linear(batch["hidden"], self.weight, self.bias)
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
        return batch.replace(topk_weights=weights, topk_ids=ids)


class GptOssExperts(Experts):
    """The routed experts, summed in ascending expert order as transformers does; sharded and
    exchanged as :class:`~.mlp.Experts` are (a rank holds its experts' channels ``[lo, hi)``)."""

    def _load(self, ctx: OpContext, shard: ExpertShard, channels: tuple[int, int] | None) -> None:
        moe, layer = self.arch.moe, self.layer
        assert moe is not None and layer is not None
        self.experts = None if self.held == (0, moe.num_experts) else self.held
        pairs = own = None
        if channels is not None:
            lo, hi = channels
            pairs, own = [(2 * lo, 2 * hi)], [(lo, hi)]
        base = f"{ctx.ckpt.moe_module(layer)}experts."
        if ctx.ckpt.has(ctx.ckpt.layer_name(layer, base + "gate_up_proj_blocks")):  # MXFP4
            gate_up = self._cut(base + "gate_up_proj", 1, pairs)
            down = self._cut(base + "down_proj", 2, own)
            self.gate_up = gate_up.transpose(1, 2).contiguous()
            self.down = down.transpose(1, 2).contiguous()
        else:
            self.gate_up = self._cut(base + "gate_up_proj", 2, pairs)
            self.down = self._cut(base + "down_proj", 1, own)
        self.gate_up_bias = self._cut(base + "gate_up_proj_bias", 1, pairs)
        down_bias = self._cut(base + "down_proj_bias", 1, None)
        # added before the sum on one rank of each expert set: sum_r (partial_r) + b, weighted
        first = shard.index % shard.expert_tp == 0
        self.down_bias = down_bias if first else torch.zeros_like(down_bias)
        # the config's clamp, as OpenAI's reference (gpt_oss/torch/model.py) and transformers
        # 5.19 read it; vLLM 0.32 and transformers before 5.19 fix it at 7.0, which every
        # released checkpoint has (the tiny model's 1.5 tells them apart)
        self.limit = moe.swiglu_limit
        self.alpha = moe.swiglu_alpha

    def _cut(self, suffix: str, dim: int, ranges: list[tuple[int, int]] | None) -> torch.Tensor:
        """A ``[E, ...]`` tensor's held experts, and of those the ``ranges`` along ``dim``
        (all when ``None``)."""
        assert self.layer is not None
        name = self._ckpt.layer_name(self.layer, suffix)
        if self.experts is None or ranges is None:
            if self.experts is None:
                return self._tensor(name, dim=dim, ranges=ranges)
            return self._tensor(name, ranges=[self.experts])
        (lo, hi), parts = ranges[0], []
        for e in range(*self.experts):  # one held expert at a time, read whole, then cut
            whole = self._ckpt.get(name, dtype=self.dtype, device=self.device, ranges=[(e, e + 1)])
            parts.append(whole.narrow(dim, lo, hi - lo))
        tensor = torch.cat(parts)
        self.weight_sizes[name] = tensor.numel() * tensor.element_size()
        return tensor

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _apply(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gated = self._gate(x @ self.gate_up[expert] + self.gate_up_bias[expert])
        return gated @ self.down[expert] + self.down_bias[expert]

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The static decode step's form: each row's own k experts gathered (shapes independent
        of the routing), summed in ascending expert order."""
        ids, order = torch.sort(ids, dim=-1)
        weights = torch.gather(weights, 1, order)
        gate_up = (x[:, None, None, :] @ self.gate_up[ids])[:, :, 0] + self.gate_up_bias[ids]
        gated = self._gate(gate_up)
        y = (gated[:, :, None, :] @ self.down[ids])[:, :, 0] + self.down_bias[ids]
        y = y * weights[..., None]
        out = torch.zeros_like(x)
        for j in range(ids.shape[1]):
            out = out + y[:, j].to(out.dtype)
        return out
