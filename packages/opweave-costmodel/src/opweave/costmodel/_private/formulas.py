"""The serving formulas every consumer shares: link kind, transfer time, cost rate, memory fit.

Each rule is written once, as a numpy function of scalars or arrays (they broadcast), so the
planner's scalar evaluation of one plan and its vectorised branch-and-bound over thousands of
candidates compute the same numbers by the same code (paper §4, appendix B.3-B.5).

>>> bool(intra_node_link(True, 2, 4, 2, 2, 8))   # pod of 4 requests: 1 x tp2 + 2 x tp2 = 6 GPUs
True
>>> float(usd_per_million_tokens(0.02, usd_per_hour_per_request(8, 3.0, 64)))
2.0833333333333335
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

ArrayLike: TypeAlias = npt.ArrayLike
Float: TypeAlias = float | np.ndarray


# -- links and transfers -----------------------------------------------------------------------
def link_time_s(latency_s: ArrayLike, s_per_byte: ArrayLike, num_bytes: ArrayLike) -> Float:
    """Affine transfer time of one message over one link: ``latency + bytes * s_per_byte``."""
    return np.add(latency_s, np.multiply(num_bytes, s_per_byte))


def pod_gpus(gpus_a: ArrayLike, b_a: ArrayLike, gpus_b: ArrayLike, b_b: ArrayLike) -> np.ndarray:
    """GPUs of one *pod*: the replicas of two owners that serve the same ``lcm(b_a, b_b)``
    requests (``lcm / b_a`` replicas of ``gpus_a = tp x dp`` GPUs and ``lcm / b_b`` of
    ``gpus_b``)."""
    b_a, b_b = np.asarray(b_a), np.asarray(b_b)
    pod = np.lcm(b_a, b_b)
    return np.asarray(gpus_a) * (pod // b_a) + np.asarray(gpus_b) * (pod // b_b)


def intra_node_link(
    same_type: ArrayLike,
    gpus_a: ArrayLike,
    b_a: ArrayLike,
    gpus_b: ArrayLike,
    b_b: ArrayLike,
    gpus_per_node: ArrayLike,
) -> np.ndarray:
    """Whether two owners' replicas (``tp x dp`` GPUs each) talk over the intra-node link (else:
    the network).

    Same GPU type and a pod (:func:`pod_gpus`) that fits in one node of ``gpus_per_node``.
    """
    return np.logical_and(same_type, pod_gpus(gpus_a, b_a, gpus_b, b_b) <= gpus_per_node)


def fan_out_s(
    beta: ArrayLike,
    u_dst: ArrayLike,
    tp_dst: ArrayLike,
    latency_s: ArrayLike,
    s_per_byte: ArrayLike,
) -> Float:
    """A tensor-parallel destination's leader forwarding ``u_dst`` tokens of ``beta`` bytes to its
    ``tp - 1`` peers over the intra-node link (zero without TP)."""
    tp_dst = np.asarray(tp_dst)
    fan_bytes = np.multiply(np.multiply(beta, u_dst), tp_dst - 1)
    return np.where(tp_dst > 1, link_time_s(latency_s, s_per_byte, fan_bytes), 0.0)


def boundary_transfer_s(
    beta: ArrayLike,
    u_src: ArrayLike,
    u_dst: ArrayLike,
    tp_dst: ArrayLike,
    send: tuple[ArrayLike, ArrayLike],
    recv: tuple[ArrayLike, ArrayLike],
    fan: tuple[ArrayLike, ArrayLike],
) -> Float:
    """One microbatch's activations across one owner boundary.

    A source replica sends ``u_src`` tokens of ``beta`` bytes, a destination replica receives
    ``u_dst`` (fan-in or fan-out serialises on the side with more tokens): ``max(send, recv)``
    plus the destination's TP fan-out. With data-parallel ranks each rank's leader sends or
    receives its own slice over its own link: pass the tokens per DP rank. ``send``/``recv``
    are the ``(latency_s, s_per_byte)`` of the link the boundary uses on each side; ``fan`` the
    destination's intra-node link.
    """
    t_send = link_time_s(send[0], send[1], np.multiply(beta, u_src))
    t_recv = link_time_s(recv[0], recv[1], np.multiply(beta, u_dst))
    return np.maximum(t_send, t_recv) + fan_out_s(beta, u_dst, tp_dst, fan[0], fan[1])


# -- cost ------------------------------------------------------------------------------------------
def usd_per_hour_per_request(
    gpus: ArrayLike, usd_per_hour: ArrayLike, resident_batch: ArrayLike
) -> Float:
    """An owner's cost rate per request it holds: ``gpus = tp x dp`` GPUs of a replica at
    ``usd_per_hour`` each over its ``resident_batch`` requests. Summed over owners and times
    TPOT it is the cost per token, whatever the number of replicas (scale invariance, paper
    B.5)."""
    return np.divide(np.multiply(gpus, usd_per_hour), resident_batch)


def usd_per_million_tokens(tpot_s: ArrayLike, usd_per_hour_per_request: ArrayLike) -> Float:
    """Cost per million generated tokens: every request gets one token per TPOT."""
    return np.multiply(tpot_s, usd_per_hour_per_request) / 3600.0 * 1e6


def replica_counts(resident_batches: Sequence[int]) -> list[int]:
    """The fewest replicas per owner that serve one global batch: ``lcm(b) / b_o`` each."""
    g = int(np.lcm.reduce(np.asarray(resident_batches, dtype=np.int64)))
    return [g // int(b) for b in resident_batches]


# -- memory ----------------------------------------------------------------------------------------
def max_resident_batch(usable_bytes: float, weight_bytes: float, bytes_per_request: float) -> int:
    """Largest integer number of requests whose state and activations fit beside the weights
    (memory is affine in the batch: ``weights + batch * bytes_per_request <= usable``)."""
    free = usable_bytes - weight_bytes
    if free <= 0:
        return 0
    if bytes_per_request <= 0:
        return 1 << 30
    return int(np.floor(free / bytes_per_request))
