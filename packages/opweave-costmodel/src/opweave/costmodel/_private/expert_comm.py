"""Expert-parallel communication: all-to-all dispatch and combine, and the busiest expert rank.

Under expert parallelism (EP) a MoE layer's routed experts are spread over ``ep`` GPUs; each
token is *dispatched* to the GPUs holding its ``top_k`` experts and their outputs are *combined*
back on the token's own GPU (the MoE all-to-all of DeepEP and pplx-kernels). Each term below is
a small pure function with its mechanism and source:

- **volume** (:func:`dispatch_bytes_per_token`, :func:`alltoall_bytes_per_gpu`): a token sends
  ``top_k x hidden`` elements, one copy per routed expert, as the low-latency decode kernels
  send them [DEEPEP-LL]; a copy bound for an expert on the token's own GPU stays there, so of
  ``top_k`` copies a fraction ``(ep - 1) / ep`` leaves the GPU (experts evenly spread, routing
  uniform). Dispatch moves FP8 with one FP32 scale per 128 channels where the experts' GEMMs
  take FP8 inputs (DeepSeek-V3 §3.3 "Low-Precision Communication"; DeepEP's FP8 dispatch),
  else BF16; combine moves BF16 (ibid.).
- **links** (:func:`alltoall_s`): copies to GPUs of the same NVLink domain (``scale_up_gpus``:
  a node, or a rack-scale domain such as GB200 NVL72) cross NVLink, the others the network; the
  two move concurrently, so a transfer takes its latency floor plus the slower of the two
  (NVLink at the catalog's ``link_efficiency``, the network at ``NETWORK_EFFICIENCY``).
- **floor** (``HardwareSpec.alltoall_latency_s``): paid by every dispatch and every combine
  however few tokens move [PPLX-A2A].
- **busiest rank** (:func:`expert_load_imbalance`): an all-to-all, and the experts behind it,
  finish when the GPU that receives the most copies does. With expert loads balanced in
  expectation (EPLB's redundant experts, DeepSeek-V3 §3.4) the busiest GPU still receives the
  expected maximum of ``ep`` multinomial counts; a measured ``skew`` (busiest over mean expected
  load, e.g. 1.30-4.01 without a balancer [ULTRAEP]) multiplies it.

The model reproduces DeepEP's published low-latency table (H800, 128 tokens per GPU, 7168
hidden, top-8, FP8 dispatch, BF16 combine) at EP16-256 within 11%: dispatch +6 to +11%,
combine -4 to +6% (``tests/costmodel/test_expert_parallel.py``).

Sources:
  [DEEPEP-LL] deepseek-ai/DeepEP, docs/legacy.md (V1) "Low-latency kernels with pure RDMA":
  H800 + CX7 400 Gb/s, dispatch 118 / 155 / 173 / 192 / 194 us and combine 195 / 273 / 314 /
  369 / 360 us at EP16 / 32 / 64 / 128 / 256; "Normal kernels": intranode EP8 153 / 158 GB/s of
  ~160 GB/s NVLink, internode 43-58 GB/s of ~50 GB/s RDMA (bandwidth-bound transfers reach the
  links' rates).
  [PPLX-A2A] perplexityai/pplx-kernels README, "1 token per GPU", DeepSeek-R1 shape (256
  experts, top-8, 7168 hidden, FP8 dispatch, BF16 combine): NVLink EP8 dispatch 41.6 us,
  combine 41.7 us (Hopper build, sm_90a).
  [ULTRAEP] Wei et al., "UltraEP", arXiv:2606.04101 (2026): inter-rank expert-load imbalance
  (busiest over mean) 1.30-4.01 across MoE models of 106B-671B without balancing, 1.01-1.04 with
  exact per-microbatch balancing.
  [BLOM] G. Blom, "Statistical Estimates and Transformed Beta-Variables" (1958): the expected
  i-th of n normal order statistics is about ``mu + sigma * Phi^-1((i - 0.375) / (n + 0.25))``.
"""

from __future__ import annotations

from statistics import NormalDist
from typing import Protocol

from .fixed_costs import SMALL_COLLECTIVE_MAX_BYTES
from .hardware import HardwareSpec
from .model import MoESpec
from .roofline import NETWORK_EFFICIENCY  # DeepEP's normal kernels agree: 43-58 of ~50 GB/s

# FP8 e4m3 values plus one FP32 scale per 128 channels (DeepSeek-V3 §3.3; DeepEP's FP8 dispatch).
FP8_DISPATCH_BYTES_PER_ELEMENT = 1.0 + 4.0 / 128
BF16_BYTES = 2.0


def dispatch_bytes_per_token(moe: MoESpec, hidden: int, element_bytes: float) -> float:
    """Bytes one token's dispatch writes, before any stay on its own GPU: ``top_k`` copies of its
    hidden state (combine: the same count of expert outputs).

    >>> from opweave.costmodel import MoESpec
    >>> r1 = MoESpec(num_experts=256, top_k=8, expert_weight_bytes=1)
    >>> dispatch_bytes_per_token(r1, 7168, FP8_DISPATCH_BYTES_PER_ELEMENT)  # 8 x 7392
    59136.0
    """
    return float(moe.top_k * hidden * element_bytes)


def off_gpu_fraction(ep: int) -> float:
    """Share of a token's copies bound for another GPU: experts spread evenly over ``ep`` GPUs
    and routing uniform, one copy in ``ep`` is for an expert on the token's own GPU."""
    return (ep - 1) / ep


class _Routing(Protocol):
    """What routing a model does: its experts and how many each token uses."""

    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...


def max_expert_load_imbalance(moe: _Routing, ep: int) -> float:
    """The most the busiest of ``ep`` expert GPUs can receive over the mean: every token's
    copies its experts can take, ``min(top_k, experts per GPU)`` of each token's ``top_k``.

    >>> from opweave.costmodel import MoESpec
    >>> max_expert_load_imbalance(MoESpec(num_experts=128, top_k=8, expert_weight_bytes=1), 2)
    2.0
    """
    return min(moe.top_k, moe.num_experts // ep) * ep / moe.top_k


def expert_load_imbalance(moe: MoESpec, tokens: float, ep: int, skew: float = 1.0) -> float:
    """Copies the busiest of ``ep`` expert GPUs receives over the mean, for ``tokens`` tokens.

    ``tokens * top_k`` copies land uniformly on ``ep`` GPUs; the busiest receives the expected
    maximum of ``ep`` multinomial counts ([BLOM], normal approximation), times ``skew``, the
    router's measured imbalance of expected loads (1.0: balanced, as EPLB keeps them), and never
    more than every token's copies that its experts can take.

    >>> from opweave.costmodel import MoESpec
    >>> moe = MoESpec(num_experts=128, top_k=8, expert_weight_bytes=1)
    >>> round(expert_load_imbalance(moe, 1, 8), 2), round(expert_load_imbalance(moe, 256, 8), 3)
    (2.34, 1.084)
    >>> expert_load_imbalance(moe, 256, 1)
    1.0
    """
    if ep <= 1 or tokens <= 0:
        return 1.0
    picks = tokens * moe.top_k
    mean = picks / ep
    sigma = (picks * (1.0 / ep) * (1.0 - 1.0 / ep)) ** 0.5
    z = NormalDist().inv_cdf((ep - 0.375) / (ep + 0.25))
    return max(1.0, min((mean + z * sigma) * skew / mean, max_expert_load_imbalance(moe, ep)))


def alltoall_bytes_per_gpu(
    tokens: float, bytes_per_token: float, ep: int, scale_up_gpus: int, imbalance: float = 1.0
) -> tuple[float, float]:
    """``(NVLink bytes, network bytes)`` the busiest of ``ep`` GPUs receives when ``tokens`` tokens
    (the whole group's, spread evenly over its GPUs) each send ``bytes_per_token``.

    Each GPU receives ``tokens * bytes_per_token / ep`` on average, of which the copies from its
    own domain's other GPUs (``min(ep, D) - 1`` of ``ep``) cross NVLink and those from other
    domains the network; the busiest receives ``imbalance`` times the mean.

    >>> nvl, net = alltoall_bytes_per_gpu(256, 8 * 7392, 16, 8)
    >>> round(nvl / 1e3), round(net / 1e3)  # 7 of 16 sources over NVLink, 8 over the network
    (414, 473)
    """
    per_gpu = tokens * bytes_per_token / ep * imbalance
    local = min(ep, scale_up_gpus)
    return per_gpu * (local - 1) / ep, per_gpu * (ep - local) / ep


def alltoall_s(hw: HardwareSpec, nvlink_bytes: float, network_bytes: float) -> tuple[float, float]:
    """One dispatch or combine as ``(latency floor, payload time)``: NVLink and the network move
    their bytes concurrently, so the payload takes the slower of the two."""
    if nvlink_bytes <= 0 and network_bytes <= 0:
        return (0.0, 0.0)
    nvl = nvlink_bytes / (hw.intra_node_bandwidth_bytes_per_s * hw.link_efficiency)
    net = network_bytes / (hw.network_bandwidth_bytes_per_s * NETWORK_EFFICIENCY)
    return (hw.alltoall_latency_s, max(nvl, net))


def gather_scatter_s(
    hw: HardwareSpec, gpus: int, tokens: float, bytes_per_token: float
) -> tuple[float, float]:
    """The experts' other scheme, for ``ep < gpus`` with data-parallel ranks: every GPU of the
    group gathers all ``tokens`` hidden states (an all-gather over ``gpus``) and the expert
    outputs are reduce-scattered back (vLLM's ``allgather_reducescatter`` backend; the expert
    tensor-parallel group of vLLM's data-parallel deployment). ``(latency floor, payload)``:
    two collectives' floors, and a ring's ``2 (g - 1) / g`` bytes per payload byte, at the
    decode-size collective bandwidth within an NVLink domain (as :func:`collective_transfer_s`)
    and at the network's beyond it.

    >>> from opweave.costmodel import default_catalog
    >>> h100 = default_catalog().get("h100")
    >>> floor, payload = gather_scatter_s(h100, 8, 64, 8192 * 2)  # = an 8-GPU all-reduce of 1 MiB
    >>> round(floor * 1e6), round(payload * 1e6, 1)
    (6, 10.3)
    """
    if gpus <= 1 or tokens <= 0:
        return (0.0, 0.0)
    factor = 2.0 * (gpus - 1) / gpus
    floor = 2.0 * hw.allreduce_latency_s
    payload = tokens * bytes_per_token
    if gpus > hw.scale_up_gpus:
        return (floor, factor * payload / (hw.network_bandwidth_bytes_per_s * NETWORK_EFFICIENCY))
    link = hw.intra_node_bandwidth_bytes_per_s * hw.link_efficiency
    small_bw = hw.allreduce_bandwidth_bytes_per_s or link
    small = min(payload, SMALL_COLLECTIVE_MAX_BYTES)
    return (floor, factor * (small / small_bw + (payload - small) / link))
