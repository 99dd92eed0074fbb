"""Feed-forward operators.

Dense layers run ``gate_up_proj`` then ``down_proj``; MoE layers run ``router``, ``experts`` and
(Qwen3-Next) ``shared_expert``.

Whichever of these ends a layer also does the residual add (and Gemma's post-feed-forward norm), so
a stage boundary after it carries only ``hidden``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opweave.costmodel import ExpertsSpec

from .batch import TokenBatch
from .expert_parallel import ExpertShard, expert_sets
from .ops import OpContext, Operator, RMSNorm, activation, linear
from .tensor_parallel import Layout


class GateUpProj(Operator):
    """``act(gate(x)) * up(x)``: the two input projections and the activation between them."""

    name, op_class = "gate_up_proj", "gemm"
    linear_weights = ("w_gate", "w_up")
    same_input = (linear_weights,)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        inter = self.arch.intermediate_size
        rows = None
        if self.sharded:
            rows = [self.shard.part(inter, f"L{layer}.gate_up_proj: intermediate size")]
            self.tp_out = {"hidden": Layout(1, (inter,))}
        self.w_gate, self.b_gate = self._column_parallel("mlp.gate_proj", rows)
        self.w_up, self.b_up = self._column_parallel("mlp.up_proj", rows)
        self.act = activation(self.arch.hidden_act)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x = batch["hidden"]
        gate = linear(x, self.w_gate, self.b_gate)
        return batch.replace(hidden=self.act(gate) * linear(x, self.w_up, self.b_up))


class DownProj(Operator):
    """Output projection of the dense MLP, Gemma's post-feed-forward norm, and the residual add."""

    name, op_class = "down_proj", "gemm"
    linear_weights = ("weight",)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        inter = self.arch.intermediate_size
        cols = None
        if self.sharded:
            cols = [self.shard.part(inter, f"L{layer}.down_proj: intermediate size")]
            self.tp_in = {"hidden": Layout(1, (inter,))}
        self.weight, self.bias = self._row_parallel("mlp.down_proj", cols)
        self.post_norm = None
        if self.arch.sandwich_norms:
            self.post_norm = RMSNorm(
                self._layer_tensor("post_feedforward_layernorm.weight"),
                self.arch.rms_norm_eps,
                gemma=True,
            )

    def forward(self, batch: TokenBatch) -> TokenBatch:
        out = self._project_back(batch["hidden"], self.weight, self.bias)
        if self.post_norm is not None:
            out = self.post_norm(out)
        return batch.replace(drop=("residual",), hidden=batch["residual"] + out)


class Router(Operator):
    """Top-k expert choice per row: ``topk_ids [N, k]`` and their weights ``topk_weights``.

    Softmax over all experts, then top-k, then (optionally) renormalise over the chosen k; Mixtral
    always renormalises, which equals a softmax over its top-k logits, and keeps float32 weights.
    Replicated under TP (every rank routes its rows the same way).
    """

    name, op_class = "router", "gemm"
    linear_weights = ("weight",)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        assert layer is not None and self.arch.moe is not None
        self.weight = self._layer_tensor(f"{ctx.ckpt.moe_module(layer)}gate.weight")

    def forward(self, batch: TokenBatch) -> TokenBatch:
        moe = self.arch.moe
        assert moe is not None
        logits = linear(batch["hidden"], self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not moe.routing_weights_fp32:
            weights = weights.to(logits.dtype)
        return batch.replace(topk_weights=weights, topk_ids=ids)


class GroupLimitedRouter(Operator):
    """DeepSeek-V3's (and MiniMax-M2's) router: sigmoid (or softmax) scores; experts chosen on
    the scores plus the ``e_score_correction_bias`` (the noaux_tc gate; selection only), from
    the ``topk_group`` groups whose two best experts score highest (of ``n_group``); the chosen
    scores renormalised (``norm_topk_prob``) and times ``routed_scaling_factor`` (DeepSeek-V3
    report, arXiv:2412.19437, §2.1.2; transformers' ``DeepseekV3TopkRouter``). Scores and
    weights stay in float32, with the gate weight kept in float32 as the checkpoints ship it.
    Replicated under TP."""

    name, op_class = "router", "gemm"

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        moe = self.arch.moe
        assert layer is not None and moe is not None
        module = ctx.ckpt.moe_module(layer)
        self.weight = self._fp32(f"{module}gate.weight")
        self.bias = None
        if moe.score_correction_bias:  # DeepSeek's sits in the gate, MiniMax's beside it
            name = f"{module}gate.e_score_correction_bias"
            if not ctx.ckpt.has(ctx.ckpt.layer_name(layer, name)):
                name = f"{module}e_score_correction_bias"
            self.bias = self._fp32(name)

    def _fp32(self, suffix: str) -> torch.Tensor:
        assert self.layer is not None
        name = self._ckpt.layer_name(self.layer, suffix)
        tensor = self._ckpt.get(name, dtype=torch.float32, device=self.device)
        self.weight_sizes[name] = tensor.numel() * tensor.element_size()
        return tensor

    def forward(self, batch: TokenBatch) -> TokenBatch:
        moe = self.arch.moe
        assert moe is not None
        logits = F.linear(batch["hidden"].float(), self.weight)
        if moe.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = torch.softmax(logits, dim=-1)
        choice = scores if self.bias is None else scores + self.bias
        if moe.num_groups > 1:
            n, groups = choice.shape[0], moe.num_groups
            grouped = choice.view(n, groups, -1)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(best)
            keep.scatter_(1, torch.topk(best, k=moe.topk_groups, dim=-1, sorted=False)[1], 1)
            allowed = keep[:, :, None].expand_as(grouped).reshape(n, -1).bool()
            choice = choice.masked_fill(~allowed, float("-inf"))
        ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * moe.routed_scaling_factor
        return batch.replace(topk_weights=weights, topk_ids=ids)


def router_class(moe: ExpertsSpec) -> type[Operator]:
    """The router a model's MoE layers run: plain top-k of a softmax, or group-limited."""
    plain = (
        moe.scoring_func == "softmax"
        and moe.num_groups == 1
        and not moe.score_correction_bias
        and moe.routed_scaling_factor == 1.0
    )
    return Router if plain else GroupLimitedRouter


class Experts(Operator):
    """The routed experts: rows gathered per expert, summed in expert order as transformers does.

    Each rank holds its :class:`~.expert_parallel.ExpertShard` of them: every expert's slice of
    the intermediate channels under plain TP, a set of whole experts (or their channel slices)
    under expert parallelism. It adds what its experts contribute to every row it sees; the
    partial sums are all-reduced over the TP group, or, under data-parallel attention, exchanged
    over the plan replica (:mod:`.expert_parallel`).
    """

    name, op_class = "experts", "gemm"

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        moe = self.arch.moe
        assert layer is not None and moe is not None
        self._load(ctx, *self._place(ctx))
        self.ends_layer = moe.shared_intermediate_size == 0

    def _load(self, ctx: OpContext, shard: ExpertShard, channels: tuple[int, int] | None) -> None:
        """Read this rank's weights: its :attr:`held` experts, ``channels`` of each (None:
        all). A family whose experts are stored otherwise overrides this."""
        del shard
        moe, layer = self.arch.moe, self.layer
        assert moe is not None and layer is not None
        self.gate_up, self.down = ctx.ckpt.load_experts(
            layer,
            moe.num_experts,
            moe.intermediate_size,
            dtype=self.dtype,
            device=self.device,
            channels=channels,
            experts=None if self.held == (0, moe.num_experts) else self.held,
            in_out=moe.experts_in_out,
        )
        for part, tensor in (("gate_up", self.gate_up), ("down", self.down)):
            self.weight_sizes[f"layers.{layer}.experts.{part}"] = (
                tensor.numel() * tensor.element_size()
            )
        self.act = activation(self.arch.hidden_act)

    def _place(self, ctx: OpContext) -> tuple[ExpertShard, tuple[int, int] | None]:
        """This rank's share of the layer's experts: sets :attr:`held` (``[lo, hi)``),
        :attr:`sets` (each expert's set) and :attr:`ep`; the shard and the channels of each
        held expert (None: all)."""
        moe = self.arch.moe
        assert moe is not None
        what = f"L{self.layer}.experts"
        shard = ctx.experts or ExpertShard(self.shard.rank, self.shard.size)
        self.ep = ctx.ep
        self.held = shard.experts(moe.num_experts, what)
        self.sets = expert_sets(moe.num_experts, shard.ep).to(self.device)
        return shard, shard.channels(moe.intermediate_size, f"{what}: intermediate size")

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x, ids, weights = batch["hidden"], batch["topk_ids"], batch["topk_weights"]
        if self.ep is None:  # every row here: this rank's share, summed over TP by _finish
            static = batch.step is not None
            out = self._routed(x, *self._local(ids, weights, static=static), static=static)
            return self._finish(batch, out, reduce=True)
        return self._finish(batch, self._exchange(x, ids, weights), reduce=False)

    def _exchange(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """What the experts of the whole plan replica add to these rows, by the replica's
        exchange: all-to-all where each rank holds one set (eager steps), else gathered."""
        assert self.ep is not None
        if self.ep.all_to_all_form and not torch.compiler.is_compiling():
            lo, hi = self.ep.tp_rows(x.shape[0])
            part = self._all_to_all(x[lo:hi], ids[lo:hi], weights[lo:hi])
            return self.ep.tp_assemble(part, x.shape[0])
        return self._gathered_exchange(x, ids, weights)

    def _all_to_all(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """EP's all-to-all: each (row, choice) pair, in ascending expert order, to the rank
        holding the expert; the weighted results back, added to their rows in that order (as
        the per-expert form adds them). Routing travels in float32 beside the row (exact)."""
        assert self.ep is not None
        ep, (lo, _), k = self.ep, self.held, ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts, rows = flat[order], torch.div(order, k, rounding_mode="floor")
        routing = weights.reshape(-1)[order]
        send = torch.bincount(self.sets[experts], minlength=ep.size)
        matrix = ep.counts(send)
        pairs = torch.cat(
            [x[rows].float(), experts[:, None].float(), routing[:, None].float()], dim=1
        )
        got = ep.all_to_all(pairs, matrix)
        h = x.shape[1]
        y = self._routed(
            got[:, :h].to(x.dtype),
            got[:, h : h + 1].to(ids.dtype) - lo,
            got[:, h + 1 :].to(weights.dtype),
            static=False,
        )
        back = ep.all_to_all(y, [list(col) for col in zip(*matrix, strict=True)])
        return torch.zeros_like(x).index_add_(0, rows, back)

    def _gathered_exchange(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Every attention replica's rows to every rank of the plan replica, each adding its
        own experts' share, the shares summed back (routing travels in float32: exact)."""
        assert self.ep is not None
        hidden, k = x.shape[1], ids.shape[1]
        packed = torch.cat([x.float(), ids.float(), weights.float()], dim=1)
        static = torch.compiler.is_compiling()
        rows, counts = self.ep.dispatch(packed) if static else self.ep.gather(packed)
        local_ids, local_weights = self._local(
            rows[:, hidden : hidden + k].to(ids.dtype),
            rows[:, hidden + k :].to(weights.dtype),
            static=static,
        )
        out = self._routed(rows[:, :hidden].to(x.dtype), local_ids, local_weights, static=static)
        return self.ep.combine(out, counts)

    def idle(self) -> None:
        """Join the replica's exchanges with no rows: this rank has no requests in the step the
        others run (its attention replica holds none of the microbatch's)."""
        assert self.ep is not None and self.arch.moe is not None
        hidden, k = self.arch.hidden_size, self.arch.moe.top_k
        x = torch.zeros((0, hidden), dtype=self.dtype, device=self.device)
        ids = torch.zeros((0, k), dtype=torch.int64, device=self.device)
        weights = torch.zeros((0, k), dtype=torch.float32, device=self.device)
        self._exchange(x, ids, weights)

    def _routed(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, static: bool
    ) -> torch.Tensor:
        """What experts ``ids`` (indices into those held here; -1: held elsewhere, skipped)
        add to each row."""
        if static:
            return self._gathered(x, ids, weights)
        out = torch.zeros_like(x)
        for expert in torch.unique(ids[ids >= 0]).tolist():
            slot, rows = torch.where((ids == expert).T)
            y = self._apply(expert, x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def _apply(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Held expert ``expert`` on rows ``x`` (its share, where its channels are split)."""
        gate, up = F.linear(x, self.gate_up[expert]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down[expert])

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The static decode step's form: each row multiplies the weights of its own top-k
        experts (gathered, so the shapes do not depend on the routing), and the k results are
        summed in ascending expert order, as the per-expert form adds them."""
        ids, order = torch.sort(ids, dim=-1)
        weights = torch.gather(weights, 1, order)
        gate, up = (self.gate_up[ids] @ x[:, None, :, None])[..., 0].chunk(2, dim=-1)
        y = (self.down[ids] @ (self.act(gate) * up)[..., None])[..., 0] * weights[..., None]
        out = torch.zeros_like(x)
        for j in range(ids.shape[1]):
            out = out + y[:, j].to(out.dtype)
        return out

    def _local(
        self, ids: torch.Tensor, weights: torch.Tensor, *, static: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing as indices into the experts held here. A row's choice of an expert held
        elsewhere becomes -1 (skipped), or, in a static step (whose shapes cannot depend on
        the routing), held expert 0 at weight zero (it adds exactly nothing)."""
        assert self.arch.moe is not None
        lo, hi = self.held
        if (lo, hi) == (0, self.arch.moe.num_experts):
            return ids, weights
        here = (ids >= lo) & (ids < hi)
        weights = torch.where(here, weights, torch.zeros_like(weights))
        elsewhere = torch.full_like(ids, 0 if static else -1)
        return torch.where(here, ids - lo, elsewhere), weights

    def _finish(self, batch: TokenBatch, out: torch.Tensor, *, reduce: bool) -> TokenBatch:
        """The layer's residual add (after the TP reduce, where the shares are not summed
        yet), or the routed sum handed to the shared expert."""
        if reduce:
            out = self._reduce(out)
        if self.ends_layer:
            return batch.replace(
                drop=("topk_ids", "topk_weights", "residual"), hidden=batch["residual"] + out
            )
        return batch.replace(drop=("topk_ids", "topk_weights"), moe_out=out)


class SharedExpert(Operator):
    """The always-on expert added to the routed sum: Qwen3-Next's (``mlp.shared_expert``,
    scaled by a per-row sigmoid gate) or DeepSeek-V3's (``mlp.shared_experts``, ungated)."""

    name, op_class = "shared_expert", "gemm"
    linear_weights = ("w_gate", "w_up", "w_down", "w_score")
    same_input = (("w_gate", "w_up", "w_score"),)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        moe = self.arch.moe
        assert moe is not None
        rows = cols = None
        if self.sharded:
            part = self.shard.part(
                moe.shared_intermediate_size, f"L{layer}.shared_expert: intermediate size"
            )
            rows, cols = [part], [part]
        assert layer is not None
        module = "mlp.shared_expert"
        if ctx.ckpt.has(ctx.ckpt.layer_name(layer, "mlp.shared_experts.gate_proj.weight")):
            module = "mlp.shared_experts"
        self.w_gate = self._layer_tensor(f"{module}.gate_proj.weight", ranges=rows)
        self.w_up = self._layer_tensor(f"{module}.up_proj.weight", ranges=rows)
        self.w_down = self._layer_tensor(f"{module}.down_proj.weight", dim=1, ranges=cols)
        self.w_score = None
        if moe.shared_expert_gate:
            self.w_score = self._layer_tensor("mlp.shared_expert_gate.weight")
        self.act = activation(self.arch.hidden_act)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        x = batch["hidden"]
        inner = self.act(linear(x, self.w_gate)) * linear(x, self.w_up)
        shared = self._reduce(linear(inner, self.w_down))
        if self.w_score is not None:
            shared = torch.sigmoid(linear(x, self.w_score)) * shared
        out = batch["moe_out"] + shared
        return batch.replace(drop=("moe_out", "residual"), hidden=batch["residual"] + out)
