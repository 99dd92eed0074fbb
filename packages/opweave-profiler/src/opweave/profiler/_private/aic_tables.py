"""The silicon database's kernel tables as lookups, with one interpolation rule for all.

Every lookup returns seconds and how it got them: ``measured`` (a database row at exactly the
shape), ``interpolated`` (between measured neighbours: piecewise linear in log latency over the
log of each shape dimension, so a power law between two points is followed exactly) or
``extrapolated`` (beyond the measured range, by a rule stated where it is applied); ``None``
where the database has nothing for the shape (the importer then falls back to the roofline).
Where the database measured several kernels for one shape (vLLM's FP8-block GEMMs: CUTLASS,
DeepGEMM, FlashInfer), the fastest is taken, as an engine's kernel selection picks it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

How = Literal["measured", "interpolated", "extrapolated"]
HOWS: tuple[How, ...] = ("measured", "interpolated", "extrapolated")
Lookup = tuple[float, How]
MS = 1e-3  # the database's latencies are in milliseconds


def worst(*hows: How) -> How:
    return max(hows, key=HOWS.index)


def _grid(xs: Iterable[float], ys: Iterable[float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct x and the fastest y at each (several kernels per shape: the fastest)."""
    best: dict[float, float] = {}
    for x, y in zip(xs, ys, strict=True):
        if y > 0 and math.isfinite(y):
            best[float(x)] = min(y, best.get(float(x), math.inf))
    keys = sorted(best)
    return np.asarray(keys), np.asarray([best[k] for k in keys])


def interp(xs: np.ndarray, ys: np.ndarray, x: float) -> Lookup | None:
    """log-log interpolation inside ``xs``; None outside."""
    if len(xs) == 0 or x < xs[0] * (1 - 1e-9) or x > xs[-1] * (1 + 1e-9):
        return None
    i = int(np.searchsorted(xs, x))
    if i < len(xs) and abs(xs[i] - x) <= 1e-9 * x:
        return float(ys[i]), "measured"
    value = np.exp(np.interp(np.log(x), np.log(xs), np.log(ys)))
    return float(value), "interpolated"


def _bracket(values: np.ndarray, x: float) -> list[tuple[float, float]] | None:
    """The measured values around ``x`` and their weights in log space (one when exact)."""
    i = int(np.searchsorted(values, x))
    if i < len(values) and abs(values[i] - x) <= 1e-9 * x:
        return [(float(values[i]), 1.0)]
    if i == 0 or i == len(values):
        return None
    lo, hi = float(values[i - 1]), float(values[i])
    t = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return [(lo, 1.0 - t), (hi, t)]


@dataclass(frozen=True)
class GemmTable:
    """GEMM latency by (m, n, k) for one dtype: per measured (n, k) a curve in m, bilinear in
    (log n, log k) between measured pairs. A GEMM narrower or shallower than any measured (a
    router over 8 experts) takes the smallest measured n or k: there the kernel's time is its
    floor, not its bytes. One wider than any measured (a vocabulary head) is timed as equal
    column slices of measured width, which a weight-bound GEMM's time adds up over."""

    curves: dict[tuple[float, float], tuple[np.ndarray, np.ndarray]]
    ns: np.ndarray
    ks: np.ndarray

    @classmethod
    def of(cls, m: np.ndarray, n: np.ndarray, k: np.ndarray, ms: np.ndarray) -> GemmTable:
        rows: dict[tuple[float, float], tuple[list[float], list[float]]] = defaultdict(
            lambda: ([], [])
        )
        for mi, ni, ki, li in zip(m, n, k, ms, strict=True):
            xs, ys = rows[(float(ni), float(ki))]
            xs.append(float(mi))
            ys.append(float(li) * MS)
        curves = {key: _grid(*row) for key, row in rows.items()}
        ns = np.asarray(sorted({key[0] for key in curves}))
        ks = np.asarray(sorted({key[1] for key in curves}))
        return cls(curves=curves, ns=ns, ks=ks)

    def __call__(self, m: float, n: float, k: float) -> Lookup | None:
        if not self.curves:
            return None
        how: How = "measured"
        if n > self.ns[-1]:
            slices = math.ceil(n / self.ns[-1])
            part = self(m, n / slices, k)
            return None if part is None else (part[0] * slices, "extrapolated")
        if n < self.ns[0] or k < self.ks[0]:
            n, k, how = max(n, float(self.ns[0])), max(k, float(self.ks[0])), "extrapolated"
        around_n, around_k = _bracket(self.ns, n), _bracket(self.ks, k)
        if around_n is None or around_k is None:
            return None
        corners = []
        for nv, wn in around_n:
            for kv, wk in around_k:
                curve = self.curves.get((nv, kv))
                found = None if curve is None else interp(*curve, m)
                if found is None:
                    return None
                corners.append((wn * wk, found[0]))
                how = worst(how, found[1])
        if len(corners) == 1:  # a measured (n, k): the row itself, no log round trip
            return corners[0][1], how
        return math.exp(sum(w * math.log(v) for w, v in corners)), worst(how, "interpolated")


@dataclass(frozen=True)
class BatchContextTable:
    """Decode attention of one head layout by (batch, context): per measured batch a curve in
    context. Beyond a batch's longest measured context (the database measures fewer tokens at
    larger batches) the time grows in proportion to the context: a decode kernel that long is
    bound by reading the KV cache, whose bytes grow so (FlashAttention-2's split-KV decode).
    Between batches, log-log; beyond the largest batch, in proportion to it, for the same
    reason."""

    rows: dict[float, tuple[np.ndarray, np.ndarray]]
    batches: np.ndarray

    def _at(self, batch: float, context: float) -> Lookup:
        xs, ys = self.rows[batch]
        if context > xs[-1]:
            return float(ys[-1] * context / xs[-1]), "extrapolated"
        if context < xs[0]:
            return float(ys[0]), "extrapolated"
        found = interp(xs, ys, context)
        assert found is not None
        return found

    def __call__(self, batch: float, context: float) -> Lookup | None:
        if len(self.batches) == 0 or batch < self.batches[0]:
            return None
        if batch > self.batches[-1]:
            top = float(self.batches[-1])
            value, _ = self._at(top, context)
            return value * batch / top, "extrapolated"
        around = _bracket(self.batches, batch)
        assert around is not None
        if len(around) == 1:
            return self._at(around[0][0], context)
        log_sum, how = 0.0, "interpolated"
        for b, w in around:
            value, found = self._at(b, context)
            log_sum += w * math.log(value)
            how = worst(how, found)  # type: ignore[arg-type]
        return math.exp(log_sum), how  # type: ignore[return-value]


def batch_context_tables(
    keys: Iterable[tuple], batch: np.ndarray, context: np.ndarray, ms: np.ndarray
) -> dict[tuple, BatchContextTable]:
    """One :class:`BatchContextTable` per key (a head layout) from parallel columns."""
    points: dict[tuple, dict[float, tuple[list[float], list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: ([], []))
    )
    for key, b, s, li in zip(keys, batch, context, ms, strict=True):
        xs, ys = points[key][float(b)]
        xs.append(float(s))
        ys.append(float(li) * MS)
    out = {}
    for key, by_batch in points.items():
        rows = {b: _grid(*row) for b, row in by_batch.items()}
        out[key] = BatchContextTable(rows=rows, batches=np.asarray(sorted(rows)))
    return out


def curves_by_key(
    keys: Iterable[tuple], xs: np.ndarray, ms: np.ndarray
) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """Per key a sorted curve (x, seconds): MoE and GDN kernels by tokens, collectives by
    message size."""
    points: dict[tuple, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for key, x, li in zip(keys, xs, ms, strict=True):
        px, py = points[key]
        px.append(float(x))
        py.append(float(li) * MS)
    return {key: _grid(*row) for key, row in points.items()}
