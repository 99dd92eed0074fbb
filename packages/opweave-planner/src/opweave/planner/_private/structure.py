"""Operator latency tables and the structure of one (template, number of owners) choice.

Regularity: operators of layers with the same signature (and the model's start/end operators)
have identical latencies, so latencies are computed once per distinct operator, device, TP degree
and microbatch size, and a segment's latency is a count vector over distinct operators times that
table. Identical blocks therefore give identical stage costs for free, while per-occurrence
vectors keep hybrid-layer variation (a full-attention stage and a sliding-window stage differ).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from opweave.costmodel import (
    LayerSpec,
    ModelSpec,
    OperatorSpec,
    Segment,
    StageTemplate,
    bytes_moved_per_rank,
    max_resident_batch,
    memory_bytes_per_rank,
    segments,
    weight_bytes_per_rank,
)

from .devices import Device


class OpTables:
    """Per-microbatch latency (compute + TP collective) of every distinct operator."""

    def __init__(self, model: ModelSpec, context: int) -> None:
        self.model = model
        self.context = context
        self.index: dict[str, int] = {}
        self.reps: list[tuple[OperatorSpec, LayerSpec | None]] = []
        keys: dict[object, int] = {}

        def add(key: object, op: OperatorSpec, layer: LayerSpec | None) -> None:
            if key not in keys:
                keys[key] = len(self.reps)
                self.reps.append((op, layer))
            self.index[op.key] = keys[key]

        for op in model.pre_ops:
            add(("pre", op.name), op, None)
        for layer in model.layers:
            sig = layer.signature
            for j, op in enumerate(layer.ops):
                add((sig, j), op, layer)
        for op in model.post_ops:
            add(("post", op.name), op, None)
        self._cache: dict[tuple[str, int, float], np.ndarray] = {}
        self._mem: dict[tuple[int, tuple[str, ...]], tuple[float, float]] = {}
        self._bytes: dict[tuple[str, int, tuple[float, ...]], np.ndarray] = {}

    @property
    def num_classes(self) -> int:
        return len(self.reps)

    def latency(self, device: Device, tp: int, batches: Sequence[float]) -> np.ndarray:
        """``K x len(batches)`` latencies of every distinct operator at microbatch ``batches``."""
        cols = []
        for b in batches:
            key = (device.id, tp, float(b))
            col = self._cache.get(key)
            if col is None:
                lat = device.latency
                col = np.array(
                    [
                        lat.op_latency_s(self.model, op, layer, tp, float(b), float(self.context))
                        + lat.collective_s(op, tp, float(b))
                        for op, layer in self.reps
                    ]
                )
                self._cache[key] = col
            cols.append(col)
        return np.stack(cols, axis=1)

    def bytes_moved(self, tp: int, batches: Sequence[float]) -> np.ndarray:
        """``K x len(batches)`` bytes every distinct operator touches per microbatch on one rank
        (weights, state and activations, sharded by ``tp``)."""
        key = ("bytes", tp, tuple(float(b) for b in batches))
        cached = self._bytes.get(key)
        if cached is None:
            cached = np.array(
                [
                    [bytes_moved_per_rank(op, tp, float(b), float(self.context)) for b in batches]
                    for op, _ in self.reps
                ]
            ).reshape(len(self.reps), len(batches))
            self._bytes[key] = cached
        return cached

    def max_resident_batch(
        self, ops: Sequence[OperatorSpec], device: Device, tp: int, cache_key: tuple[str, ...]
    ) -> int:
        """Largest resident batch of one replica holding ``ops`` (weights, state, activations).

        As :func:`opweave.costmodel.max_batch`, with the device-independent terms computed once
        per (operator set, TP degree).
        """
        key = (tp, cache_key)
        if key not in self._mem:
            weights = weight_bytes_per_rank(list(ops), tp)
            # state + activations of one request (memory is affine in the batch)
            per_request = memory_bytes_per_rank(list(ops), tp, 1.0, float(self.context)) - weights
            self._mem[key] = (weights, per_request)
        weights, per_request = self._mem[key]
        return max_resident_batch(device.hardware.usable_memory_bytes, weights, per_request)


@dataclass(frozen=True)
class Group:
    """Crossing boundaries with the same endpoints and bytes per token."""

    src: int
    dst: int
    beta: float
    count: int


@dataclass(frozen=True)
class Structure:
    """A template tiled over the model with its stage positions mapped to ``n`` owners."""

    template: StageTemplate
    n: int
    segments: tuple[Segment, ...]
    seg_owner: tuple[int, ...]
    labels: tuple[str, ...]
    beta: tuple[float, ...]
    owner_segs: tuple[tuple[int, ...], ...]
    counts: tuple[np.ndarray, ...]
    owner_ops: tuple[tuple[OperatorSpec, ...], ...]
    groups: tuple[Group, ...]
    period_hint: int | None

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    def crosses(self, s: int) -> bool:
        return self.seg_owner[s] != self.seg_owner[(s + 1) % len(self.seg_owner)]

    def owner_key(self, j: int) -> tuple[str, ...]:
        return (*map(str, self.template.cuts), f"n{self.n}", f"owner{j}")


def _label(ops: Sequence[OperatorSpec]) -> str:
    first, last = ops[0], ops[-1]
    return first.key if first is last else f"{first.key}..{last.key}"


def build_structure(
    model: ModelSpec, tables: OpTables, template: StageTemplate, n: int
) -> Structure:
    segs = tuple(segments(model, template, n))
    if n > 1 and len({s.owner for s in segs}) < n:
        raise ValueError("template has too few stage positions for that many owners")
    owner = tuple(s.owner for s in segs)
    beta = []
    for s, seg in enumerate(segs):
        # after the last segment only the sampled token id travels back (sample's boundary)
        beta.append(float(seg.ops[-1].boundary_bytes_per_token))
        del s
    owner_segs = tuple(tuple(i for i, o in enumerate(owner) if o == j) for j in range(n))
    counts = []
    for j in range(n):
        mat = np.zeros((len(owner_segs[j]), tables.num_classes))
        for row, i in enumerate(owner_segs[j]):
            for op in segs[i].ops:
                mat[row, tables.index[op.key]] += 1.0
        counts.append(mat)
    owner_ops = tuple(tuple(op for i in owner_segs[j] for op in segs[i].ops) for j in range(n))
    tally: dict[tuple[int, int, float], int] = {}
    total = len(segs)
    for s in range(total):
        nxt = owner[(s + 1) % total]
        if nxt != owner[s]:
            key = (owner[s], nxt, beta[s])
            tally[key] = tally.get(key, 0) + 1
    groups = tuple(Group(a, b, bb, c) for (a, b, bb), c in sorted(tally.items()))
    hint = math.lcm(template.num_stages, n) if n > 1 else None
    return Structure(
        template=template,
        n=n,
        segments=segs,
        seg_owner=owner,
        labels=tuple(_label(s.ops) for s in segs),
        beta=tuple(beta),
        owner_segs=owner_segs,
        counts=tuple(counts),
        owner_ops=owner_ops,
        groups=groups,
        period_hint=hint,
    )


def owner_ops(
    st: Structure, tables: OpTables, j: int, device: Device, tp: int, batches: Sequence[float]
) -> np.ndarray:
    """``S_j x len(batches)``: operator latency of each segment owner ``j`` runs, per microbatch."""
    return st.counts[j] @ tables.latency(device, tp, batches)


def owner_compute(
    st: Structure, tables: OpTables, j: int, device: Device, tp: int, batches: Sequence[float]
) -> np.ndarray:
    """``S_j x len(batches)``: per-microbatch latency of each segment owner ``j`` runs.

    A segment costs its operators plus, where the device's profile measured its host, the rank
    loop's work around them (:mod:`.host`), which grows with the microbatch's requests; segment
    0 also the driver's bookkeeping for the owner's own requests (exact with one owner, a lower
    bound otherwise: the driver handles the whole global batch's microbatch).
    """
    out = owner_ops(st, tables, j, device, tp, batches)
    loop = device.host.orchestration
    if loop is None:  # nothing measured of the host (a GPU)
        return out
    out = out + np.array([loop.stage(u) for u in batches])[None, :]
    if 0 in st.owner_segs[j]:  # the driver feeds segment 0: at least this owner's requests
        out[st.owner_segs[j].index(0)] += np.array([loop.drive(u) for u in batches])
    return out
