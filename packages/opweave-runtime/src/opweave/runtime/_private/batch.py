"""The data that flows between operators, and its one-tensor wire format.

Tokens of all requests in an iteration are flattened into one ragged row dimension (request 0's
tokens, then request 1's, ...), so every non-attention operator is a plain row-wise op and a decode
step and a prefill are the same code. A pipeline may cut the operator sequence anywhere, so whatever
sits in :attr:`TokenBatch.tensors` at a cut is shipped with :func:`pack`/:func:`unpack` as a single
flat ``uint8`` tensor: one point-to-point send carries the schedule and every activation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")

_HEADER_LEN_BYTES = 8
_ALIGN = 16  # so each payload can be viewed as any dtype without a copy
_PEEK_BYTES = 4096  # what unpack reads first: the header of a batch of a few hundred requests
# the dtypes a message may carry, by the name pack writes (never getattr on a peer's string)
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_DTYPE_NAMES = {d: name for name, d in _DTYPES.items()}
_JSON = json.JSONEncoder(separators=(",", ":"))  # made once: json.dumps would make one a call
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class BatchMeta:
    """The iteration's schedule: which requests, how many new tokens each, after how many cached.

    A multi-process pipeline also needs each request's batch ``slot`` (optional, so a
    single-process batch never mentions it): it routes the request's rows to the replica that
    holds its state.
    """

    request_ids: tuple[str, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.request_ids) == len(self.query_lens) == len(self.context_lens):
            raise ValueError("request_ids, query_lens and context_lens must have equal lengths")
        if self.slots and len(self.slots) != len(self.request_ids):
            raise ValueError("slots, when given, must name one slot per request")
        if len(set(self.request_ids)) != len(self.request_ids):
            raise ValueError("a request may appear once per batch")

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @cached_property
    def row_offsets(self) -> tuple[int, ...]:
        """Start row of each request's tokens in the flattened batch (plus the total at the end)."""
        offsets = [0]
        for n in self.query_lens:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)

    @cached_property
    def positions(self) -> torch.Tensor:
        """Absolute position of every row (CPU int64; operators move it to their device)."""
        return torch.cat(
            [
                torch.arange(c, c + n, dtype=torch.int64)
                for c, n in zip(self.context_lens, self.query_lens, strict=True)
            ]
            or [torch.empty(0, dtype=torch.int64)]
        )

    def shared(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, computed once per schedule and key: what every layer of a stage derives
        from the schedule alone (RoPE's cos/sin, paged attention's indices) is computed by the
        first layer that asks and reused by the others."""
        memo = self.__dict__.setdefault("_shared", {})
        if key not in memo:
            memo[key] = make()
        return memo[key]

    @cached_property
    def last_rows(self) -> torch.Tensor:
        """Row of each request's last token: the only row whose logits are needed."""
        return torch.tensor([end - 1 for end in self.row_offsets[1:]], dtype=torch.int64)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "r": list(self.request_ids),
            "q": list(self.query_lens),
            "c": list(self.context_lens),
        }
        if self.slots:
            out["s"] = list(self.slots)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchMeta:
        return cls(
            tuple(data["r"]),
            tuple(data["q"]),
            tuple(data["c"]),
            slots=tuple(data.get("s", ())),
        )


def one_new_token_each(query_lens: Sequence[int], context_lens: Sequence[int]) -> bool:
    """A decode step: some requests, each running exactly one new token after at least one
    cached token."""
    return bool(query_lens) and all(q == 1 for q in query_lens) and min(context_lens) > 0


class StepMeta:
    """The schedule of a static-shape decode step (:mod:`.decode`), as tensors only.

    Every row is one request's single new token: ``positions[i]`` is its position (the tokens it
    already holds) and ``rows[i]`` the row of the stage's state slabs it reads and writes (a
    padding row names the slabs' scratch row). ``span`` is one more than the largest position:
    how many slots of a slab row attention has to read. Compiled, it is a symbolic size, so one
    graph serves every step whatever the requests and their lengths.
    """

    def __init__(self, positions: torch.Tensor, rows: torch.Tensor, span: int) -> None:
        self.positions = positions
        self.rows = rows
        self.span = span
        self._shared: dict[Hashable, Any] = {}

    def shared(self, key: Hashable, make: Callable[[], T]) -> T:
        """As :meth:`BatchMeta.shared`."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]


@dataclass
class TokenBatch:
    """A batch at an operator boundary: the schedule plus named activations (``hidden``, ...)."""

    meta: BatchMeta
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # set on a static-shape decode step (then ``meta`` is not consulted, see :mod:`.decode`)
    step: StepMeta | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def replace(self, drop: Sequence[str] = (), **updates: torch.Tensor) -> TokenBatch:
        """A new batch with ``drop`` removed and ``updates`` set; the input batch is unchanged."""
        tensors = {k: v for k, v in self.tensors.items() if k not in drop}
        tensors.update(updates)
        return TokenBatch(self.meta, tensors, self.step)


def pack(batch: TokenBatch) -> torch.Tensor:
    """Flatten a batch into one contiguous ``uint8`` tensor on the activations' device.

    Layout: 8-byte little-endian header length, a JSON header (schedule, and per tensor its name,
    dtype, shape and byte offset), then each tensor's bytes at a 16-byte aligned offset.

    >>> meta = BatchMeta(("a",), (2,), (0,))
    >>> out = unpack(pack(TokenBatch(meta, {"hidden": torch.ones(2, 4)})))
    >>> out.meta == meta, out["hidden"].shape
    (True, torch.Size([2, 4]))
    """
    entries, offset = [], 0
    for name, t in batch.tensors.items():
        nbytes = t.numel() * t.element_size()
        entries.append((name, _DTYPE_NAMES[t.dtype], t.shape, offset))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    meta = batch.meta
    header = _JSON.encode(
        (meta.request_ids, meta.query_lens, meta.context_lens, meta.slots, entries)
    ).encode()
    start = -(-(_HEADER_LEN_BYTES + len(header)) // _ALIGN) * _ALIGN
    device = next(iter(batch.tensors.values())).device if batch.tensors else _CPU
    prefix = len(header).to_bytes(_HEADER_LEN_BYTES, "little") + header
    if device.type == "cpu":  # through numpy: a slice assignment there costs a tenth of torch's
        host = np.zeros(start + offset, dtype=np.uint8)
        host[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        for entry, t in zip(entries, batch.tensors.values(), strict=True):
            raw = byte_view(t).numpy().reshape(-1)
            begin = start + entry[3]
            host[begin : begin + raw.size] = raw
        return torch.from_numpy(host)
    buf = torch.zeros(start + offset, dtype=torch.uint8, device=device)
    buf[: len(prefix)] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8).to(device)
    for entry, t in zip(entries, batch.tensors.values(), strict=True):
        raw = byte_view(t).reshape(-1)
        begin = start + entry[3]
        buf[begin : begin + raw.numel()] = raw
    return buf


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as uint8 (a view when ``t`` is contiguous; the last dimension scaled by
    the element size)."""
    if t.requires_grad:
        t = t.detach()
    if t.dim() == 0:  # a dtype view needs a dimension to scale
        t = t.reshape(1)
    return t.contiguous().view(torch.uint8)


def unpack(buf: torch.Tensor) -> TokenBatch:
    """Inverse of :func:`pack`; the tensors are views into ``buf`` (no copy), so keep it intact."""
    head = buf[: min(buf.numel(), _PEEK_BYTES)].cpu().numpy()  # on CPU a view, no copy
    end = _HEADER_LEN_BYTES + int.from_bytes(head[:_HEADER_LEN_BYTES].tobytes(), "little")
    text = head if end <= len(head) else buf[:end].cpu().numpy()  # a header past the peek
    request_ids, query_lens, context_lens, slots, entries = json.loads(
        text[_HEADER_LEN_BYTES:end].tobytes()
    )
    start = -(-end // _ALIGN) * _ALIGN
    tensors, views = {}, {}
    for name, dtype_name, shape, offset in entries:
        dtype = _DTYPES[dtype_name]
        whole = views.get(dtype)
        if whole is None:  # the buffer as this dtype: 16-byte aligned lengths and offsets
            whole = views[dtype] = buf.view(dtype)
        at = whole.storage_offset() + (start + offset) // dtype.itemsize  # buf may be a view
        tensors[name] = whole.as_strided(shape, _contiguous_strides(shape), at)
    meta = BatchMeta(tuple(request_ids), tuple(query_lens), tuple(context_lens), tuple(slots))
    return TokenBatch(meta, tensors)


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [1] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = step
        step *= shape[i]
    return strides
