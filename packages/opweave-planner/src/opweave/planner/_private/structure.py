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
    Parallelism,
    Segment,
    StageTemplate,
    bytes_moved_per_rank,
    dp_batch,
    is_group_op,
    max_resident_batch,
    parallel_op_latency_s,
    segments,
    state_shard_fraction,
    weight_share,
)

from .devices import Device


class OpTables:
    """Per-microbatch latency (compute + collectives) of every distinct operator.

    ``expert_skew`` is the router's measured imbalance of expected expert loads (1.0: balanced,
    the assumption a plan states; :func:`opweave.costmodel.expert_load_imbalance`).
    """

    def __init__(self, model: ModelSpec, context: int, expert_skew: float = 1.0) -> None:
        self.model = model
        self.context = context
        self.expert_skew = expert_skew
        self.index: dict[str, int] = {}
        self.reps: list[tuple[OperatorSpec, LayerSpec | None]] = []
        keys: dict[object, int] = {}

        # an operator that runs on a second stream beside its layer's routed experts (shared
        # experts) keeps that overlap only in a segment that holds them too; split from them
        # it is costed as its own twin, its launches charged (fixed_costs [SHARED-STREAM])
        self.split_index: dict[str, int] = {}

        def add(
            key: object, op: OperatorSpec, layer: LayerSpec | None, index: dict[str, int]
        ) -> None:
            if key not in keys:
                keys[key] = len(self.reps)
                self.reps.append((op, layer))
            index[op.key] = keys[key]

        for op in model.pre_ops:
            add(("pre", op.name), op, None, self.index)
        for layer in model.layers:
            sig = layer.signature
            for j, op in enumerate(layer.ops):
                add((sig, j), op, layer, self.index)
                if op.side_stream:
                    add((sig, j, "split"), op.alone(), layer, self.split_index)
        for op in model.post_ops:
            add(("post", op.name), op, None, self.index)
        # operators that span a replica's whole group (routed experts, dense FFN)
        self.group = [k for k, (op, _) in enumerate(self.reps) if is_group_op(op)]
        self.tied = np.array([k for k, (op, _) in enumerate(self.reps) if op.tied_to], dtype=int)
        self.boundary = np.array([op.boundary_bytes_per_token for op, _ in self.reps])
        self._cache: dict[tuple[str, Parallelism, float], np.ndarray] = {}
        self._mem: dict[tuple[object, ...], np.ndarray] = {}
        self._bytes: dict[tuple[str, int, tuple[float, ...]], np.ndarray] = {}

    @property
    def num_classes(self) -> int:
        return len(self.reps)

    def _column(self, device: Device, par: Parallelism, b: float) -> np.ndarray:
        key = (device.id, par, b)
        col = self._cache.get(key)
        if col is not None:
            return col
        lat, ctx = device.latency, float(self.context)
        if par.plain:
            col = np.array(
                [
                    lat.op_latency_s(self.model, op, layer, par.tp, b, ctx)
                    + lat.collective_s(op, par.tp, b)
                    for op, layer in self.reps
                ]
            )
        else:
            # each DP rank runs the non-group operators as a TP group of its own slice
            col = self._column(device, Parallelism(tp=par.tp), dp_batch(b, par.dp)).copy()
            for k in self.group:
                op, layer = self.reps[k]
                col[k] = parallel_op_latency_s(
                    lat, self.model, op, layer, par, b, ctx, self.expert_skew
                )
        self._cache[key] = col
        return col

    def latency(self, device: Device, par: Parallelism, batches: Sequence[float]) -> np.ndarray:
        """``K x len(batches)`` latencies of every distinct operator at replica microbatch
        ``batches`` (requests of the whole replica; DP ranks take their slices)."""
        key = ("matrix", device.id, par, tuple(float(b) for b in batches))
        matrix = self._mem.get(key)
        if matrix is None:
            matrix = np.stack([self._column(device, par, float(b)) for b in batches], axis=1)
            self._mem[key] = matrix
        return matrix

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

    def _class_terms(self, par: Parallelism) -> tuple[np.ndarray, np.ndarray]:
        """Per distinct operator: weight bytes per GPU, state bytes per request per GPU."""
        key = ("terms", par)
        if key not in self._mem:
            ctx = float(self.context)
            self._mem[key] = np.array(
                [
                    [
                        op.weight_bytes * weight_share(op, par),
                        float(op.state_bytes(ctx)) * state_shard_fraction(op, par.tp),
                    ]
                    for op, _ in self.reps
                ]
            ).T
        terms = self._mem[key]
        return terms[0], terms[1]

    def max_resident_batch(self, counts: np.ndarray, device: Device, par: Parallelism) -> int:
        """Largest resident batch of one replica running ``counts`` of each distinct operator
        (weights, state, activations): :func:`opweave.costmodel.max_replica_batch` of those
        operators, from per-operator terms computed once per TP degree and replica size."""
        return int(self.max_resident_batches(counts, device, [par])[0])

    def max_resident_batches(
        self, counts: np.ndarray, device: Device, pars: Sequence[Parallelism]
    ) -> np.ndarray:
        """:meth:`max_resident_batch` of each of ``pars``, at once."""
        if not pars:
            return np.zeros(0, dtype=np.int64)
        terms = [self._class_terms(p) for p in pars]
        weights = np.stack([w for w, _ in terms], axis=1)  # K x P
        state = np.stack([s for _, s in terms], axis=1)
        held = counts > 0
        weight = counts @ weights
        if len(self.tied) > 1 and held[self.tied].all():
            weight = weight - weights[self.tied[1:]].sum(axis=0)  # a tied embedding and head: once
        # activations: the two largest live tensors of the step (roofline.activation_bytes)
        sizes = np.repeat(self.boundary[held], np.minimum(counts[held], 2).astype(int))
        top = float(np.sort(sizes)[::-1][:2].sum())
        per_request = counts @ state + top
        usable = device.hardware.usable_memory_bytes
        caps = [
            max_resident_batch(usable, float(w), float(r))
            for w, r in zip(weight, per_request, strict=True)
        ]
        return np.asarray(caps, dtype=np.int64) * np.array([p.dp for p in pars], dtype=np.int64)


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
            routed = {op.layer for op in segs[i].ops if op.moe is not None}
            for op in segs[i].ops:
                split = op.side_stream and op.layer not in routed
                mat[row, (tables.split_index if split else tables.index)[op.key]] += 1.0
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
    st: Structure,
    tables: OpTables,
    j: int,
    device: Device,
    par: Parallelism,
    batches: Sequence[float],
) -> np.ndarray:
    """``S_j x len(batches)``: operator latency of each segment owner ``j`` runs, per microbatch."""
    return st.counts[j] @ tables.latency(device, par, batches)


def owner_compute(
    st: Structure,
    tables: OpTables,
    j: int,
    device: Device,
    par: Parallelism,
    batches: Sequence[float],
) -> np.ndarray:
    """``S_j x len(batches)``: per-microbatch latency of each segment owner ``j`` runs.

    A segment costs its operators plus, where the device's profile measured its host, the rank
    loop's work around them (:mod:`.host`), which grows with the microbatch's requests; segment
    0 also the driver's bookkeeping for the owner's own requests (exact with one owner, a lower
    bound otherwise: the driver handles the whole global batch's microbatch).
    """
    out = owner_ops(st, tables, j, device, par, batches)
    loop = device.host.orchestration
    if loop is None:  # nothing measured of the host (a GPU)
        return out
    out = out + np.array([loop.stage(u) for u in batches])[None, :]
    if 0 in st.owner_segs[j]:  # the driver feeds segment 0: at least this owner's requests
        out[st.owner_segs[j].index(0)] += np.array([loop.drive(u) for u in batches])
    return out
