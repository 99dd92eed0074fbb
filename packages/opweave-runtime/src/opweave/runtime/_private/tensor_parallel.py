"""Real tensor parallelism inside a replica: operators sharded over its TP group.

Megatron-style: projections into heads / intermediate channels are split by output rows
(``qkv_proj``, ``gate_up_proj``, the experts' and shared expert's gate/up, linear attention's input
projections), attention runs on the rank's own heads and holds only their KV or recurrent state,
and the projections back to the hidden size (``o_proj``, ``down_proj``, experts' down, linear
``o_proj``) multiply their column shard and all-reduce the partial sums. ``lm_head`` splits the
vocabulary and all-gathers the logits (exact). Norms, rope, router, embedding and sampling run
replicated. Partial sums are added in a different order than one full matmul would, so results
equal the unsharded ones up to float rounding (greedy tokens agree in the tests).

Layouts: a tensor between two operators is either full or sharded along one dimension, described
by a :class:`Layout`. A segment may start or end anywhere (e.g. a CAD stage that is only
``core_attn``), so a sharded consumer slices a full input itself, a non-TP-aware operator gets its
inputs gathered, and whatever is still sharded at the end of a segment is all-gathered, because
messages between owners always carry full tensors.

An operator whose dimension does not divide by the TP degree stays replicated (exact, and
reported: ``tp_compute`` says whether anything was sharded).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .attention import CoreAttention, OProj, QkvProj
from .batch import TokenBatch
from .linear_attention import LinearCoreAttention, LinearOProj, LinearQkvProj
from .mlp import DownProj, Experts, GateUpProj, SharedExpert
from .ops import LmHead, Operator
from .rope import Rope


@dataclass(frozen=True)
class Layout:
    """Sharded along ``dim``: the full tensor is ``sections`` concatenated, each cut ``T`` ways."""

    dim: int
    sections: tuple[int, ...]

    def local(self, full: torch.Tensor, t: int, size: int) -> torch.Tensor:
        parts = torch.split(full, list(self.sections), dim=self.dim)
        return torch.cat([p.chunk(size, dim=self.dim)[t] for p in parts], dim=self.dim)


@dataclass
class TPGroup:
    rank: int
    size: int
    group: object
    comm_s: float = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)  # type: ignore[arg-type]
        self.comm_s += time.perf_counter() - start
        return x

    def gather(self, local: torch.Tensor, layout: Layout) -> torch.Tensor:
        start = time.perf_counter()
        local = local.contiguous()
        bufs = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(bufs, local, group=self.group)  # type: ignore[arg-type]
        split = [s // self.size for s in layout.sections]
        per_rank = [torch.split(b, split, dim=layout.dim) for b in bufs]
        out = torch.cat(
            [per_rank[r][i] for i in range(len(split)) for r in range(self.size)], dim=layout.dim
        )
        self.comm_s += time.perf_counter() - start
        return out


@dataclass
class TPOp:
    """A sharded operator: which inputs it wants sharded, which outputs it leaves sharded."""

    op: Operator
    needs: dict[str, Layout] = field(default_factory=dict)
    makes: dict[str, Layout] = field(default_factory=dict)
    keeps: bool = False  # head-wise op (rope): outputs keep their inputs' layouts
    forward: Callable[[TokenBatch], TokenBatch] | None = None

    @property
    def weight_sizes(self) -> dict[str, int]:
        return self.op.weight_sizes

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def op_class(self) -> str:
        return self.op.op_class


def _rows(t: torch.Tensor, lo: int, hi: int, block: int = 1) -> torch.Tensor:
    return t[lo * block : hi * block].clone()


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _resize(op: Operator, **named: torch.Tensor | None) -> None:
    """Swap ``op``'s weights for their shards and recount its resident bytes."""
    removed = sum(_nbytes(getattr(op, attr)) for attr in named)
    for attr, tensor in named.items():
        setattr(op, attr, tensor)
    total = op.weight_bytes - removed + sum(_nbytes(t) for t in named.values())
    op.weight_sizes = {f"layers.{op.layer}.{op.name}.tp_shard": total}


def shard_operators(
    operators: Sequence[Operator], tp_rank: int, tp_size: int, group: object, mode: str
) -> tuple[list[Operator | TPOp], TPGroup | None]:
    """Shard what divides evenly; ``mode='replicated'`` shards nothing."""
    if mode == "replicated" or tp_size == 1:
        return list(operators), None
    g = TPGroup(tp_rank, tp_size, group)
    out: list[Operator | TPOp] = []
    for op in operators:
        sharded = _shard(op, g)
        out.append(sharded if sharded is not None else op)
    return out, g


def _shard(op: Operator, g: TPGroup) -> TPOp | None:
    t, size, spec = g.rank, g.size, op.spec
    heads, kv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if isinstance(op, QkvProj):
        if heads % size or kv % size:
            return None
        h0, h1, k0, k1 = (
            t * heads // size,
            (t + 1) * heads // size,
            t * kv // size,
            (t + 1) * kv // size,
        )
        qblock = hd * (2 if spec.attn_output_gate else 1)
        _resize(
            op,
            wq=_rows(op.wq, h0, h1, qblock),
            bq=None if op.bq is None else _rows(op.bq, h0, h1, qblock),
            wk=_rows(op.wk, k0, k1, hd),
            bk=None if op.bk is None else _rows(op.bk, k0, k1, hd),
            wv=_rows(op.wv, k0, k1, hd),
            bv=None if op.bv is None else _rows(op.bv, k0, k1, hd),
        )
        return TPOp(op, makes=_attn_layouts(spec))
    if isinstance(op, Rope):
        return TPOp(op, keeps=True)
    if isinstance(op, CoreAttention):
        if heads % size or kv % size:
            return None
        op.spec = dataclasses.replace(spec, num_heads=heads // size, num_kv_heads=kv // size)
        return TPOp(op, needs=_attn_layouts(spec), makes={"hidden": Layout(1, (heads * hd,))})
    if isinstance(op, OProj):
        return None if heads % size else _split_input_columns(op, heads * hd, t, size, g)
    if isinstance(op, GateUpProj):
        inter = op.w_gate.shape[0]
        if inter % size:
            return None
        i0, i1 = t * inter // size, (t + 1) * inter // size
        _resize(
            op,
            w_gate=_rows(op.w_gate, i0, i1),
            b_gate=None if op.b_gate is None else _rows(op.b_gate, i0, i1),
            w_up=_rows(op.w_up, i0, i1),
            b_up=None if op.b_up is None else _rows(op.b_up, i0, i1),
        )
        return TPOp(op, makes={"hidden": Layout(1, (inter,))})
    if isinstance(op, DownProj):
        inter = op.weight.shape[1]
        return None if inter % size else _split_input_columns(op, inter, t, size, g)
    if isinstance(op, Experts):
        inter = op.down.shape[2]
        if inter % size:
            return None
        i0, i1 = t * inter // size, (t + 1) * inter // size
        gate_up = torch.cat((op.gate_up[:, i0:i1], op.gate_up[:, inter + i0 : inter + i1]), 1)
        _resize(op, gate_up=gate_up, down=op.down[:, :, i0:i1].clone())
        return TPOp(op, forward=_experts(op, g))
    if isinstance(op, SharedExpert):
        inter = op.w_gate.shape[0]
        if inter % size:
            return None
        i0, i1 = t * inter // size, (t + 1) * inter // size
        _resize(
            op,
            w_gate=_rows(op.w_gate, i0, i1),
            w_up=_rows(op.w_up, i0, i1),
            w_down=op.w_down[:, i0:i1].clone(),
            w_score=op.w_score,
        )
        return TPOp(op, forward=_shared_expert(op, g))
    if isinstance(op, LinearQkvProj | LinearCoreAttention | LinearOProj):
        return _shard_linear(op, g)
    if isinstance(op, LmHead):
        vocab = op.weight.shape[0]
        if vocab % size:
            return None
        _resize(op, weight=_rows(op.weight, t * vocab // size, (t + 1) * vocab // size))
        return TPOp(op, forward=_lm_head(op, g))
    return None


def _attn_layouts(spec) -> dict[str, Layout]:
    heads, kv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    return {
        "q": Layout(1, (heads,)),
        "k": Layout(1, (kv,)),
        "v": Layout(1, (kv,)),
        "attn_gate": Layout(1, (heads * hd,)),
    }


def _shard_linear(op: Operator, g: TPGroup) -> TPOp | None:
    """Gated DeltaNet split by key heads (each with its ``num_v / num_k`` value heads)."""
    spec, t, size = op.spec, g.rank, g.size
    la = spec.linear_attn
    assert la is not None
    if la.num_k_heads % size:
        return None
    nk, nv, dk, dv = la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim
    k0, k1, v0, v1 = t * nk // size, (t + 1) * nk // size, t * nv // size, (t + 1) * nv // size
    local_la = dataclasses.replace(la, num_k_heads=nk // size, num_v_heads=nv // size)
    local_spec = dataclasses.replace(spec, linear_attn=local_la)
    layouts = {
        "mixed_qkv": Layout(1, (la.key_dim, la.key_dim, la.value_dim)),
        "z": Layout(1, (nv,)),
        "b": Layout(1, (nv,)),
        "a": Layout(1, (nv,)),
    }
    if isinstance(op, LinearQkvProj):
        r = nv // nk
        _resize(
            op,
            w_qkvz=_rows(op.w_qkvz, k0, k1, 2 * dk + 2 * r * dv),
            w_ba=_rows(op.w_ba, k0, k1, 2 * r),
        )
        op.spec = local_spec
        return TPOp(op, makes=layouts)
    if isinstance(op, LinearCoreAttention):
        channels = torch.cat(
            (
                torch.arange(k0 * dk, k1 * dk),
                la.key_dim + torch.arange(k0 * dk, k1 * dk),
                2 * la.key_dim + torch.arange(v0 * dv, v1 * dv),
            )
        ).to(op.conv_weight.device)
        _resize(
            op,
            conv_weight=op.conv_weight[channels].clone(),
            conv_bias=None if op.conv_bias is None else op.conv_bias[channels].clone(),
            neg_a=op.neg_a[v0:v1].clone(),
            dt_bias=op.dt_bias[v0:v1].clone(),
            norm_weight=op.norm_weight,
        )
        op.la, op.spec = local_la, local_spec
        return TPOp(op, needs=layouts, makes={"hidden": Layout(1, (la.value_dim,))})
    assert isinstance(op, LinearOProj)
    n = la.value_dim // size
    _resize(op, weight=op.weight[:, t * n : (t + 1) * n].clone())
    return TPOp(op, needs={"hidden": Layout(1, (la.value_dim,))}, forward=_row_parallel(op, g))


def _split_input_columns(op: Operator, width: int, t: int, size: int, g: TPGroup) -> TPOp:
    """Row-parallel projection: rank ``t`` keeps its ``width / size`` input columns, and the
    partial outputs are summed across the group (o_proj, down_proj)."""
    n = width // size
    _resize(op, weight=op.weight[:, t * n : (t + 1) * n].clone(), bias=op.bias)
    return TPOp(op, needs={"hidden": Layout(1, (width,))}, forward=_row_parallel(op, g))


def _row_parallel(op: Operator, g: TPGroup) -> Callable[[TokenBatch], TokenBatch]:
    """``o_proj``/``down_proj``: column shard, all-reduce, then bias, post-norm and residual."""

    def forward(batch: TokenBatch) -> TokenBatch:
        out = g.all_reduce(F.linear(batch["hidden"], op.weight))  # type: ignore[attr-defined]
        if getattr(op, "bias", None) is not None:
            out = out + op.bias  # type: ignore[attr-defined]
        post = getattr(op, "post_norm", None)
        if post is not None:
            out = post(out)
        return batch.replace(drop=("residual",), hidden=batch["residual"] + out)

    return forward


def _experts(op: Experts, g: TPGroup) -> Callable[[TokenBatch], TokenBatch]:
    def forward(batch: TokenBatch) -> TokenBatch:
        x, ids, weights = batch["hidden"], batch["topk_ids"], batch["topk_weights"]
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            slot, rows = torch.where((ids == expert).T)
            gate, up = F.linear(x[rows], op.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(op.act(gate) * up, op.down[expert]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        out = g.all_reduce(out)
        drop = ("topk_ids", "topk_weights")
        if op.ends_layer:
            return batch.replace(drop=(*drop, "residual"), hidden=batch["residual"] + out)
        return batch.replace(drop=drop, moe_out=out)

    return forward


def _shared_expert(op: SharedExpert, g: TPGroup) -> Callable[[TokenBatch], TokenBatch]:
    def forward(batch: TokenBatch) -> TokenBatch:
        x = batch["hidden"]
        inner = op.act(F.linear(x, op.w_gate)) * F.linear(x, op.w_up)
        shared = g.all_reduce(F.linear(inner, op.w_down))
        shared = torch.sigmoid(F.linear(x, op.w_score)) * shared
        out = batch["moe_out"] + shared
        return batch.replace(drop=("moe_out", "residual"), hidden=batch["residual"] + out)

    return forward


def _lm_head(op: LmHead, g: TPGroup) -> Callable[[TokenBatch], TokenBatch]:
    def forward(batch: TokenBatch) -> TokenBatch:
        logits = g.gather(
            F.linear(batch["hidden"], op.weight), Layout(1, (op.weight.shape[0] * g.size,))
        )
        cap = op.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return batch.replace(drop=("hidden",), logits=logits)

    return forward


def run_sharded(ops: Sequence[Operator | TPOp], batch: TokenBatch, g: TPGroup) -> TokenBatch:
    """Run a segment's operators, tracking which tensors are sharded; return full tensors."""
    layouts: dict[str, Layout] = {}

    def gather_all() -> None:
        for name, lay in list(layouts.items()):
            batch.tensors[name] = g.gather(batch.tensors[name], lay)
        layouts.clear()

    for op in ops:
        if not isinstance(op, TPOp):
            gather_all()
            batch = op(batch)
            continue
        batch = TokenBatch(batch.meta, dict(batch.tensors))
        for name, lay in op.needs.items():
            if name in batch.tensors and name not in layouts:
                batch.tensors[name] = lay.local(batch.tensors[name], g.rank, g.size)
                layouts[name] = lay
        before = dict(batch.tensors)
        batch = (op.forward or op.op)(batch)
        new_layouts = {}
        for name, tensor in batch.tensors.items():
            if before.get(name) is tensor or (op.keeps and name in layouts):
                if name in layouts:
                    new_layouts[name] = layouts[name]
            elif name in op.makes:
                new_layouts[name] = op.makes[name]
        layouts = new_layouts
    gather_all()
    return batch
