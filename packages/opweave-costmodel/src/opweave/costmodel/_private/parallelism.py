"""Owner parallelism (TP, EP, DP): how one replica of an owner lays its operators on its GPUs.

One replica spans ``tp x dp`` GPUs, its *group*:

- **data-parallel attention.** The owner's non-expert operators (attention and its projections,
  norms, the router, a shared expert, embedding, head, sampling) run as ``dp`` copies, each a
  tensor-parallel group of ``tp`` GPUs serving its own slice of the replica's resident batch:
  ``ceil(batch / dp)`` requests, whose KV cache (or recurrent state) it alone holds. This is
  vLLM's data-parallel deployment (one engine core per DP rank), SGLang's
  ``--enable-dp-attention`` (attention TP = tp-size / dp-size) and the DP80 x TP4 attention of
  DeepSeek-V3's decoding deployment (§3.4.2).
- **expert parallelism.** The routed experts of each MoE layer span the whole group, sharded over
  ``ep`` sets of GPUs (``ep`` divides ``tp x dp``; where it does not divide the number of experts
  ``E``, each set holds ``ceil(E / ep)`` expert slots, the spare ones redundant copies as EPLB
  places them: :func:`weight_share`); the remaining
  factor ``tp x dp / ep`` shards each expert's intermediate dimension (tensor parallelism inside
  the experts, as vLLM runs experts without ``--enable-expert-parallel``, where they form a
  ``DP x TP`` tensor-parallel group, and SGLang's ``moe_tp_size = tp_size / ep_size``). Every GPU
  holds ``1 / (tp x dp)`` of the experts' weights whatever ``ep`` is. With ``ep = tp x dp``
  and ``dp > 1`` (the wide-EP layout: vLLM's ``--enable-expert-parallel`` with DP, SGLang's DeepEP
  backend, DeepSeek's EP320) each GPU holds whole experts and tokens reach them by all-to-all
  dispatch and combine
  (:mod:`.expert_comm`); the busiest expert GPU sets the time. With ``ep < tp x dp`` every GPU
  computes its share for all the group's tokens: they are all-gathered over the DP ranks and the
  outputs reduce-scattered back (with ``dp = 1`` that is the TP all-reduce as before, whatever
  ``ep`` is: every GPU already holds every token, so no all-to-all).
- **dense FFN layers** (``gate_up_proj``, ``down_proj``) span the group too, tensor-parallel over
  all ``tp x dp`` GPUs (SGLang's default under DP attention); ``ep`` is 1 on a dense model.
  With ``dense_dp`` (``dp > 1``) they are instead fully data-parallel: every GPU holds them whole
  and computes them for its own share of its DP rank's tokens, ``ceil(ceil(batch / dp) / tp)``,
  with no collective of their own. That is SGLang's ``--moe-dense-tp-size 1`` under DP attention
  (the dense MLP runs on the tokens scattered over the attention-TP ranks) and TensorRT-LLM's
  layout whenever attention DP is on (``DeepseekV3DecoderLayer._compute_mlp_tp_size`` in
  ``tensorrt_llm/_torch/models/modeling_deepseekv3.py``: "If using attention DP, the MLP also uses
  DP instead of TP", mlp_tp_size = 1); SGLang's wide-EP recipes set it (lmsys large-scale EP and
  GB200 blogs, Dynamo's ``examples/backends/sglang/slurm_jobs/scripts/gb200-fp8``).

Legal combinations (:func:`parallelism_problem`): ``tp``, ``ep``, ``dp`` at least 1; ``ep`` divides
``tp x dp`` and is at most the number of routed experts; ``dense_dp`` only with ``dp > 1``; every
operator splits as its degree asks (attention heads over ``tp``, dense FFN over ``tp x dp`` or not
at all, each expert over ``tp x dp / ep``); a TP group within one NVLink domain (``scale_up_gpus``:
the node, or a rack-scale domain such as GB200 NVL72's, whose trays of 4 GPUs share one NVLink
fabric); a group within one domain or a whole number of domains joined by the network.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .expert_comm import (
    BF16_BYTES,
    FP8_DISPATCH_BYTES_PER_ELEMENT,
    alltoall_bytes_per_gpu,
    alltoall_s,
    dispatch_bytes_per_token,
    expert_load_imbalance,
    gather_scatter_s,
)
from .fixed_costs import experts_touched, launch_s, step_overhead_s
from .formulas import max_resident_batch
from .hardware import HardwareSpec
from .model import LayerSpec, ModelSpec, OperatorSpec
from .profile import LatencyModel
from .quantize import block_tp_problem, compute_s, expert_channels, weight_only
from .roofline import (
    ProfiledLatency,
    RooflineLatency,
    activation_bytes_per_rank,
    op_bytes_and_flops,
    shard_fraction,
    state_shard_fraction,
)
from .sharding import op_tp_problem

# Far beyond any deployment (DeepSeek decodes on EP320); past it a plan file is corrupt.
MAX_GROUP_GPUS = 1024
# Replica sizes (tp x dp) the planner searches: a node, its multiples to EP64 (the largest of
# DeepEP's published intranode-plus-RDMA measurements short of 128), and a 72-GPU NVLink domain.
GROUP_GPUS = (1, 2, 4, 8, 16, 32, 64, 72)
# Basis of the busiest-expert-GPU factor when no measured skew is given ([ULTRAEP] in
# expert_comm.py measured 1.30-4.01 without a balancer, 1.01-1.04 with exact balancing).
BALANCED_BASIS = (
    "assumed: expert loads balanced in expectation (EPLB's redundant experts); the busiest "
    "expert GPU receives the expected maximum of uniform routing"
)
TERMS = (
    "roofline",
    "kernel_launch",
    "moe_experts",
    "step",
    "collective_latency",
    "collective",
    "alltoall_latency",
    "alltoall",
)


@dataclass(frozen=True, order=True)
class Parallelism:
    """(TP, EP, DP) of one owner replica: ``tp x dp`` GPUs (see the module docstring).

    >>> p = Parallelism(tp=2, ep=8, dp=4)
    >>> p.gpus, p.expert_tp, p.wide_ep, str(p)
    (8, 1, True, 'tp2 ep8 dp4')
    >>> str(Parallelism(tp=1, ep=32, dp=32, dense_dp=True))
    'tp1 ep32 dp32 dense-dp'
    """

    tp: int = 1
    ep: int = 1
    dp: int = 1
    dense_dp: bool = False  # dense FFN layers fully data-parallel (see the module docstring)

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def expert_tp(self) -> int:
        """Tensor parallelism inside each expert: the group's GPUs per expert set."""
        return self.gpus // self.ep

    @property
    def wide_ep(self) -> bool:
        """Experts whole on every GPU, reached by all-to-all (``ep = tp x dp``, ``dp > 1``).

        With ``dp = 1`` every GPU already holds every token (tensor-parallel attention): each
        computes the tokens routed to its own experts and the TP all-reduce that follows the
        experts combines them, as TensorRT-LLM's attention-TP + MoE-EP layout and vLLM's
        expert parallelism without DP run it; no all-to-all.
        """
        return self.ep > 1 and self.ep == self.gpus and self.dp > 1

    @property
    def plain(self) -> bool:
        """Tensor parallelism only (``ep = dp = 1``)."""
        return self.ep == 1 and self.dp == 1 and not self.dense_dp

    def describe(self, moe: bool = True) -> str:
        """How a replica lays out its GPUs, in words (``moe``: the model has routed experts).

        >>> Parallelism(tp=4).describe()
        'TP4'
        >>> Parallelism(tp=2, ep=8, dp=4).describe()
        'attention in 4 data-parallel ranks of TP2, experts EP8 over the 8 GPUs'
        >>> Parallelism(tp=8, ep=2).describe()
        'attention TP8, experts over EP2, each TP4'
        >>> Parallelism(tp=1, dp=4).describe(moe=False)
        'attention in 4 data-parallel ranks of TP1, FFN TP4'
        """
        if self.plain:
            return f"TP{self.tp}"
        gpus = self.gpus
        if self.dp > 1:
            attention = f"attention in {self.dp} data-parallel ranks of TP{self.tp}"
        else:
            attention = f"attention TP{self.tp}"
        if not moe:
            ffn = "FFN data-parallel" if self.dense_dp else f"FFN TP{gpus}"
            return f"{attention}, {ffn}"
        if self.ep == 1:
            experts = f"experts TP{gpus}"
        elif self.ep == gpus:
            experts = f"experts EP{self.ep} over the {gpus} GPUs"
        else:
            experts = f"experts over EP{self.ep}, each TP{self.expert_tp}"
        dense = ", dense FFN layers data-parallel" if self.dense_dp else ""
        return f"{attention}, {experts}{dense}"

    def __str__(self) -> str:
        if self.plain:
            return f"tp{self.tp}"
        return f"tp{self.tp} ep{self.ep} dp{self.dp}" + (" dense-dp" if self.dense_dp else "")


def is_group_op(op: OperatorSpec) -> bool:
    """Whether ``op`` spans the replica's whole group: routed experts and dense FFN layers."""
    return op.moe is not None or op.name in ("gate_up_proj", "down_proj")


def spans_group(op: OperatorSpec, par: Parallelism) -> bool:
    """Whether ``op`` spans the group at ``par``: routed experts, and dense FFN layers unless
    they are data-parallel (``par.dense_dp``)."""
    return is_group_op(op) and not (par.dense_dp and op.moe is None)


def is_dense_dp_op(op: OperatorSpec, par: Parallelism) -> bool:
    """A dense FFN layer held whole on every GPU (``par.dense_dp``)."""
    return par.dense_dp and is_group_op(op) and op.moe is None


def dp_batch(batch: float, dp: int) -> float:
    """Requests one DP rank holds of a replica's ``batch``: the busiest's ``ceil(batch / dp)``."""
    return batch if dp == 1 else float(math.ceil(batch / dp - 1e-9))


def dispatch_element_bytes(model: ModelSpec, op: OperatorSpec, hw: HardwareSpec) -> float:
    """Bytes per dispatched element: FP8 with per-128 scales where the routed experts' GEMMs
    take FP8 (or FP4) inputs on ``hw``'s tensor cores, as DeepEP's low-latency dispatch sends
    them; BF16 where they run weight-only or unquantised (:mod:`.expert_comm`).

    >>> from opweave.costmodel import default_catalog, load_model
    >>> moe = load_model("qwen3-30b-a3b", quant="fp8-block")
    >>> experts = next(o for o in moe.operators if o.moe is not None)
    >>> cat = default_catalog()
    >>> dispatch_element_bytes(moe, experts, cat.get("h200")), dispatch_element_bytes(
    ...     moe, experts, cat.get("a100"))
    (1.03125, 2.0)
    """
    if model.dtype == "float8_e4m3fn":
        return FP8_DISPATCH_BYTES_PER_ELEMENT
    fmt = op.weight_format
    if fmt is None or fmt not in _LOW_PRECISION_INPUTS or weight_only(op):
        return BF16_BYTES  # weight-only GEMMs (W4A16) take their inputs in the compute dtype
    return FP8_DISPATCH_BYTES_PER_ELEMENT if getattr(hw, _LOW_PRECISION_INPUTS[fmt]) else BF16_BYTES


# weight formats whose GEMMs quantise their inputs, by the HardwareSpec rate that says the GPU
# has tensor cores for them (precision.gemm_rate's tensor paths)
_LOW_PRECISION_INPUTS = {
    "fp8": "effective_fp8_flops",
    "fp8-block": "effective_fp8_flops",
    "nvfp4": "effective_fp4_flops",
}


# -- legality -----------------------------------------------------------------------------------
def _group_op_problem(
    model: ModelSpec, op: OperatorSpec, par: Parallelism, engine_splits: bool
) -> str | None:
    moe = model.arch.moe
    if op.moe is not None:
        assert moe is not None
        if moe.intermediate_size % par.expert_tp:
            return (
                f"{op.key}: expert intermediate size {moe.intermediate_size} does not split "
                f"over the {par.expert_tp} GPUs of each expert (tp x dp / ep)"
            )
        if op.name == "experts":  # each expert's channels split over its expert_tp GPUs
            return block_tp_problem(op, model.precision, par.expert_tp, engine_splits=engine_splits)
    return op_tp_problem(model, op, par.gpus, engine_splits=engine_splits)


def parallelism_problem(
    model: ModelSpec,
    par: Parallelism,
    hardware: HardwareSpec | None = None,
    ops: Iterable[OperatorSpec] | None = None,
    *,
    engine_splits: bool = False,
) -> str | None:
    """Why ``model`` (or just its operators ``ops``) cannot run at ``par`` on ``hardware``;
    ``None`` when it can. ``engine_splits`` also accepts the uneven splits serving engines run
    and the runtime does not (:func:`.sharding.tp_problem`); the planner never passes it.

    >>> from opweave.costmodel import load_model
    >>> moe = load_model("qwen3-30b-a3b")
    >>> parallelism_problem(moe, Parallelism(tp=1, ep=8, dp=8)) is None
    True
    >>> parallelism_problem(moe, Parallelism(tp=2, ep=4, dp=3))
    'ep 4 does not divide tp x dp = 6'
    >>> parallelism_problem(load_model("qwen3-32b"), Parallelism(tp=1, ep=2, dp=2))
    'ep 2: qwen3-32b has no routed experts (a dense model); use ep 1'
    """
    for name, value in (("tp", par.tp), ("ep", par.ep), ("dp", par.dp)):
        if value < 1:
            return f"{name} must be at least 1, got {value}"
    g = par.gpus
    if g > MAX_GROUP_GPUS:
        return f"tp x dp = {g} GPUs per replica; at most {MAX_GROUP_GPUS} are supported"
    moe = model.arch.moe
    if par.ep > 1 and moe is None:
        return f"ep {par.ep}: {model.name} has no routed experts (a dense model); use ep 1"
    if g % par.ep:
        return f"ep {par.ep} does not divide tp x dp = {g}"
    if par.dense_dp and par.dp == 1:
        return "dense FFN data-parallel needs data-parallel attention (dp > 1)"
    if moe is not None and par.ep > moe.num_experts:
        return f"ep {par.ep} is more than the {moe.num_experts} routed experts"
    seen: set[tuple[str, str | None]] = set()
    for op in model.operators if ops is None else ops:
        # an operator's split depends on its name and its layer's kind only
        kind = None if op.layer is None else model.arch.layer_types[op.layer]
        if (op.name, kind) in seen:
            continue
        seen.add((op.name, kind))
        if is_dense_dp_op(op, par):
            continue  # whole on every GPU: nothing to split
        problem = (
            _group_op_problem(model, op, par, engine_splits)
            if spans_group(op, par)
            else op_tp_problem(model, op, par.tp, engine_splits=engine_splits)
        )
        if problem:
            return problem
    if hardware is not None:
        domain = hardware.scale_up_gpus
        if par.tp > domain:
            return (
                f"tp {par.tp}: {hardware.id} has {domain} GPUs per NVLink domain and a TP group "
                "stays within one"
            )
        if g > domain and g % domain:
            return (
                f"a group of tp x dp = {g} {hardware.id} GPUs spans part of an NVLink domain of "
                f"{domain}; use a group within one domain or a multiple of {domain}"
            )
    return None


# -- latency ------------------------------------------------------------------------------------
def _expert_comm_terms(
    hw: HardwareSpec,
    model: ModelSpec,
    op: OperatorSpec,
    par: Parallelism,
    tokens: float,
    imbalance: float,
) -> dict[str, float]:
    """The routed experts' communication: all-to-all dispatch and combine (wide EP); the TP
    collective over the ranks that already hold every token (``dp = 1``); else gather and
    scatter over the group."""
    assert op.moe is not None
    if par.wide_ep:
        out = {"alltoall_latency": 0.0, "alltoall": 0.0}
        dispatch = dispatch_element_bytes(model, op, hw)
        for element_bytes in (dispatch, BF16_BYTES):  # dispatch, combine
            per_token = dispatch_bytes_per_token(op.moe, model.hidden_size, element_bytes)
            nvl, net = alltoall_bytes_per_gpu(
                tokens, per_token, par.ep, hw.scale_up_gpus, imbalance
            )
            floor, payload = alltoall_s(hw, nvl, net)
            out["alltoall_latency"] += floor
            out["alltoall"] += payload
        return out
    if par.dp == 1:
        floor, payload = RooflineLatency(hw).collective_terms_s(op, par.tp, tokens)
    else:
        floor, payload = gather_scatter_s(hw, par.gpus, tokens, model.hidden_size * BF16_BYTES)
    return {"collective_latency": floor, "collective": payload}


def parallel_op_terms_s(
    hw: HardwareSpec,
    model: ModelSpec,
    op: OperatorSpec,
    par: Parallelism,
    batch: float,
    context: float,
    skew: float = 1.0,
) -> dict[str, float]:
    """One execution of ``op`` for a replica's ``batch`` on the roofline, by term (``TERMS``):
    the time of its busiest GPU. ``skew`` is the router's measured imbalance of expected expert
    loads (:func:`.expert_comm.expert_load_imbalance`).

    Non-expert operators run on each DP rank's ``ceil(batch / dp)`` requests at ``tp`` with
    their TP collective. Group operators run over ``tp x dp`` GPUs on the whole batch; routed
    experts at the load of the busiest expert GPU, with the fused-MoE fixed cost per expert it
    touches.

    >>> from opweave.costmodel import default_catalog, load_model
    >>> moe, h200 = load_model("qwen3-30b-a3b"), default_catalog().get("h200")
    >>> experts = next(o for o in moe.layers[0].ops if o.name == "experts")
    >>> t = parallel_op_terms_s(h200, moe, experts, Parallelism(tp=1, ep=8, dp=8), 256, 4096)
    >>> round(t["alltoall_latency"] * 1e6), round(t["alltoall"] * 1e6, 1)  # dispatch + combine
    (84, 5.3)
    """
    out: dict[str, float] = dict.fromkeys(TERMS, 0.0)
    if batch <= 0:
        return out
    if is_dense_dp_op(op, par):
        # whole on every GPU, on its share of its DP rank's tokens; no collective of its own
        b = float(math.ceil(dp_batch(batch, par.dp) / par.tp - 1e-9))
        out.update(RooflineLatency(hw).op_terms_s(op, 1, b, context))
        return out
    if not spans_group(op, par) or par.plain:
        # each DP rank at tp: the roofline's terms and the operator's TP collective
        b = dp_batch(batch, par.dp)
        lat = RooflineLatency(hw)
        out.update(lat.op_terms_s(op, par.tp, b, context))
        out["collective_latency"], out["collective"] = lat.collective_terms_s(op, par.tp, b)
        return out
    g = par.gpus
    imbalance = 1.0
    if op.moe is not None:
        imbalance = expert_load_imbalance(op.moe, batch, par.ep, skew)
    load = batch * imbalance
    num_bytes, flops = op_bytes_and_flops(op, g, load, context)
    # each GPU holds 1 / expert_tp of the channels of the experts it holds
    channels = expert_channels(op, 1.0 / par.expert_tp)
    math_s = compute_s(op, hw, flops, load, shard_fraction(op, g), channels)
    out["roofline"] = max(num_bytes / hw.effective_bandwidth, math_s)
    out["kernel_launch"] = launch_s(op, hw, batch)
    out["step"] = step_overhead_s(op, batch, hw)
    if op.moe is not None:
        touched = experts_touched(op, load) / par.ep
        out["moe_experts"] = hw.expert_fixed_latency_s + touched * hw.expert_overhead_s
        out.update(_expert_comm_terms(hw, model, op, par, batch, imbalance))
    elif op.name == "down_proj":  # dense FFN over the group: tokens gathered, outputs scattered
        floor, payload = gather_scatter_s(hw, g, batch, model.hidden_size * BF16_BYTES)
        out["collective_latency"], out["collective"] = floor, payload
    return out


def parallel_op_latency_s(
    latency: LatencyModel | RooflineLatency | ProfiledLatency,
    model: ModelSpec,
    op: OperatorSpec,
    layer: LayerSpec | None,
    par: Parallelism,
    batch: float,
    context: float,
    skew: float = 1.0,
) -> float:
    """Seconds of one execution of ``op`` (with its collectives) for a replica's ``batch``.

    Tensor parallelism alone asks the latency model (a roofline or a measured profile); EP and
    DP compose the roofline's terms (:func:`parallel_op_terms_s`), as a profile measures TP only.
    """
    if par.plain:
        return latency.op_latency_s(model, op, layer, par.tp, batch, context) + (
            latency.collective_s(op, par.tp, batch)
        )
    if not isinstance(latency, RooflineLatency):
        raise ConfigError(
            f"{latency.hardware.id}: a measured profile holds tensor-parallel latencies only; "
            f"{par} needs the roofline (drop --profile for it)"
        )
    return sum(parallel_op_terms_s(latency.hardware, model, op, par, batch, context, skew).values())


# -- memory -------------------------------------------------------------------------------------
def weight_bytes_per_gpu(ops: Sequence[OperatorSpec], par: Parallelism) -> float:
    """Weights one GPU holds: non-expert operators sharded over ``tp`` (replicated on every DP
    rank), routed experts and dense FFN layers over all ``tp x dp`` GPUs (whole with
    ``dense_dp``); tied weights once."""
    seen: set[str] = set()
    total = 0.0
    for op in ops:
        if op.tied_to is not None:
            if op.tied_to in seen:
                continue
            seen.add(op.tied_to)
        total += op.weight_bytes * weight_share(op, par)
    return total


def weight_share(op: OperatorSpec, par: Parallelism) -> float:
    """Share of ``op``'s weights one GPU holds: non-expert operators over ``tp``, dense FFN
    layers over the group (whole with ``dense_dp``), routed experts ``ceil(E / ep)`` expert
    slots per expert set, each split over its ``expert_tp`` GPUs. Where ``ep`` does not divide
    the ``E`` experts the spare slots hold redundant copies of the busiest experts, as EPLB
    places them (DeepSeek-V3 decoding: 256 experts + 32 redundant over EP 288 / 72; SGLang's
    ``--ep-num-redundant-experts``); with ``ep`` dividing ``E`` this is ``1 / (tp x dp)``.

    >>> from opweave.costmodel import load_model
    >>> moe = load_model("qwen3-30b-a3b")  # 128 experts
    >>> experts = next(o for o in moe.operators if o.moe is not None)
    >>> weight_share(experts, Parallelism(tp=1, ep=8, dp=8)), weight_share(
    ...     experts, Parallelism(tp=1, ep=48, dp=48))  # 3 slots of 128 on each of 48 GPUs
    (0.125, 0.0234375)
    """
    if is_dense_dp_op(op, par):
        return 1.0
    if not spans_group(op, par):
        return shard_fraction(op, par.tp)
    if op.moe is None or par.ep == 1:
        return shard_fraction(op, par.gpus)
    experts = op.moe.num_experts
    return math.ceil(experts / par.ep) / experts * shard_fraction(op, par.expert_tp)


def request_bytes_per_gpu(ops: Sequence[OperatorSpec], par: Parallelism, context: float) -> float:
    """State (KV cache, recurrent state) and activations one request adds on the GPUs of the
    DP rank that holds it."""
    state = sum(
        float(op.state_bytes(context)) * state_shard_fraction(op, par.tp)
        for op in ops
        if op.holds_state
    )
    return state + activation_bytes_per_rank(list(ops), 1.0)


def memory_bytes_per_gpu(
    ops: Sequence[OperatorSpec], par: Parallelism, batch: float, context: float
) -> float:
    """Memory of the busiest GPU of a replica holding ``batch`` requests: weights, and the state
    and activations of its DP rank's ``ceil(batch / dp)`` requests.

    >>> from opweave.costmodel import load_model, memory_bytes_per_rank
    >>> ops = load_model("qwen3-30b-a3b").operators
    >>> memory_bytes_per_gpu(ops, Parallelism(tp=4), 32, 4096) == memory_bytes_per_rank(
    ...     ops, 4, 32, 4096)
    True
    """
    return weight_bytes_per_gpu(ops, par) + dp_batch(batch, par.dp) * request_bytes_per_gpu(
        ops, par, context
    )


def max_replica_batch(
    ops: Sequence[OperatorSpec], par: Parallelism, hardware: HardwareSpec, context: float
) -> int:
    """Largest resident batch of one replica that fits on every GPU: ``dp`` times what one DP
    rank's GPUs hold beside the weights."""
    per_rank = max_resident_batch(
        hardware.usable_memory_bytes,
        weight_bytes_per_gpu(ops, par),
        request_bytes_per_gpu(ops, par, context),
    )
    return per_rank * par.dp
