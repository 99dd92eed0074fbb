"""Roofline operator latencies, tensor parallelism and memory feasibility (paper §3, A.1).

Operator latency on one tensor-parallel rank:
``max(bytes / (peak_bw * eta_mem), flops / (peak_flops * eta_flop))``, the FLOPs of quantised
linears at their weight format's tensor-core rate (``quantize.compute_s``), plus the fixed costs of
``fixed_costs.py`` (per kernel launch, per MoE expert pass, per decode step), where the
efficiency factors and fixed costs are measured public figures (see ``hardware.py``). A TP group
shards weights, heads and FLOPs and runs an all-reduce (or all-gather) over the intra-node link
after row-parallel operators: a latency floor plus the payload at the bandwidth decode-size
collectives reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .fixed_costs import (
    collective_latency_s,
    collective_transfer_s,
    expert_fixed_s,
    launch_s,
    side_stream_overlaps,
    step_overhead_s,
)
from .formulas import max_resident_batch
from .hardware import HardwareSpec
from .model import LayerSpec, ModelSpec, OperatorSpec, TPCollective
from .profile import (
    CollectiveKind,
    LinkKind,
    Profile,
    profile_key,
)
from .quantize import compute_s

# Inter-node all-reduce reaches 191 of 200 GB/s per node in NVIDIA DeepOps' measurements.
NETWORK_EFFICIENCY = 0.95


def shard_fraction(op: OperatorSpec, tp: int) -> float:
    """Share of an operator's weights, FLOPs and activations one of ``tp`` ranks holds
    (its replicated share whole, the rest split)."""
    if tp == 1 or not op.tp_sharded:
        return 1.0
    split = math.ceil(op.shard_units / tp) / op.shard_units if op.shard_units else 1.0 / tp
    replicated = op.tp_replicated_fraction
    return replicated + (1.0 - replicated) * split


def state_shard_fraction(op: OperatorSpec, tp: int) -> float:
    """Share of an operator's per-request state one of ``tp`` ranks holds and reads."""
    return 1.0 if op.state_tp_replicated else shard_fraction(op, tp)


def bytes_moved_per_rank(op: OperatorSpec, tp: int, batch: float, context: float) -> float:
    """Bytes one of ``tp`` ranks moves for one execution (weights, activations and state)."""
    moved = float(op.bytes_moved(batch, context)) * shard_fraction(op, tp)
    if op.state_tp_replicated and tp > 1:
        state = batch * float(op.state_bytes_read(context))
        moved += state * (state_shard_fraction(op, tp) - shard_fraction(op, tp))
    return moved


def op_bytes_and_flops(
    op: OperatorSpec, tp: int, batch: float, context: float
) -> tuple[float, float]:
    """Bytes moved and FLOPs of one rank for one execution."""
    index = float(op.index_flops(batch, context))  # every rank scores every token whole
    flops = (float(op.flops(batch, context)) - index) * shard_fraction(op, tp) + index
    return bytes_moved_per_rank(op, tp, batch, context), flops


def index_s(flops: float, hw: HardwareSpec) -> float:
    """Seconds of a DSA indexer's scoring FLOPs: its q.k logits run in FP8 (DeepGEMM's
    ``fp8_mqa_logits``, as vLLM and SGLang run DeepSeek-V3.2's indexer) where the GPU has FP8
    tensor cores, else at the dense rate."""
    return flops / (hw.effective_fp8_flops or hw.effective_flops) if flops else 0.0


@dataclass(frozen=True)
class RooflineLatency:
    """The default :class:`LatencyModel`: datasheet peaks scaled by measured efficiencies."""

    hardware: HardwareSpec

    def op_latency_s(
        self,
        model: ModelSpec,
        op: OperatorSpec,
        layer: LayerSpec | None,
        tp: int,
        batch: float,
        context: float,
    ) -> float:
        del model, layer
        return sum(self.op_terms_s(op, tp, batch, context).values())

    def op_terms_s(
        self, op: OperatorSpec, tp: int, batch: float, context: float
    ) -> dict[str, float]:
        """``op_latency_s`` split into its roofline and its fixed costs (``fixed_costs.py``)."""
        if batch <= 0:
            return {"roofline": 0.0, "kernel_launch": 0.0, "moe_experts": 0.0, "step": 0.0}
        hw = self.hardware
        num_bytes, flops = op_bytes_and_flops(op, tp, batch, context)
        index = float(op.index_flops(batch, context))  # DSA's FP8 scoring (index_s)
        math_s = compute_s(op, hw, flops - index, batch, shard_fraction(op, tp))
        math_s += index_s(index, hw)
        return {
            "roofline": max(num_bytes / hw.effective_bandwidth, math_s),
            "kernel_launch": launch_s(op, hw, batch),
            "moe_experts": expert_fixed_s(op, batch, hw),
            "step": step_overhead_s(op, batch, hw),
        }

    def collective_s(self, op: OperatorSpec, tp: int, batch: float) -> float:
        return sum(self.collective_terms_s(op, tp, batch))

    def collective_terms_s(self, op: OperatorSpec, tp: int, batch: float) -> tuple[float, float]:
        """``collective_s`` as (latency floor, payload over bandwidth)."""
        if tp == 1 or op.tp_collective is TPCollective.NONE or batch <= 0:
            return (0.0, 0.0)
        hw = self.hardware
        return (collective_latency_s(op, tp, hw), collective_transfer_s(op, tp, batch, hw))

    def transfer_s(self, link: LinkKind, num_bytes: float) -> float:
        hw = self.hardware
        if link == "intra_node":
            bw = hw.intra_node_bandwidth_bytes_per_s * hw.link_efficiency
            return hw.intra_node_latency_s + num_bytes / bw
        bw = hw.network_bandwidth_bytes_per_s * NETWORK_EFFICIENCY
        return hw.network_latency_s + num_bytes / bw


@dataclass(frozen=True)
class ProfiledLatency:
    """A :class:`LatencyModel` backed by a measured (or synthesised) profile.

    Collectives and transfers not in the profile fall back to the roofline of the profile's
    device. A measured profile times the sampling kernel, not the decode step around it: unless
    it also measured the runtime's own loop (``orchestration``, which the planner charges
    apart), ``sample`` is charged the device's per-step cost (:meth:`step_s`) on top, as the
    roofline charges it. A synthesised profile's ``sample`` holds that cost already.
    """

    profile: Profile

    @property
    def hardware(self) -> HardwareSpec:
        return self.profile.device

    def step_s(self, op: OperatorSpec, batch: float) -> float:
        """The per-step cost ``op_latency_s`` adds to the profile's ``sample`` latency."""
        profile = self.profile
        measured_alone = profile.provenance.source == "measured" and profile.orchestration is None
        if batch <= 0 or not measured_alone:
            return 0.0
        return step_overhead_s(op, batch, profile.device)

    def op_latency_s(
        self,
        model: ModelSpec,
        op: OperatorSpec,
        layer: LayerSpec | None,
        tp: int,
        batch: float,
        context: float,
    ) -> float:
        del model
        if batch <= 0:
            return 0.0
        if self.beside_experts(op, batch):
            return RooflineLatency(self.hardware).op_terms_s(op, tp, batch, context)["roofline"]
        median = self.profile.table(profile_key(op, layer), tp)(batch, context)
        return median * (1.0 + self.profile.stall_overhead) + self.step_s(op, batch)

    def beside_experts(self, op: OperatorSpec, batch: float) -> bool:
        """Whether ``op`` runs beside the routed experts in the engines this profile times
        (``fixed_costs`` [SHARED-STREAM]): an imported engine profile times a shared expert
        alone, launches and all, where the engines overlap it with the routed experts, so it
        costs its bytes (the roofline's term) and not its measured time. The runtime's own
        profiles run it inline, as they measured it."""
        return self.profile.provenance.source == "aiconfigurator" and side_stream_overlaps(
            op, self.hardware, batch
        )

    def collective_s(self, op: OperatorSpec, tp: int, batch: float) -> float:
        return sum(self.collective_terms_s(op, tp, batch))

    def collective_terms_s(self, op: OperatorSpec, tp: int, batch: float) -> tuple[float, float]:
        """(latency floor, payload) of ``op``'s TP collective: the profile's measured
        all-reduce or all-gather at the payload's size (all of it payload), else the roofline's
        terms."""
        table = None
        if tp > 1 and op.tp_collective != TPCollective.NONE and batch > 0:
            kind: CollectiveKind = (
                "allreduce" if op.tp_collective == TPCollective.ALLREDUCE else "allgather"
            )
            table = self.profile.collective(kind, tp)
        if table is None:
            return RooflineLatency(self.hardware).collective_terms_s(op, tp, batch)
        return (0.0, table(batch * op.tp_collective_bytes_per_token))

    def transfer_s(self, link: LinkKind, num_bytes: float) -> float:
        measured = self.profile.transfer(link)
        if measured is None:
            return RooflineLatency(self.hardware).transfer_s(link, num_bytes)
        return measured.latency_s + num_bytes / measured.bandwidth_bytes_per_s


def weight_bytes_per_rank(ops: tuple[OperatorSpec, ...] | list[OperatorSpec], tp: int) -> float:
    """Resident weights one rank holds for these operators (tied weights once)."""
    seen: set[str] = set()
    total = 0.0
    for op in ops:
        if op.tied_to is not None:
            if op.tied_to in seen:
                continue
            seen.add(op.tied_to)
        total += op.weight_bytes * shard_fraction(op, tp)
    return total


def state_bytes_per_rank(
    ops: tuple[OperatorSpec, ...] | list[OperatorSpec], tp: int, batch: float, context: float
) -> float:
    """KV / recurrent state one rank holds for ``batch`` requests at context ``context``."""
    return float(
        sum(
            batch * float(op.state_bytes(context)) * state_shard_fraction(op, tp)
            for op in ops
            if op.holds_state
        )
    )


def activation_bytes_per_rank(
    ops: tuple[OperatorSpec, ...] | list[OperatorSpec], batch: float
) -> float:
    """Transient activation workspace: the two largest live tensors of the step."""
    sizes = sorted((op.boundary_bytes_per_token for op in ops), reverse=True)
    return float(batch * sum(sizes[:2]))


def profile_activation_bytes(
    ops: tuple[OperatorSpec, ...] | list[OperatorSpec], tokens: float, seqs: float
) -> float:
    """Activations an engine's start-up profile reserves before it sizes the KV cache: the
    forward over a full step of ``tokens`` (its two largest live tensors) and the logits of one
    position per request, ``min(seqs, tokens)`` rows. vLLM's ``GPUModelRunner.profile_run``
    (``vllm/v1/worker/gpu_model_runner.py``) runs ``_dummy_run(self.max_num_tokens)``, whose
    forward returns hidden states, then ``_dummy_sampler_run(last_hidden_states)``: the LM head
    computes logits for those rows only, one per dummy request (``max_num_seqs`` of them), not
    for every token of the step."""
    head = [op for op in ops if op.name == "lm_head"]
    body = [op for op in ops if op.name != "lm_head"]
    rows = min(seqs, tokens)
    return activation_bytes_per_rank(body, tokens) + rows * sum(
        op.boundary_bytes_per_token for op in head
    )


def memory_bytes_per_rank(
    ops: tuple[OperatorSpec, ...] | list[OperatorSpec], tp: int, batch: float, context: float
) -> float:
    return (
        weight_bytes_per_rank(ops, tp)
        + state_bytes_per_rank(ops, tp, batch, context)
        + activation_bytes_per_rank(ops, batch)
    )


def max_batch(
    ops: tuple[OperatorSpec, ...] | list[OperatorSpec],
    tp: int,
    hardware: HardwareSpec,
    context: float,
) -> int:
    """Largest integer batch whose weights, state and activations fit on every rank."""
    per_request = state_bytes_per_rank(ops, tp, 1.0, context) + activation_bytes_per_rank(ops, 1.0)
    return max_resident_batch(
        hardware.usable_memory_bytes, weight_bytes_per_rank(ops, tp), per_request
    )
