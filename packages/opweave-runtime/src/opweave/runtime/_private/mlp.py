"""Feed-forward operators.

Dense layers run ``gate_up_proj`` then ``down_proj``; MoE layers run ``router``, ``experts`` and
(Qwen3-Next) ``shared_expert``.

Whichever of these ends a layer also does the residual add (and Gemma's post-feed-forward norm), so
a stage boundary after it carries only ``hidden``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import TokenBatch
from .config import ModelSpec
from .ops import Operator, RMSNorm, activation
from .weights import Checkpoint


class GateUpProj(Operator):
    """``act(gate(x)) * up(x)``: the two input projections and the activation between them."""

    name, op_class = "gate_up_proj", "gemm"

    def __init__(
        self, spec: ModelSpec, ckpt: Checkpoint, layer: int | None, device: torch.device | str
    ) -> None:
        super().__init__(spec, ckpt, layer, device)
        self.w_gate, self.b_gate = self._linear("mlp.gate_proj")
        self.w_up, self.b_up = self._linear("mlp.up_proj")
        self.act = activation(spec.hidden_act)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x = batch["hidden"]
        gate = F.linear(x, self.w_gate, self.b_gate)
        return batch.replace(hidden=self.act(gate) * F.linear(x, self.w_up, self.b_up))


class DownProj(Operator):
    """Output projection of the dense MLP, Gemma's post-feed-forward norm, and the residual add."""

    name, op_class = "down_proj", "gemm"

    def __init__(
        self, spec: ModelSpec, ckpt: Checkpoint, layer: int | None, device: torch.device | str
    ) -> None:
        super().__init__(spec, ckpt, layer, device)
        self.weight, self.bias = self._linear("mlp.down_proj")
        self.post_norm = None
        if spec.sandwich_norms:
            self.post_norm = RMSNorm(
                self._layer_tensor("post_feedforward_layernorm.weight"),
                spec.rms_norm_eps,
                gemma=True,
            )

    def forward(self, batch: TokenBatch) -> TokenBatch:
        out = F.linear(batch["hidden"], self.weight, self.bias)
        if self.post_norm is not None:
            out = self.post_norm(out)
        return batch.replace(drop=("residual",), hidden=batch["residual"] + out)


class Router(Operator):
    """Top-k expert choice per row: ``topk_ids [N, k]`` and their weights ``topk_weights``.

    Softmax over all experts, then top-k, then (optionally) renormalise over the chosen k; Mixtral
    always renormalises, which equals a softmax over its top-k logits, and keeps float32 weights.
    """

    name, op_class = "router", "gemm"

    def __init__(
        self, spec: ModelSpec, ckpt: Checkpoint, layer: int | None, device: torch.device | str
    ) -> None:
        super().__init__(spec, ckpt, layer, device)
        assert layer is not None and spec.moe is not None
        self.weight = self._layer_tensor(f"{ckpt.moe_module(layer)}gate.weight")

    def forward(self, batch: TokenBatch) -> TokenBatch:
        moe = self.spec.moe
        assert moe is not None
        logits = F.linear(batch["hidden"], self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.spec.family != "mixtral":
            weights = weights.to(logits.dtype)
        return batch.replace(topk_weights=weights, topk_ids=ids)


class Experts(Operator):
    """The routed experts: rows gathered per expert, summed in expert order as transformers does."""

    name, op_class = "experts", "gemm"

    def __init__(
        self, spec: ModelSpec, ckpt: Checkpoint, layer: int | None, device: torch.device | str
    ) -> None:
        super().__init__(spec, ckpt, layer, device)
        assert layer is not None and spec.moe is not None
        self.gate_up, self.down = ckpt.load_experts(
            layer, spec.moe.num_experts, dtype=self.dtype, device=self.device
        )
        for part, tensor in (("gate_up", self.gate_up), ("down", self.down)):
            self.weight_sizes[f"layers.{layer}.experts.{part}"] = (
                tensor.numel() * tensor.element_size()
            )
        self.act = activation(spec.hidden_act)
        self.ends_layer = spec.moe.shared_intermediate_size == 0

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x, ids, weights = batch["hidden"], batch["topk_ids"], batch["topk_weights"]
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            slot, rows = torch.where((ids == expert).T)
            gate, up = F.linear(x[rows], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down[expert]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if self.ends_layer:
            return batch.replace(
                drop=("topk_ids", "topk_weights", "residual"), hidden=batch["residual"] + out
            )
        return batch.replace(drop=("topk_ids", "topk_weights"), moe_out=out)


class SharedExpert(Operator):
    """Qwen3-Next's always-on expert, scaled by a per-row sigmoid gate, added to the routed sum."""

    name, op_class = "shared_expert", "gemm"

    def __init__(
        self, spec: ModelSpec, ckpt: Checkpoint, layer: int | None, device: torch.device | str
    ) -> None:
        super().__init__(spec, ckpt, layer, device)
        self.w_gate = self._layer_tensor("mlp.shared_expert.gate_proj.weight")
        self.w_up = self._layer_tensor("mlp.shared_expert.up_proj.weight")
        self.w_down = self._layer_tensor("mlp.shared_expert.down_proj.weight")
        self.w_score = self._layer_tensor("mlp.shared_expert_gate.weight")
        self.act = activation(spec.hidden_act)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x = batch["hidden"]
        shared = F.linear(self.act(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)
        shared = torch.sigmoid(F.linear(x, self.w_score)) * shared
        out = batch["moe_out"] + shared
        return batch.replace(drop=("moe_out", "residual"), hidden=batch["residual"] + out)
