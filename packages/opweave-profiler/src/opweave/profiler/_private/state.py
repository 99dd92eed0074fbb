"""Per-request state for timing ``core_attn`` at batch ``b`` and context ``s``.

A decode step of ``core_attn`` reads each request's cached keys and values (or recurrent state),
so timing it at context ``s`` needs ``b`` requests that already hold ``s`` tokens. Prefilling
them through the model would cost far more than the measurement (128K tokens x 256 requests), so
the state is written directly, the way the runtime stores it:

* softmax attention (full or sliding): each request's ``_KvState`` gets random keys/values of
  ``s`` tokens (a ring of ``window`` slots for sliding layers) and its length is set to ``s``;
* linear attention: the fixed-size conv/recurrent state is admitted as the runtime does, and
  only the request's context counter is moved (its cost does not depend on ``s``);
* paged attention (vLLM's kernel, ``--kernels vllm-all``): each request gets the blocks of
  ``s + 1`` tokens in the stage's block table, and the layer's cache the blocks, filled with
  random keys/values.

Every timed call appends one token; the state is rewound to ``s`` before each repeat, outside
the clock, so every repeat reads exactly ``s + 1`` tokens.

When the state would not fit the memory budget (e.g. 256 x 128K tokens of a global layer),
requests share key/value buffers round-robin. Each request still reads its own full-length
buffer, far larger than any cache at such sizes, so the reads cost what distinct ones would; the
number of such cells is recorded in the profile's provenance.

If the runtime's internals ever change shape, :class:`StateWriter` falls back to the public API:
it prefills the requests through the layer's own operators (small grids only) and lets contexts
advance by one per call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from opweave.runtime import BatchMeta, Operator, StatefulOperator, TokenBatch

from ..errors import ProfilerError

# The fallback prefills b * s tokens through the layer at once; beyond this it is refused.
_MAX_PREFILL_TOKENS = 1 << 20


class StateWriter:
    """Gives one stateful operator ``b`` requests at context ``s``, and rewinds them."""

    def __init__(
        self,
        op: StatefulOperator,
        prefix: Sequence[Operator],
        *,
        budget_bytes: float,
        seed: int = 0,
    ) -> None:
        self.op = op
        self.prefix = list(prefix)  # operators before core_attn in its layer (for prefill)
        self.budget_bytes = budget_bytes
        self.context: dict[str, int] = {}  # tokens each admitted request holds now
        self.aliased = False
        self._borrowed: set[str] = set()  # paged: requests whose table is another's blocks
        self._gen = torch.Generator(device=op.device)
        self._gen.manual_seed(seed)
        self.layout = self._probe()

    def _probe(self) -> str | None:
        """How the runtime stores this operator's state, if this module writes it that way:
        ``"kv"`` (per-request keys/values), ``"paged"`` (vLLM's block tables and cache),
        ``"counter"`` (a fixed-size state: only the context counter moves); None: unknown."""
        op = self.op
        if not isinstance(getattr(op, "_context_lens", None), dict):
            return None
        if hasattr(op, "_paging") and hasattr(op, "_cache") and hasattr(op, "_new_blocks"):
            return "paged"
        if op.name == "core_attn" and not hasattr(op, "_states"):
            return "counter" if hasattr(op, "_recurrent") else None
        probe = "__opweave_probe__"
        op.admit(probe)
        try:
            state = op._states.get(probe)  # type: ignore[attr-defined]
            if state is None or not all(hasattr(state, a) for a in ("k", "v", "length")):
                return None
            return "kv" if state.k.dim() == 3 else None
        finally:
            op.free(probe)

    @property
    def direct(self) -> bool:
        return self.layout is not None

    def fill(self, request_ids: Sequence[str], context: int) -> None:
        """Admit ``request_ids`` (if needed) and give each ``context`` tokens of state."""
        self.release()
        op = self.op
        if not self.direct:
            self._prefill(request_ids, context)
            return
        for rid in request_ids:
            op.admit(rid)
        if self.layout == "kv":
            self._write_kv(request_ids, context)
        elif self.layout == "paged":
            self._write_pages(request_ids, context)
        self.rewind(request_ids, context)

    def _slots(self, requests: int, per_request_bytes: float) -> int:
        """How many requests get buffers of their own within the budget (the rest share)."""
        slots = int(max(1, min(requests, self.budget_bytes // max(per_request_bytes, 1))))
        self.aliased = slots < requests
        return slots

    def _write_kv(self, request_ids: Sequence[str], context: int) -> None:
        op = self.op
        states = op._states  # type: ignore[attr-defined]
        template = states[request_ids[0]].k  # [kv_heads, capacity, head_dim]
        window = getattr(op, "window", None)
        capacity = context + 1 if window is None else min(context + 1, window)
        heads, dim = template.shape[0], template.shape[2]
        per_request = 2 * heads * capacity * dim * template.element_size()
        slots = self._slots(len(request_ids), per_request)
        shape = (slots, heads, capacity, dim)
        keys = torch.empty(shape, dtype=template.dtype, device=template.device)
        values = torch.empty_like(keys)
        for pool in (keys, values):
            if pool.dtype.is_floating_point:
                pool.normal_(generator=self._gen)
        for i, rid in enumerate(request_ids):
            state = states[rid]
            state.k, state.v = keys[i % slots], values[i % slots]

    def _write_pages(self, request_ids: Sequence[str], context: int) -> None:
        """Blocks for ``context + 1`` tokens per request in the stage's block tables (requests
        past the budget share the first ones' blocks) and random keys/values in this layer's
        cache. Layers sharing the tables find them reserved already."""
        op: Any = self.op
        paging, cache = op._paging, op._cache
        block_tokens = cache.shape[2]
        blocks = -(-(context + 1) // block_tokens)
        per_request = blocks * cache[0].numel() * cache.element_size()
        slots = self._slots(len(request_ids), per_request)
        owners = request_ids[:slots]
        for rid in owners:
            paging._reserve(rid, context + 1)
        for i, rid in enumerate(request_ids[slots:]):
            if len(paging.tables[rid]) < blocks:  # shares an owner's blocks, frees none
                paging.tables[rid] = list(paging.tables[owners[i % slots]][:blocks])
                self._borrowed.add(rid)
        if cache.shape[0] < paging.num_blocks:
            cache = op._cache = torch.cat(
                (cache, op._new_blocks(paging.num_blocks - cache.shape[0]))
            )
        if cache.dtype.is_floating_point:
            cache.normal_(generator=self._gen)

    def rewind(self, request_ids: Sequence[str], context: int) -> None:
        """Make every request hold ``context`` tokens again (direct mode only)."""
        lens = self.op._context_lens
        states = getattr(self.op, "_states", None) if self.layout == "kv" else None
        for rid in request_ids:
            lens[rid] = context
            self.context[rid] = context
            if states is not None:
                states[rid].length = context

    def _prefill(self, request_ids: Sequence[str], context: int) -> None:
        """Public-API fallback: run the layer's operators on ``context`` tokens per request."""
        b = len(request_ids)
        if b * context > _MAX_PREFILL_TOKENS:
            raise ProfilerError(
                f"cannot prefill {b} x {context} tokens to time {self.op.name} (layer "
                f"{self.op.layer}); the runtime's state layout is not the one this profiler "
                "writes directly, so use smaller --batches/--contexts or update the profiler"
            )
        op = self.op
        for rid in request_ids:
            op.admit(rid)
            self.context[rid] = 0
        if context == 0:
            return
        meta = BatchMeta(tuple(request_ids), (context,) * b, (0,) * b)
        h = op.arch.hidden_size
        hidden = torch.randn(b * context, h, generator=self._gen, device=op.device)
        batch = TokenBatch(meta, {"hidden": hidden.to(op.dtype)})
        with torch.inference_mode():
            for pre in self.prefix:
                batch = pre(batch)
            op(batch)
        for rid in request_ids:
            self.context[rid] = context

    def step_batch(
        self, request_ids: Sequence[str], tensors: dict[str, torch.Tensor]
    ) -> Callable[[], TokenBatch]:
        """A callable building the decode batch for the requests' current contexts."""

        def make() -> TokenBatch:
            ctx = tuple(self.context[rid] for rid in request_ids)
            return TokenBatch(BatchMeta(tuple(request_ids), (1,) * len(request_ids), ctx), tensors)

        return make

    def advanced(self, request_ids: Sequence[str]) -> None:
        """Record that one decode step appended a token to each request."""
        for rid in request_ids:
            self.context[rid] += 1

    def release(self) -> None:
        """Free every request this writer admitted (and with them their state)."""
        tables = getattr(self.op, "_paging", None)
        for rid in self._borrowed:  # its blocks are another request's: free none of them
            if tables is not None and rid in tables.tables:
                tables.tables[rid] = []
        self._borrowed.clear()
        for rid in list(self.context):
            self.op.free(rid)
        self.context.clear()
        if self.op.device.type == "cuda":
            torch.cuda.empty_cache()  # next context's buffers may be larger than these
