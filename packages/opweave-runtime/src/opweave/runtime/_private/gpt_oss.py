"""gpt-oss's feed-forward: a biased router with a softmax over the top-k logits, and experts
with biases and a clamped SwiGLU, stored as transformers stores them (``gate_up_proj``
``[E, hidden, 2I]`` with gate and up interleaved channel by channel, ``down_proj``
``[E, I, hidden]``), from BF16/FP32 checkpoints or the released MXFP4 ones, whose packed
experts are stored the other way round (``[E, out, in / 32, 16]``, as transformers reads them).

Under TP a rank holds the intermediate channels ``[lo, hi)`` of every expert (the interleaved
gate/up columns ``[2 lo, 2 hi)``); the down projection's partial sums are all-reduced and the
down bias is added by the group's first rank only, so it is counted once.
"""

from __future__ import annotations

import torch

from ..errors import ShardingError
from .batch import TokenBatch
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


class GptOssExperts(Operator):
    """The routed experts, summed in ascending expert order as transformers does."""

    name, op_class = "experts", "gemm"

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        moe = self.arch.moe
        assert layer is not None and moe is not None
        if ctx.ep is not None:
            raise ShardingError(f"L{layer}.experts: gpt-oss's experts do not run expert-parallel")
        inter = moe.intermediate_size
        lo, hi = (0, inter)
        if self.sharded:
            lo, hi = self.shard.part(inter, f"L{layer}.experts: intermediate size")
        base = f"{ctx.ckpt.moe_module(layer)}experts."
        pairs = [(2 * lo, 2 * hi)] if self.sharded else None
        own = [(lo, hi)] if self.sharded else None
        if ctx.ckpt.has(ctx.ckpt.layer_name(layer, base + "gate_up_proj_blocks")):  # MXFP4
            gate_up = self._layer_tensor(base + "gate_up_proj", dim=1, ranges=pairs)
            down = self._layer_tensor(base + "down_proj", dim=2, ranges=own)
            self.gate_up = gate_up.transpose(1, 2).contiguous()
            self.down = down.transpose(1, 2).contiguous()
        else:
            self.gate_up = self._layer_tensor(base + "gate_up_proj", dim=2, ranges=pairs)
            self.down = self._layer_tensor(base + "down_proj", dim=1, ranges=own)
        self.gate_up_bias = self._layer_tensor(base + "gate_up_proj_bias", dim=1, ranges=pairs)
        down_bias = self._layer_tensor(base + "down_proj_bias")
        # added before the reduce on one rank of the group: sum_r (partial_r) + b, weighted
        self.down_bias = down_bias if self.shard.rank == 0 else torch.zeros_like(down_bias)
        self.limit = moe.swiglu_limit
        self.alpha = moe.swiglu_alpha

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x, ids, weights = batch["hidden"], batch["topk_ids"], batch["topk_weights"]
        if batch.step is not None:
            out = self._gathered(x, ids, weights)
        else:
            out = torch.zeros_like(x)
            for expert in torch.unique(ids).tolist():
                slot, rows = torch.where((ids == expert).T)
                gated = self._gate(x[rows] @ self.gate_up[expert] + self.gate_up_bias[expert])
                y = (gated @ self.down[expert] + self.down_bias[expert]) * weights[rows, slot, None]
                out.index_add_(0, rows, y.to(out.dtype))
        out = self._reduce(out)
        return batch.replace(
            drop=("topk_ids", "topk_weights", "residual"), hidden=batch["residual"] + out
        )

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
