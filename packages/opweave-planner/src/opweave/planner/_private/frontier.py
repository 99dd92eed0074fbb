"""Network-safe per-owner Pareto frontiers (paper §5.2).

An owner's configurations (TP degree ``tp``, microbatch size ``u``; the GPU type is fixed
per sub-search) are compared on what a complete plan can see of them:

* cost rate per request ``tp * price / (M * u)`` (lower is better);
* the per-occurrence latency vector: the latency of every segment the owner runs (hybrid layers
  keep their own entries, so a fast full-attention stage cannot hide a slow sliding one);
* its side of every boundary group it sends or receives on: send time, receive time and the
  tensor-parallel fan-out, separately (a transfer takes ``max(send, recv) + fan_out``).
  Whether a boundary uses the intra-node link or the network depends on the partner owner
  (pod rule), which would also change the partner's side; configurations are therefore compared
  only where the link kind is the network against every possible partner (a partner of another
  GPU type, or ``tp >= gpus_per_node``), which makes the pruning safe for every partner.

X dominates Y only at equal TP (transfer volume and fan-out vary non-monotonically with TP, and
the intra-node pod rule depends on it). With everything no worse, replacing Y by X can only lower
every duration of the schedule (the steady-state period is monotone in durations) and the cost
rate, so a plan with Y is never better than the same plan with X: the frontier is exact.
"""

from __future__ import annotations

import numpy as np


def pareto_mask(
    tp: np.ndarray, rate: np.ndarray, latency: np.ndarray, links: np.ndarray, comparable: np.ndarray
) -> np.ndarray:
    """Mask of the configurations no other configuration dominates.

    ``latency`` is ``S_j x C`` (per occurrence), ``links`` is ``L x C`` (send, receive and
    fan-out time per boundary group), ``comparable`` marks configurations whose link times do
    not depend on the partner. Exact duplicates keep the first.
    """
    c = tp.shape[0]
    keep = np.ones(c, dtype=bool)
    # dom[x, y]: x dominates y. Cheap criteria first (equal TP, both comparable, rate, link
    # times) for all pairs at once, then per-occurrence latencies for the pairs still standing.
    dom = (tp[:, None] == tp[None, :]) & comparable[:, None] & comparable[None, :]
    dom &= rate[:, None] <= rate[None, :]
    if links.shape[0]:
        dom &= np.all(links[:, :, None] <= links[:, None, :], axis=0)
    np.fill_diagonal(dom, False)
    xs, ys = np.nonzero(dom)
    if xs.size == 0:
        return keep
    ok = np.all(latency[:, xs] <= latency[:, ys], axis=0)
    xs, ys = xs[ok], ys[ok]
    # identical configurations dominate each other: only the first one survives
    same = (rate[xs] == rate[ys]) & np.all(latency[:, xs] == latency[:, ys], axis=0)
    if links.shape[0]:
        same &= np.all(links[:, xs] == links[:, ys], axis=0)
    ok = ~same | (xs < ys)
    keep[ys[ok]] = False
    return keep
