"""Network-safe per-owner Pareto frontiers (paper §5.2).

An owner's configurations (parallelism ``(tp, ep, dp)``, microbatch size ``u``; the GPU type is
fixed per sub-search) are compared on what a complete plan can see of them:

* cost rate per request ``tp * dp * price / (M * u)`` (lower is better);
* the per-occurrence latency vector: the latency of every segment the owner runs (hybrid layers
  keep their own entries, so a fast full-attention stage cannot hide a slow sliding one);
* its side of every boundary group it sends or receives on: send time, receive time and the
  tensor-parallel fan-out, separately (a transfer takes ``max(send, recv) + fan_out``).
  Whether a boundary uses the intra-node link or the network depends on the partner owner
  (pod rule), which would also change the partner's side; configurations are therefore compared
  only where the link kind is the network against every possible partner (a partner of another
  GPU type, or ``tp x dp >= gpus_per_node``), which makes the pruning safe for every partner.

X dominates Y only at equal TP (transfer volume and fan-out vary non-monotonically with TP, and
the intra-node pod rule depends on it). Expert and data parallelism (EP, DP) may differ: what a
plan sees of them is in the compared quantities, the cost rate (``tp x dp`` GPUs per replica),
the latencies (attention per DP rank, experts over the group, their all-to-all) and the link
times (each DP rank's leader moves its own ``u / dp`` tokens), and the pod rule's GPUs per
replica are covered by the comparability test (``tp x dp >= gpus_per_node``). Owners now trade
GPUs for latency on more than one axis, so configurations of one TP degree do dominate others
(at one ``(tp, ep, dp)`` a larger ``u`` is cheaper and slower, never dominated on a roofline).
With everything no worse, replacing Y by X can only lower every duration of the schedule (the
steady-state period is monotone in durations) and the cost rate, so a plan with Y is never
better than the same plan with X: the frontier is exact.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

EPS = 1e-9  # relative slack: float rounding never prunes a candidate the simulator would keep


def equal_but_rounding(a: ArrayLike, b: ArrayLike) -> NDArray[np.bool_]:
    """Where ``a`` and ``b`` differ by float rounding at most (relative ``EPS``)."""
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b) <= EPS * np.maximum(np.abs(a), np.abs(b))


def pareto_mask(
    tp: np.ndarray, rate: np.ndarray, latency: np.ndarray, links: np.ndarray, comparable: np.ndarray
) -> np.ndarray:
    """Mask of the configurations no other configuration dominates.

    ``latency`` is ``S_j x C`` (per occurrence), ``links`` is ``L x C`` (send, receive and
    fan-out time per boundary group), ``comparable`` marks configurations whose link times do
    not depend on the partner. Duplicates (equal within float rounding) keep the first.
    """
    keep = np.ones(tp.shape[0], dtype=bool)
    keep[dominated_pairs(tp, rate, latency, links, comparable)[1]] = False
    return keep


def dominated_pairs(
    tp: np.ndarray, rate: np.ndarray, latency: np.ndarray, links: np.ndarray, comparable: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(xs, ys)``: configuration ``xs[i]`` dominates ``ys[i]`` (arguments as
    :func:`pareto_mask`). Among any subset of the configurations, those dominated by no other
    member are the subset's frontier, so one computation serves every filter applied later
    (memory caps, the SLO), as a dominating configuration only counts where it is kept too."""
    xs_all, ys_all = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    # repeated blocks give identical occurrences (and boundary groups identical link rows):
    # a repeated row asks nothing more of a dominating configuration
    latency = _distinct_rows(latency)
    links = _distinct_rows(links)
    # only configurations of equal TP, both comparable, may dominate each other: one block each
    for t in np.unique(tp[comparable]):
        idx = np.flatnonzero((tp == t) & comparable)
        if idx.size > 1:
            xs, ys = _block_pairs(rate[idx], latency[:, idx], links[:, idx])
            xs_all.append(idx[xs])
            ys_all.append(idx[ys])
    return np.concatenate(xs_all), np.concatenate(ys_all)


def _block_pairs(
    rate: np.ndarray, latency: np.ndarray, links: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`dominated_pairs` among configurations that may all be compared."""
    # dom[x, y]: x dominates y. Cheap criteria first (rate, link times) for all pairs at once,
    # then per-occurrence latencies for the pairs still standing.
    dom = rate[:, None] <= rate[None, :]
    for row in links:
        dom &= row[:, None] <= row[None, :]
    np.fill_diagonal(dom, False)
    xs, ys = np.nonzero(dom)
    if xs.size == 0:
        return xs, ys
    ok = np.all(latency[:, xs] <= latency[:, ys], axis=0)
    xs, ys = xs[ok], ys[ok]
    # identical configurations dominate each other: only the first one survives. Identical
    # means equal within float rounding (relative EPS), as the search's tie-break reads it: a
    # configuration ahead of another by rounding alone does not prune an earlier one, which
    # the search may prefer by its key
    same = equal_but_rounding(rate[xs], rate[ys]) & np.all(
        equal_but_rounding(latency[:, xs], latency[:, ys]), axis=0
    )
    if links.shape[0]:
        same &= np.all(equal_but_rounding(links[:, xs], links[:, ys]), axis=0)
    ok = ~same | (xs < ys)
    return xs[ok], ys[ok]


def _distinct_rows(matrix: np.ndarray) -> np.ndarray:
    """``matrix`` without repeated rows (in first-seen order)."""
    if matrix.shape[0] < 2:
        return matrix
    first = {row.tobytes(): i for i, row in reversed(list(enumerate(matrix)))}
    return matrix[sorted(first.values())]
