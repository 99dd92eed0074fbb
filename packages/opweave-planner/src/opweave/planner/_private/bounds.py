"""Optimistic bounds on a plan's TPOT and cost (paper §5.3, appendix C.1).

Written once and used by the schedule simulator's :func:`~.simulator.lower_bound` and by every
level of branch-and-bound (sub-search roots, owner prefixes, the vectorised last two owners).
Each is a numpy function of scalars or arrays (they broadcast), valid for every schedule the
simulator can produce:

* a microbatch's round trip passes every segment's compute and every crossing transfer, so
  TPOT is at least their sum;
* a resource (an owner's compute stream, send link or receive link) serialises its work for
  all ``M`` microbatches, so TPOT is at least ``M`` times its per-microbatch work;
* cost per token is TPOT times the summed cost rate per request, and since TPOT is at least
  ``M W_o`` for every owner ``o``, also at least ``sum_o rate_o M W_o`` (each owner at full
  occupancy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def tpot_lower_bound(
    microbatches: int,
    works: Sequence[npt.ArrayLike],
    links: Sequence[npt.ArrayLike] = (),
    transfers: npt.ArrayLike = 0.0,
) -> np.ndarray:
    """TPOT bound from per-microbatch work: each owner's compute (``works``), each send and
    receive link's transfers (``links``) and the crossing transfers of one round trip."""
    total: np.ndarray = np.zeros(())
    for w in works:
        total = np.add(total, w)
    bound = np.add(transfers, total)
    for w in (*works, *links):
        bound = np.maximum(bound, np.multiply(microbatches, w))
    return bound


def full_occupancy_cost(rate: npt.ArrayLike, microbatches: int, work: npt.ArrayLike) -> np.ndarray:
    """An owner's cost term at full occupancy: ``rate * M * W`` (TPOT >= ``M W``)."""
    return np.multiply(np.multiply(rate, microbatches), work)


def cost_lower_bound(
    tpot: npt.ArrayLike, rate: npt.ArrayLike, full_occupancy: npt.ArrayLike
) -> np.ndarray:
    """Cost per token (x 3600 s/h) bound: ``max(TPOT * rate, sum of full-occupancy terms)``;
    ``rate`` is the summed cost rate per request, ``full_occupancy`` the summed
    :func:`full_occupancy_cost` (the same optimistic choice per unassigned owner in both)."""
    return np.maximum(np.multiply(tpot, rate), full_occupancy)
