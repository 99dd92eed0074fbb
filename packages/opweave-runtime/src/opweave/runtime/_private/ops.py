"""Operator base classes and the model-level and normalisation operators.

An operator owns exactly the tensors of its step (read by name from the checkpoint; under tensor
parallelism only its rank's slices, see :mod:`.tensor_parallel`), maps one :class:`TokenBatch`
to the next, and (for ``core_attn``) the per-request state of its layer. The numerics follow
transformers step for step wherever rounding could differ (which products run in float32, when a
result is cast back), because plans are checked token for token against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol

import torch
import torch.nn.functional as F

from opweave.costmodel import Architecture

from ..errors import RequestStateError, UnsupportedModelError
from .batch import TokenBatch
from .expert_parallel import EPComm, ExpertShard
from .tensor_parallel import Layout, Shard, TPComm
from .weights import TensorSource

OpClass = Literal["attention", "gemm", "small"]
Ranges = Sequence[tuple[int, int]]


class PackedWeight:
    """A projection's weight prepacked for another library's GEMM (vLLM's oneDNN kernels, see
    :mod:`opweave.runtime.vllm`); :func:`linear` calls it instead of ``F.linear``."""

    def __init__(self, weight: torch.Tensor, mm: Callable[..., torch.Tensor]) -> None:
        self.shape = weight.shape
        self.dtype = weight.dtype
        self._mm = mm

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._mm(x, bias)


def linear(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias``: ``F.linear``, or a prepacked weight's own GEMM."""
    if isinstance(weight, PackedWeight):
        return weight(x.contiguous(), bias)
    return F.linear(x, weight, bias)


class KernelChoice(Protocol):
    """Which class to build an operator as, and what to do once it is built
    (:class:`~.kernels.KernelSet`); ``shared``: the stage's scratch space for its kernels."""

    shared: dict

    def operator_class(
        self, base: type[Operator], model: object, ctx: OpContext, layer: int | None
    ) -> type[Operator]: ...

    def finish(self, op: Operator) -> None: ...


@dataclass
class OpContext:
    """What every operator is built from: the model, where its tensors are, where it runs."""

    arch: Architecture
    ckpt: TensorSource
    device: torch.device
    dtype: torch.dtype
    shard: Shard = field(default_factory=Shard)
    comm: TPComm | None = None
    kernels: KernelChoice | None = None  # the stage's kernels (None: the runtime's own)
    kv_cache_dtype: torch.dtype | None = None  # softmax attention's KV cache (None: ``dtype``)
    ep: EPComm | None = None  # the replica's expert exchange (None: every row here)
    experts: ExpertShard | None = None  # the routed experts held here (None: TP's share)


class Operator:
    """One step of the decode sequence, holding only its own weights (or its shard of them).

    ``tp_in``: inputs this operator computes on sharded (a full one is sliced first);
    ``tp_pass``: inputs it accepts in either layout and passes on unchanged in kind (rope);
    ``tp_out``: outputs it leaves sharded. All three are empty without tensor parallelism.
    """

    name: ClassVar[str]
    op_class: ClassVar[OpClass]
    # whether :meth:`forward` also runs a static-shape decode step (``batch.step``, see
    # :mod:`.decode`): tensor code only, no host synchronisation, traceable by torch.compile
    static_decode: ClassVar[bool] = True
    # attributes holding projection weights that :func:`linear` multiplies by (packable)
    linear_weights: ClassVar[tuple[str, ...]] = ()
    # groups of those that multiply one and the same input (a prepacked GEMM may run each
    # group as one wider GEMM)
    same_input: ClassVar[tuple[tuple[str, ...], ...]] = ()

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        self.arch = ctx.arch
        self.layer = layer
        self.device = ctx.device
        self.dtype = ctx.dtype
        self.shard = ctx.shard
        self.comm = ctx.comm
        self.tp_in: dict[str, Layout] = {}
        self.tp_pass: frozenset[str] = frozenset()
        self.tp_out: dict[str, Layout] = {}
        # checkpoint name -> bytes this operator holds for it (in the compute dtype)
        self.weight_sizes: dict[str, int] = {}
        self._ckpt = ctx.ckpt

    @property
    def sharded(self) -> bool:
        return self.shard.size > 1

    @property
    def weight_bytes(self) -> int:
        """Resident weight bytes of this operator."""
        return sum(self.weight_sizes.values())

    def _tensor(
        self, name: str, *, shared: bool = False, dim: int = 0, ranges: Ranges | None = None
    ) -> torch.Tensor:
        tensor = self._ckpt.get(
            name, dtype=self.dtype, device=self.device, shared=shared, dim=dim, ranges=ranges
        )
        self.weight_sizes[name] = tensor.numel() * tensor.element_size()
        return tensor

    def _layer_tensor(self, suffix: str, **kw: object) -> torch.Tensor:
        assert self.layer is not None
        return self._tensor(self._ckpt.layer_name(self.layer, suffix), **kw)  # type: ignore[arg-type]

    def _optional_layer_tensor(self, suffix: str, **kw: object) -> torch.Tensor | None:
        assert self.layer is not None
        name = self._ckpt.layer_name(self.layer, suffix)
        return self._tensor(name, **kw) if self._ckpt.has(name) else None  # type: ignore[arg-type]

    def _column_parallel(
        self, module: str, rows: Ranges | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias (if the checkpoint has one) of a linear ``module``, output rows
        ``rows`` only (``None``: all)."""
        weight = self._layer_tensor(f"{module}.weight", ranges=rows)
        return weight, self._optional_layer_tensor(f"{module}.bias", ranges=rows)

    def _row_parallel(
        self, module: str, cols: Ranges | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight (input columns ``cols`` only) and full bias, added once after the reduce."""
        weight = self._layer_tensor(f"{module}.weight", dim=1, ranges=cols)
        return weight, self._optional_layer_tensor(f"{module}.bias")

    def _project_back(
        self, x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """A row-parallel projection to the hidden size: partial sums all-reduced, then the
        bias. Unsharded it is one ``F.linear``, exactly transformers' rounding."""
        if self.comm is None:
            return linear(x, weight, bias)
        out = self.comm.all_reduce(linear(x, weight))
        return out if bias is None else out + bias

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results over the TP group (identity without TP)."""
        return x if self.comm is None else self.comm.all_reduce(x)

    def forward(self, batch: TokenBatch) -> TokenBatch:
        raise NotImplementedError

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        return self.forward(batch)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer={self.layer}, name={self.name!r})"


class SlabPool:
    """The static decode step's state slabs of all of a stage's layers of one kind, stacked.

    Every member layer's slab ``j`` is ``tensors[j][i]`` (``i``: the layer's index in the pool),
    with a row per state row and, for attention, a slot per cached token. One stacked tensor per
    kind instead of one per layer means a compiled step has one set of (symbolic) slab sizes,
    not one per layer, so its launch checks and converts a handful of sizes whatever the depth.
    The members grow together (they hold the same requests): a slab short of rows or tokens
    doubles what is short, copying what it held, and the members' state views move along.
    """

    def __init__(self, members: Sequence[StatefulOperator]) -> None:
        self.members = list(members)
        self.tensors: tuple[torch.Tensor, ...] = ()
        self._size = (0, 0)  # (rows, tokens) a member's slabs hold
        self._limit = self.members[0].slab_token_limit()  # a window, or None
        self.version = 0  # how many times the slabs were allocated
        for i, op in enumerate(self.members):
            op._slab_pool, op._slab_index = self, i

    @property
    def growing_dims(self) -> tuple[int, ...]:
        """The stacked slabs' dimensions that grow (rows, and tokens for attention), which a
        compiled step treats as symbolic sizes."""
        dim = self.members[0].slab_token_dim  # of one layer's slab; the stack adds the layers
        return (1,) if dim is None else (1, dim + 1)

    def grow(self, rows: int, tokens: int = 0) -> None:
        """At least ``rows`` rows and (attention) room for ``tokens`` tokens (at most a
        window's). Every member asks before every static step: when nothing is short, the
        answer is two integer comparisons."""
        limit = self._limit
        tokens = tokens if limit is None else min(tokens, limit)
        have_rows, have_tokens = self._size
        old = self.tensors
        if old:
            if have_rows >= rows and have_tokens >= tokens:
                return
            rows = have_rows if have_rows >= rows else max(rows, 2 * have_rows)
            tokens = have_tokens if have_tokens >= tokens else max(tokens, 2 * have_tokens)
            tokens = tokens if limit is None else min(tokens, limit)
        first = self.members[0]
        self.tensors = tuple(
            torch.zeros((len(self.members), *shape), dtype=dtype, device=first.device)
            for shape, dtype in first.slab_layout(rows, tokens)
        )
        self._size = first.slab_size(self.tensors[0][0])
        self.version += 1
        if old:  # positions keep their slots (p, or p % window: the capacity stays <= window)
            for new, prev in zip(self.tensors, old, strict=True):
                new[tuple(slice(0, n) for n in prev.shape)] = prev
            for op in self.members:
                op._states_to_slabs()


def share_slabs(ops: Sequence[StatefulOperator]) -> None:
    """Give ``ops`` (a stage's stateful layers) one :class:`SlabPool` per kind of slab."""
    groups: dict[tuple[object, ...], list[StatefulOperator]] = {}
    for op in ops:
        groups.setdefault(op.slab_key(), []).append(op)
    for members in groups.values():
        SlabPool(members)


class StatefulOperator(Operator):
    """An operator that keeps per-request state between iterations (KV cache, recurrent state).

    Each admitted request has a state *row*: its index in the layer's state slabs, which a
    static-shape decode step reads and writes for all requests at once (:mod:`.decode`). A rank
    gives each request the row of its batch slot; otherwise the lowest free row is taken.
    """

    slab_token_dim: int | None = None  # a layer slab's dimension of tokens (None: no length)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        self._context_lens: dict[str, int] = {}
        self._rows: dict[str, int] = {}
        self._outside: set[str] = set()  # admitted, state not yet in the static step's slabs
        self._slab_pool: SlabPool | None = None  # this layer's slabs: the pool's tensors at index
        self._slab_index = 0

    def admit(self, request_id: str, row: int | None = None) -> None:
        if request_id in self._context_lens:
            raise RequestStateError(f"request {request_id!r} is already admitted")
        taken = set(self._rows.values())
        if row is None:
            row = next(r for r in range(len(taken) + 1) if r not in taken)
        elif row in taken:
            raise RequestStateError(f"state row {row} of layer {self.layer} is taken")
        self._context_lens[request_id] = 0
        self._rows[request_id] = row
        self._outside.add(request_id)
        self._init_state(request_id)

    def free(self, request_id: str) -> None:
        if self._context_lens.pop(request_id, None) is None:
            raise RequestStateError(f"request {request_id!r} is not admitted")
        self._drop_state(request_id)
        del self._rows[request_id]
        self._outside.discard(request_id)

    def row_of(self, request_id: str) -> int:
        return self._rows[request_id]

    def highest_row(self) -> int:
        """The highest state row an admitted request holds (-1: none)."""
        return max(self._rows.values(), default=-1)

    def reserve(self, rows: int, tokens: int) -> None:
        """Size the state slabs for ``rows`` requests of up to ``tokens`` tokens (plus the
        scratch row), so a static decode step's shapes stay fixed."""
        raise NotImplementedError

    def _count_one_token(self, request_ids: Sequence[str], context_lens: Sequence[int]) -> None:
        """:meth:`_advance` by one token for every request at once."""
        lens = self._context_lens
        try:
            held = list(map(lens.__getitem__, request_ids))
        except KeyError as missing:
            raise RequestStateError(
                f"request {missing.args[0]!r} is not admitted on layer {self.layer}"
            ) from None
        if held != list(context_lens):
            for rid, context_len in zip(request_ids, context_lens, strict=True):
                self._advance(rid, context_len, 0)  # raises for the first that disagrees
        lens.update(zip(request_ids, map((1).__add__, context_lens), strict=True))

    def _grow_slabs_for(self, rows: int, tokens: int, span: int) -> None:
        """Slabs of at least ``rows`` rows holding ``tokens`` tokens, read ``span`` slots far."""
        raise NotImplementedError

    # -- the slabs (shared with the stage's layers of the same kind, see SlabPool) ----------
    @property
    def _slabs(self) -> tuple[torch.Tensor, ...] | None:
        if self._slab_pool is None or not self._slab_pool.tensors:
            return None
        return tuple(t[self._slab_index] for t in self._slab_pool.tensors)

    def _slab_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """This layer's index in its pool, one per row: with ``rows`` it indexes the stacked
        slabs directly (a write through the layer's view of them would, once compiled, copy
        the whole stack back every step)."""
        return torch.full_like(rows, self._slab_index)

    def _grow_slabs(self, rows: int, tokens: int = 0) -> None:
        if self._slab_pool is None:  # not shared (a step built outside a stage): a pool of its own
            SlabPool([self])
        assert self._slab_pool is not None
        self._slab_pool.grow(rows, tokens)

    def slab_key(self) -> tuple[object, ...]:
        """Layers with equal keys can stack their slabs in one :class:`SlabPool`."""
        raise NotImplementedError

    def slab_layout(self, rows: int, tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape (of one layer) and dtype of each slab for ``rows`` rows of ``tokens`` tokens."""
        raise NotImplementedError

    def slab_size(self, slab: torch.Tensor) -> tuple[int, int]:
        """(rows, tokens) a layer's first slab holds (tokens 0: a state without length)."""
        dim = self.slab_token_dim
        return slab.shape[0], 0 if dim is None else slab.shape[dim]

    def slab_token_limit(self) -> int | None:
        """The most tokens a slab ever holds (a sliding window's), or None."""
        return None

    def _states_to_slabs(self) -> None:
        """The slabs were reallocated: point the requests' states at their rows again."""
        raise NotImplementedError

    def _move_in(self, request_id: str, length: int) -> None:
        """Copy a request's state (``length`` tokens so far) into its slab row, and keep it
        there: from now on its state is a view of that row."""
        raise NotImplementedError

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(self._context_lens)

    def state_bytes(self, request_id: str | None = None) -> int:
        """Bytes of per-request state held (for one request, or all)."""
        ids = self._context_lens if request_id is None else (request_id,)
        return sum(t.numel() * t.element_size() for rid in ids for t in self._state_tensors(rid))

    def _advance(self, request_id: str, context_len: int, query_len: int) -> None:
        """Check the schedule agrees with what this layer has cached, then count the new tokens."""
        held = self._context_lens.get(request_id)
        if held is None:
            raise RequestStateError(f"request {request_id!r} is not admitted on layer {self.layer}")
        if held != context_len:
            raise RequestStateError(
                f"request {request_id!r}: layer {self.layer} holds {held} tokens, "
                f"batch says {context_len}"
            )
        self._context_lens[request_id] = held + query_len

    def _init_state(self, request_id: str) -> None:
        raise NotImplementedError

    def _drop_state(self, request_id: str) -> None:
        raise NotImplementedError

    def _state_tensors(self, request_id: str) -> list[torch.Tensor]:
        raise NotImplementedError

    # -- handing a request's state over (a prefill pool to the decode ranks) ------------------
    def state_layout(self, length: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each tensor of one request's state after ``length`` tokens, as
        :meth:`export_state` gives it and :meth:`import_state` takes it."""
        raise NotImplementedError

    def export_state(self, request_id: str) -> list[torch.Tensor]:
        """The request's state as :meth:`state_layout` lays it out (views, not copies)."""
        raise NotImplementedError

    def state_shards(self) -> list[Layout | None]:
        """How each tensor of :meth:`export_state` is cut over tensor-parallel ranks (``None``:
        every rank holds it whole), in the full model's units: what turns one TP degree's
        state into another's."""
        raise NotImplementedError

    def import_state(self, request_id: str, length: int, tensors: Sequence[torch.Tensor]) -> None:
        """An admitted request's state after ``length`` tokens, computed elsewhere (by a
        prefill rank): it continues from there as if this layer had run them."""
        if self._context_lens.get(request_id) != 0:
            raise RequestStateError(f"request {request_id!r} is not newly admitted")
        layout = self.state_layout(length)
        got = [(tuple(t.shape), t.dtype) for t in tensors]
        if got != layout:
            raise RequestStateError(
                f"layer {self.layer}: request {request_id!r}'s state came as {got}, "
                f"expected {layout}"
            )
        self._load_state(request_id, length, tensors)
        self._context_lens[request_id] = length

    def _load_state(self, request_id: str, length: int, tensors: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError


ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_tanh")


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise UnsupportedModelError(f"activation {name!r} is not implemented")


class RMSNorm:
    """RMSNorm in the two roundings transformers uses.

    Llama style normalises in float32, casts back, then multiplies by ``w``; Gemma style
    (also Qwen3-Next) multiplies by ``1 + w`` in float32 and casts last.
    """

    def __init__(self, weight: torch.Tensor, eps: float, *, gemma: bool) -> None:
        self.eps = eps
        self.gemma = gemma
        self.weight = (1.0 + weight.float()) if gemma else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight).type_as(x)
        y = x.to(torch.float32)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class Embed(Operator):
    """Token ids -> hidden rows (Gemma: times sqrt(hidden), rounded to the model dtype first).

    Under TP each rank holds a slice of the vocabulary, looks up the ids that fall in it (zero
    rows elsewhere) and the group sums: exact, since every row has one non-zero term.
    """

    name, op_class = "embed", "small"

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        vocab = (0, self.arch.vocab_size)
        if self.sharded:
            vocab = self.shard.part(self.arch.vocab_size, "embed: vocabulary")
        self.vocab_range = vocab
        self.weight = self._tensor(
            ctx.ckpt.model_name("embed_tokens.weight"),
            shared=self.arch.tie_word_embeddings,
            ranges=[vocab] if self.sharded else None,
        )
        scale = self.arch.embed_scale
        self.scale = (
            None if scale is None else torch.tensor(scale, dtype=torch.float32).to(self.dtype)
        )

    def forward(self, batch: TokenBatch) -> TokenBatch:
        ids = batch["token_ids"].to(self.device)
        if self.comm is None:
            hidden = F.embedding(ids, self.weight)
        else:
            lo, hi = self.vocab_range
            inside = (ids >= lo) & (ids < hi)
            local = F.embedding((ids - lo).clamp(0, hi - lo - 1), self.weight)
            hidden = self.comm.all_reduce(local * inside[:, None].to(local.dtype))
        if self.scale is not None:
            hidden = hidden * self.scale
        return batch.replace(drop=("token_ids",), hidden=hidden)


class ResidualNorm(Operator):
    """``attn_norm`` / ``ffn_norm``: keep the raw stream as ``residual``, normalise ``hidden``."""

    op_class = "small"

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        weight = self._layer_tensor(self._weight_suffix())
        self.norm = RMSNorm(weight, self.arch.rms_norm_eps, gemma=self.arch.gemma_norms)

    def _weight_suffix(self) -> str:
        raise NotImplementedError

    def forward(self, batch: TokenBatch) -> TokenBatch:
        hidden = batch["hidden"]
        return batch.replace(hidden=self.norm(hidden), residual=hidden)


class AttnNorm(ResidualNorm):
    name = "attn_norm"

    def _weight_suffix(self) -> str:
        return "input_layernorm.weight"


class FfnNorm(ResidualNorm):
    name = "ffn_norm"

    def _weight_suffix(self) -> str:
        # Gemma's post_attention_layernorm normalises the attention output (see o_proj) instead.
        if self.arch.sandwich_norms:
            return "pre_feedforward_layernorm.weight"
        return "post_attention_layernorm.weight"


class FinalNorm(Operator):
    """Keeps only each request's last row (the one sampled from), then normalises it."""

    name, op_class = "final_norm", "small"

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        self.norm = RMSNorm(
            self._tensor(ctx.ckpt.model_name("norm.weight")),
            self.arch.rms_norm_eps,
            gemma=self.arch.gemma_norms,
        )

    def forward(self, batch: TokenBatch) -> TokenBatch:
        hidden = batch["hidden"]
        if batch.step is None:  # a decode step's rows are all last rows
            hidden = hidden[batch.meta.last_rows.to(self.device)]
        return TokenBatch(batch.meta, {"hidden": self.norm(hidden)}, batch.step)


class LmHead(Operator):
    """Hidden -> vocabulary logits, with Gemma's final tanh soft-capping where configured.

    Under TP each rank computes the logits of its vocabulary slice; they are gathered (exact).
    """

    name, op_class = "lm_head", "gemm"
    linear_weights = ("weight",)

    def __init__(self, ctx: OpContext, layer: int | None) -> None:
        super().__init__(ctx, layer)
        rows = None
        if self.sharded:
            rows = [self.shard.part(self.arch.vocab_size, "lm_head: vocabulary")]
        self.weight = self._tensor(
            ctx.ckpt.lm_head_name(), shared=self.arch.tie_word_embeddings, ranges=rows
        )

    def forward(self, batch: TokenBatch) -> TokenBatch:
        logits = linear(batch["hidden"], self.weight)
        if self.comm is not None:
            logits = self.comm.gather(logits, Layout(1, (self.arch.vocab_size,)))
        cap = self.arch.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return batch.replace(drop=("hidden",), logits=logits)


class Sample(Operator):
    """Greedy sampling: the first index of the largest logit (ties as transformers' argmax).

    A static decode step keeps the logits beside the tokens, so one compiled step serves greedy
    requests (its tokens) and sampled ones (their logits, sampled on the host) alike.
    """

    name, op_class = "sample", "small"

    def forward(self, batch: TokenBatch) -> TokenBatch:
        token_ids = torch.argmax(batch["logits"].float(), dim=-1)
        drop = () if batch.step is not None else ("logits",)
        return batch.replace(drop=drop, token_ids=token_ids)


def begin_static_step(
    ops: Sequence[StatefulOperator],
    request_ids: Sequence[str],
    context_lens: Sequence[int],
    rows: int,
    span: int = 0,
) -> None:
    """Host side of a static decode step over ``ops``, before it runs: grow the slabs to at
    least ``rows`` rows (the last of which is the step's scratch row, where padding rows write)
    and past ``span`` slots (how far the step's attention reads), check and count each request's
    one new token on every layer, and have every request's state in its row.

    It runs before every step, so each slab pool is asked to grow once (its members share the
    slabs), and once every request's state is in its row a layer costs a few dictionary
    operations over the step's requests, with no Python loop over them.
    """
    tokens = max(context_lens, default=0) + 1
    grown: set[int] = set()
    for op in ops:
        if op._slab_pool is None or id(op._slab_pool) not in grown:
            op._grow_slabs_for(rows, tokens, span)
            assert op._slab_pool is not None  # growing makes a layer's pool if it had none
            grown.add(id(op._slab_pool))
    for op in ops:
        op._count_one_token(request_ids, context_lens)
        if op._outside:  # requests decoding statically for the first time
            for rid, held in zip(request_ids, context_lens, strict=True):
                if rid in op._outside:
                    op._move_in(rid, held)
                    op._outside.discard(rid)
