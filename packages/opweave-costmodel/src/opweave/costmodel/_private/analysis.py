"""Closed-form cost analysis of colocated vs operator-disaggregated decode (paper §3, A.1-A.6).

One *unit* is a device group of ``tp`` GPUs of one type, seen as a single device: usable memory
``M``, effective bandwidth ``B``, effective FLOP/s ``F`` and price ``c`` are ``tp`` times one GPU's.
Model terms, all per decode step of one request:

- ``W``: resident weight bytes (all experts of an MoE: the A.4 weight-footprint approximation);
- ``f``: FLOPs per token of every non-attention operator (active parameters only);
- ``m_kv(s)``: state a request holds at context ``s`` -- the *capacity* term that bounds batches;
- ``a(s)``: state bytes a request moves per step -- the *traffic* term of memory-bound attention.
  The paper writes both as ``m_kv``; here ``a = m_kv + (recurrent state)``, because a linear-
  attention layer reads *and* writes its state each step. ``a - m_kv`` is context-independent, so
  Theorems 3.1 and 3.2 hold unchanged (the monotonicity proof needs ``a' = m_kv'``, and the bound
  needs ``a >= m_kv``).

Costs (seconds of the unit per token, times ``c``; reported in USD per million tokens):

- colocated, batch ``b``: ``a/B + max(W/(B b), f/F)``, at the relaxed ``b_max = (M - W)/m_kv``
  and at the integer ``floor(b_max)``; GEMMs turn compute-bound at ``b* = W F / (B f)``;
- homogeneous ODS: ``a/B + f/F`` (A.2/A.3: attention memory-bound, GEMMs compute-bound on the
  batch aggregated over attention replicas);
- heterogeneous ODS over types ``x``: ``min_x(c_x/B_x) a + min_x(c_x/F_x) f`` (tp cancels).

Every comparison is made where colocation fits one request, ``b_max(s) >= 1`` (A.5); outside it
the costs are NaN and the ``feasible`` masks are False -- contexts are never dropped.

The roofline regime. Like the paper's §3, this analysis prices bytes and FLOPs only: the fixed
costs of ``fixed_costs.py`` (per kernel launch, per TP collective, per MoE expert pass, per step)
are left out, so Theorems 3.1 and 3.2 hold exactly as stated, for the cost lines they are about.
Those costs do not scale with bytes or FLOPs, so they enter none of the lines' slopes; they add a
per-token amount that depends on how a plan batches and stages the work, which is what the
planner's simulator prices (``opweave estimate`` and the planner use the full latency model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ..errors import ConfigError, InfeasibleError
from .hardware import HardwareSpec
from .model import AttentionKind, LayerSpec, ModelSpec
from .plan import TP_DEGREES
from .precision import check_runs
from .quantize import gemm_flops_per_s

__all__ = ["Analysis", "CadFeasibility", "GpuAnalysis", "HeterogeneousAnalysis", "analyze"]

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]

SECONDS_PER_HOUR = 3600.0
TOKENS_PER_MILLION = 1e6
CAD_MICROBATCHES = 2  # A.6: the fewest microbatches that let the two CAD stages overlap


def _frozen(array: ArrayLike, dtype: Any = np.float64) -> NDArray[Any]:
    out = np.array(array, dtype=dtype)
    out.setflags(write=False)
    return out


def _jsonable(value: Any) -> Any:
    """Arrays to lists, NaN/inf to None, nested dataclasses to dicts."""
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer | np.bool_):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _jsonable(getattr(value, f.name)) for f in fields(value)}
    return value


@dataclass(frozen=True)
class CadFeasibility:
    """Whether core-attention disaggregation can balance its two stages (A.6).

    Per layer of one attention kind: the rest-of-model stage cannot run faster than loading its
    weights, ``t_rest_min_s = W_layer_rest / B_gemm``; the attention stage of one microbatch can
    take at most ``t_attn_max_s(s) = (b_cap(s) / microbatches) * a_layer(s) / B_attn``, where
    ``b_cap(s) = floor(M_attn / m_kv(s))`` requests fit on the attention group. Balance needs
    ``t_attn_max_s >= t_rest_min_s`` and at least one request per microbatch.
    """

    attention_kind: str
    attention_gpu: str
    attention_tp: int
    gemm_gpu: str
    gemm_tp: int
    microbatches: int
    b_cap: FloatArray = field(repr=False)
    t_attn_max_s: FloatArray = field(repr=False)
    t_rest_min_s: float
    feasible: BoolArray = field(repr=False)


@dataclass(frozen=True)
class GpuAnalysis:
    """§3.2 quantities for one GPU type analysed as a unit of ``tp`` GPUs."""

    gpu: str
    tp: int
    memory_bytes: float = field(metadata={"doc": "M: usable memory of the unit"})
    bandwidth_bytes_per_s: float = field(metadata={"doc": "B: effective, of the unit"})
    flops_per_s: float = field(metadata={"doc": "F: effective dense, of the unit"})
    usd_per_hour: float = field(metadata={"doc": "c: price of the unit"})
    b_star: float = field(metadata={"doc": "GEMM compute-bound threshold W F / (B f)"})
    bound: float = field(metadata={"doc": "Theorem 3.1 bound M / (M - W)"})
    feasible: BoolArray = field(repr=False, metadata={"doc": "b_max >= 1"})
    b_max: FloatArray = field(repr=False, metadata={"doc": "relaxed batch (M - W) / m_kv"})
    b_max_int: NDArray[np.int64] = field(repr=False, metadata={"doc": "floor(b_max)"})
    compute_bound: BoolArray = field(repr=False, metadata={"doc": "b_max >= b_star"})
    cost_colocated: FloatArray = field(repr=False, metadata={"doc": "USD/Mtok at b_max"})
    cost_colocated_int: FloatArray = field(repr=False, metadata={"doc": "USD/Mtok at b_max_int"})
    cost_homogeneous: FloatArray = field(repr=False, metadata={"doc": "USD/Mtok, ODS"})
    gain_homogeneous: FloatArray = field(repr=False, metadata={"doc": "cost_colocated / ODS"})
    gain_homogeneous_int: FloatArray = field(repr=False)
    cad: CadFeasibility = field(repr=False, metadata={"doc": "A.6 for the primary kind"})
    cad_by_kind: Mapping[str, CadFeasibility] = field(repr=False)

    @property
    def usd_per_byte(self) -> float:
        """Cost of moving one byte at full bandwidth: the attention figure of merit."""
        return self.usd_per_hour / SECONDS_PER_HOUR / self.bandwidth_bytes_per_s

    @property
    def usd_per_flop(self) -> float:
        """Cost of one FLOP at full throughput: the GEMM figure of merit."""
        return self.usd_per_hour / SECONDS_PER_HOUR / self.flops_per_s


@dataclass(frozen=True)
class HeterogeneousAnalysis:
    """§3.3 quantities for two GPU types: attention on one, GEMMs on the other."""

    attention_gpu: str = field(metadata={"doc": "lowest USD per byte/s"})
    gemm_gpu: str = field(metadata={"doc": "lowest USD per FLOP/s"})
    dominated: bool = field(metadata={"doc": "one type is cheapest per byte and per FLOP"})
    feasible: BoolArray = field(repr=False, metadata={"doc": "every type has b_max >= 1"})
    cost_heterogeneous: FloatArray = field(repr=False)
    cost_homogeneous_best: FloatArray = field(repr=False)
    cost_colocated_best: FloatArray = field(repr=False)
    gain_heterogeneous: FloatArray = field(repr=False, metadata={"doc": "best homogeneous / het"})
    gain_heterogeneous_vs_colocated: FloatArray = field(repr=False)
    crossing_attention_bytes: float | None = field(
        metadata={"doc": "a* where the two homogeneous cost lines cross; None if dominated"}
    )
    crossing_context_tokens: float | None = field(
        metadata={"doc": "context where a(s) = a*, interpolated on the grid; None off the grid"}
    )
    crossing_in_range: bool = field(metadata={"doc": "a* lies in the feasible a(s) interval"})
    peak_gain: float | None = field(metadata={"doc": "G_het at a* (the maximum) when in range"})
    cad: CadFeasibility = field(repr=False)


@dataclass(frozen=True)
class Analysis:
    """Everything :func:`analyze` computes; arrays are read-only and aligned with ``contexts``."""

    model: str
    contexts: FloatArray = field(repr=False)
    weight_bytes: float
    gemm_flops_per_token: float
    state_bytes_per_request: FloatArray = field(repr=False, metadata={"doc": "m_kv(s)"})
    attention_bytes_per_request: FloatArray = field(repr=False, metadata={"doc": "a(s)"})
    gpus: tuple[GpuAnalysis, ...]
    heterogeneous: HeterogeneousAnalysis | None

    def gpu(self, gpu_id: str) -> GpuAnalysis:
        for g in self.gpus:
            if g.gpu == gpu_id:
                return g
        raise KeyError(f"{gpu_id!r} was not analysed; analysed: {[g.gpu for g in self.gpus]}")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: lists for arrays, ``None`` where a value is NaN (infeasible)."""
        doc = _jsonable(self)
        for g, out in zip(self.gpus, doc["gpus"], strict=True):
            out["usd_per_byte"] = g.usd_per_byte
            out["usd_per_flop"] = g.usd_per_flop
        return doc

    def summary(self) -> str:
        """A human-readable table per context (what ``opweave analyze`` prints)."""
        return _summary(self)


# -- model terms -----------------------------------------------------------------------------


def _layers_of(model: ModelSpec, kind: AttentionKind) -> list[LayerSpec]:
    return [layer for layer in model.layers if layer.attention is kind]


def _layer_terms(model: ModelSpec, kind: AttentionKind, s: FloatArray) -> tuple[FloatArray, float]:
    """Mean state traffic per request and mean rest-of-model weights of one layer of ``kind``."""
    layers = _layers_of(model, kind)
    traffic = np.zeros_like(s)
    rest_weights = 0.0
    for layer in layers:
        for op in layer.ops:
            if op.name == "core_attn":
                traffic = traffic + op.state_bytes_read(s)
            else:
                rest_weights += op.weight_bytes
    return traffic / len(layers), rest_weights / len(layers)


def _cad(
    model: ModelSpec,
    kind: AttentionKind,
    s: FloatArray,
    m_kv: FloatArray,
    *,
    attn: _Unit,
    gemm: _Unit,
    microbatches: int,
) -> CadFeasibility:
    a_layer, w_rest = _layer_terms(model, kind, s)
    # The attention group holds every layer's core-attention state and weights (sinks, convs).
    core_weights = sum(op.weight_bytes for op in model.operators if op.name == "core_attn")
    b_cap = np.floor(np.maximum(attn.memory - core_weights, 0.0) / m_kv)
    t_attn_max = b_cap / microbatches * a_layer / attn.bandwidth
    t_rest_min = w_rest / gemm.bandwidth
    return CadFeasibility(
        attention_kind=kind.value,
        attention_gpu=attn.gpu,
        attention_tp=attn.tp,
        gemm_gpu=gemm.gpu,
        gemm_tp=gemm.tp,
        microbatches=microbatches,
        b_cap=_frozen(b_cap),
        t_attn_max_s=_frozen(t_attn_max),
        t_rest_min_s=float(t_rest_min),
        feasible=_frozen((b_cap >= microbatches) & (t_attn_max >= t_rest_min), np.bool_),
    )


# -- units -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Unit:
    gpu: str
    tp: int
    memory: float
    bandwidth: float
    flops: float
    usd_per_s: float


def _unit(gpu: HardwareSpec, tp: int, model: ModelSpec) -> _Unit:
    return _Unit(
        gpu=gpu.id,
        tp=tp,
        memory=tp * gpu.usable_memory_bytes,
        bandwidth=tp * gpu.effective_bandwidth,
        flops=tp * gemm_flops_per_s(model, gpu),
        usd_per_s=tp * gpu.require_price() / SECONDS_PER_HOUR,
    )


KV_SHARE_DEFAULT = 0.5


def _choose_tp(gpu: HardwareSpec, weights: float, smallest_state: float, tp: int | None) -> int:
    if tp is not None:
        if tp not in TP_DEGREES:
            raise ConfigError(f"tp must be one of {', '.join(map(str, TP_DEGREES))}, got {tp}")
        if tp * gpu.usable_memory_bytes <= weights:
            raise InfeasibleError(
                f"{weights / 1e9:.1f} GB of weights do not fit {tp} x {gpu.id} "
                f"({tp * gpu.usable_memory_bytes / 1e9:.1f} GB usable); use a larger tp"
            )
        return tp
    # Deployment rule of thumb: leave at least half of the group's usable memory for KV and
    # state; a group packed to the brim with weights makes M/(M - W) explode.
    for degree in TP_DEGREES:
        if weights <= KV_SHARE_DEFAULT * degree * gpu.usable_memory_bytes:
            return degree
    for degree in TP_DEGREES:
        if degree * gpu.usable_memory_bytes - weights >= smallest_state:
            return degree
    largest = TP_DEGREES[-1]
    if largest * gpu.usable_memory_bytes > weights:
        return largest  # weights fit but no context does: every point is reported infeasible
    raise InfeasibleError(
        f"{weights / 1e9:.1f} GB of weights do not fit {largest} x {gpu.id} "
        f"({largest * gpu.usable_memory_bytes / 1e9:.1f} GB usable); choose a larger GPU"
    )


def _contexts(contexts: ArrayLike) -> FloatArray:
    s = np.atleast_1d(np.asarray(contexts, dtype=np.float64))
    if s.ndim != 1 or s.size == 0:
        raise ConfigError("contexts must be a non-empty 1-D list of token counts")
    if not np.all(np.isfinite(s)) or np.any(s < 1):
        raise ConfigError("every context length must be a finite token count >= 1")
    return s


def _tp_for(tp: int | Mapping[str, int] | None, gpu: HardwareSpec) -> int | None:
    if isinstance(tp, Mapping):
        return tp.get(gpu.id)
    return tp


# -- analysis --------------------------------------------------------------------------------


def _per_gpu(
    model: ModelSpec,
    unit: _Unit,
    s: FloatArray,
    m_kv: FloatArray,
    a: FloatArray,
    weights: float,
    f: float,
    kinds: Sequence[AttentionKind],
    microbatches: int,
) -> GpuAnalysis:
    mem, bw, fl, c = unit.memory, unit.bandwidth, unit.flops, unit.usd_per_s
    usd = c * TOKENS_PER_MILLION
    b_max = (mem - weights) / m_kv
    b_int = np.floor(b_max)
    feasible = b_max >= 1.0
    gemm_floor = f / fl
    with np.errstate(divide="ignore", invalid="ignore"):
        col = usd * (a / bw + np.maximum(weights / (bw * b_max), gemm_floor))
        col_int = usd * (a / bw + np.maximum(weights / (bw * b_int), gemm_floor))
    hom = usd * (a / bw + gemm_floor)
    nan = np.nan
    col = np.where(feasible, col, nan)
    col_int = np.where(feasible, col_int, nan)
    hom = np.where(feasible, hom, nan)
    cad_by_kind = {
        k.value: _cad(model, k, s, m_kv, attn=unit, gemm=unit, microbatches=microbatches)
        for k in kinds
    }
    return GpuAnalysis(
        gpu=unit.gpu,
        tp=unit.tp,
        memory_bytes=mem,
        bandwidth_bytes_per_s=bw,
        flops_per_s=fl,
        usd_per_hour=c * SECONDS_PER_HOUR,
        b_star=weights * fl / (bw * f),
        bound=mem / (mem - weights),
        feasible=_frozen(feasible, np.bool_),
        b_max=_frozen(b_max),
        b_max_int=_frozen(np.maximum(b_int, 0), np.int64),
        compute_bound=_frozen(b_max >= weights * fl / (bw * f), np.bool_),
        cost_colocated=_frozen(col),
        cost_colocated_int=_frozen(col_int),
        cost_homogeneous=_frozen(hom),
        gain_homogeneous=_frozen(col / hom),
        gain_homogeneous_int=_frozen(col_int / hom),
        cad=cad_by_kind[kinds[0].value],
        cad_by_kind=cad_by_kind,
    )


def _heterogeneous(
    model: ModelSpec,
    units: Sequence[_Unit],
    per_gpu: Sequence[GpuAnalysis],
    s: FloatArray,
    unit_state: Sequence[tuple[FloatArray, FloatArray]],
    f: float,
    kinds: Sequence[AttentionKind],
    microbatches: int,
) -> HeterogeneousAnalysis:
    per_byte = np.array([g.usd_per_byte for g in per_gpu]) * TOKENS_PER_MILLION
    per_token = np.array([g.usd_per_flop for g in per_gpu]) * f * TOKENS_PER_MILLION
    # Ties go to the type that is also cheaper on the other axis, so a type that weakly
    # dominates both gets both operator classes.
    ia = int(np.lexsort((per_token, per_byte))[0])
    ig = int(np.lexsort((per_byte, per_token))[0])
    m_kv, a = unit_state[ia]  # the state as the attention unit holds it
    feasible = np.logical_and.reduce([g.feasible for g in per_gpu])
    het = np.where(feasible, per_byte[ia] * a + per_token[ig], np.nan)
    hom_best = np.min([g.cost_homogeneous for g in per_gpu], axis=0)
    col_best = np.min([g.cost_colocated for g in per_gpu], axis=0)
    hom_best = np.where(feasible, hom_best, np.nan)
    col_best = np.where(feasible, col_best, np.nan)
    dominated = ia == ig
    crossing = context = peak = None
    in_range = False
    if not dominated:
        # Homogeneous lines p_x a + q_x cross at a* = (q_A - q_G) / (p_G - p_A) > 0 (Thm 3.2).
        crossing = float((per_token[ia] - per_token[ig]) / (per_byte[ig] - per_byte[ia]))
        traffic = a[feasible]
        if traffic.size:
            in_range = bool(traffic.min() <= crossing <= traffic.max())
        if in_range:
            hom_at = per_byte[ia] * crossing + per_token[ia]
            peak = float(hom_at / (per_byte[ia] * crossing + per_token[ig]))
            order = np.argsort(s[feasible], kind="stable")
            context = float(np.interp(crossing, traffic[order], s[feasible][order]))
    attn_unit, gemm_unit = units[ia], units[ig]
    primary = kinds[0]
    return HeterogeneousAnalysis(
        attention_gpu=attn_unit.gpu,
        gemm_gpu=gemm_unit.gpu,
        dominated=dominated,
        feasible=_frozen(feasible, np.bool_),
        cost_heterogeneous=_frozen(het),
        cost_homogeneous_best=_frozen(hom_best),
        cost_colocated_best=_frozen(col_best),
        gain_heterogeneous=_frozen(hom_best / het),
        gain_heterogeneous_vs_colocated=_frozen(col_best / het),
        crossing_attention_bytes=crossing,
        crossing_context_tokens=context,
        crossing_in_range=in_range,
        peak_gain=peak,
        cad=_cad(
            model, primary, s, m_kv, attn=attn_unit, gemm=gemm_unit, microbatches=microbatches
        ),
    )


def _unit_state(model: ModelSpec, s: FloatArray, tp: int) -> tuple[FloatArray, FloatArray]:
    """``(m_kv, a)`` of one request on a unit of ``tp`` GPUs: state every rank holds whole
    (MLA's latent cache, ``state_tp_replicated``) is held and read ``tp`` times."""
    m_kv = model.state_bytes_per_request(s)
    a = model.attention_bytes_per_request(s)
    for op in model.attention_ops:
        if op.state_tp_replicated and tp > 1:
            m_kv = m_kv + (tp - 1) * op.state_bytes(s)
            a = a + (tp - 1) * op.state_bytes_read(s)
    return m_kv, a


def _kinds(model: ModelSpec) -> list[AttentionKind]:
    """Attention kinds present, full attention first (A.6's uniform-layer condition)."""
    present = {layer.attention for layer in model.layers}
    return [
        k for k in (AttentionKind.FULL, AttentionKind.SLIDING, AttentionKind.LINEAR) if k in present
    ]


def analyze(
    model: ModelSpec,
    gpus: Sequence[HardwareSpec],
    contexts: ArrayLike,
    *,
    tp: int | Mapping[str, int] | None = None,
    microbatches: int = CAD_MICROBATCHES,
) -> Analysis:
    """The paper's §3 quantities for ``model`` on one or two GPU types, over ``contexts``.

    ``tp`` fixes the unit's tensor-parallel degree (one int for all GPUs, or per GPU id);
    by default each GPU gets the smallest of 1, 2, 4, 8 whose weights take at most half of the
    group's usable memory (else the smallest that holds one request at the smallest context).
    Costs are USD per million tokens, NaN where colocation cannot hold one request
    (``feasible`` False). CAD feasibility is reported per
    attention kind (``cad_by_kind``); ``cad`` is the full-attention layers' (A.6).

    Raises :class:`InfeasibleError` if the weights fit no unit of at most 8 GPUs, and
    :class:`ConfigError` for bad contexts, tp, GPU lists or a GPU without a price.

    >>> from opweave.costmodel import load_model, default_catalog
    >>> from opweave.costmodel import analyze
    >>> cat = default_catalog()
    >>> res = analyze(load_model("llama-3.3-70b"), [cat.get("h100"), cat.get("a100")],
    ...               [4096, 32768, 1 << 20], tp=4)
    >>> h100 = res.gpu("h100-sxm")
    >>> h100.feasible.tolist(), bool(h100.gain_homogeneous[1] > 1.0)
    ([True, True, False], True)
    >>> round(h100.bound, 3), round(h100.b_star)
    (1.846, 269)
    >>> res.heterogeneous.attention_gpu, res.heterogeneous.gemm_gpu
    ('a100-sxm-80gb', 'h100-sxm')
    """
    s = _contexts(contexts)
    gpus = list(gpus)
    if not 1 <= len(gpus) <= 2:
        raise ConfigError(f"analyze takes one or two GPU types, got {len(gpus)}")
    if len({g.id for g in gpus}) != len(gpus):
        raise ConfigError("give two different GPU types for a heterogeneous analysis")
    if microbatches < 1:
        raise ConfigError(f"microbatches must be at least 1, got {microbatches}")
    weights = float(model.weight_bytes)
    f = model.gemm_flops_per_token
    m_kv = model.state_bytes_per_request(s)
    a = model.attention_bytes_per_request(s)
    smallest_state = float(m_kv.min())
    for g in gpus:
        check_runs(model.precision, g)
    units = [_unit(g, _choose_tp(g, weights, smallest_state, _tp_for(tp, g)), model) for g in gpus]
    kinds = _kinds(model)
    unit_state = [_unit_state(model, s, u.tp) for u in units]
    per_gpu = [
        _per_gpu(model, u, s, m_u, a_u, weights, f, kinds, microbatches)
        for u, (m_u, a_u) in zip(units, unit_state, strict=True)
    ]
    het = (
        _heterogeneous(model, units, per_gpu, s, unit_state, f, kinds, microbatches)
        if len(units) == 2
        else None
    )
    return Analysis(
        model=model.name,
        contexts=_frozen(s),
        weight_bytes=weights,
        gemm_flops_per_token=f,
        state_bytes_per_request=_frozen(m_kv),
        attention_bytes_per_request=_frozen(a),
        gpus=tuple(per_gpu),
        heterogeneous=het,
    )


# -- text summary ----------------------------------------------------------------------------


def _fmt(x: float, spec: str = ".3g") -> str:
    return "-" if not math.isfinite(x) else format(x, spec)


def _summary(res: Analysis) -> str:
    lines = [
        f"{res.model}: weights {res.weight_bytes / 1e9:.1f} GB, "
        f"{res.gemm_flops_per_token / 1e9:.1f} GFLOP/token outside attention; "
        "costs in USD per million tokens"
    ]
    for g in res.gpus:
        lines.append(
            f"{g.gpu} x{g.tp}: b* = {g.b_star:.0f}, bound M/(M-W) = {g.bound:.3f}, "
            f"CAD balances at {int(g.cad.feasible.sum())} of {g.cad.feasible.size} "
            f"contexts ({g.cad.attention_kind}-attention layers)"
        )
    het = res.heterogeneous
    if het is not None:
        lines.append(
            f"heterogeneous: attention on {het.attention_gpu}, GEMMs on {het.gemm_gpu}"
            + (
                ""
                if het.peak_gain is None
                else f"; peak gain {het.peak_gain:.3f} near context "
                f"{het.crossing_context_tokens:.0f}"
            )
        )
    header = ["context"]
    for g in res.gpus:
        header += [f"{g.gpu} b_max", "colocated", "ODS", "G_hom"]
    if het is not None:
        header += ["het ODS", "G_het", "G_het/col"]
    rows = []
    for i, s in enumerate(res.contexts):
        row = [f"{s:.0f}"]
        for g in res.gpus:
            row += [
                _fmt(g.b_max[i], ".1f"),
                _fmt(g.cost_colocated[i]),
                _fmt(g.cost_homogeneous[i]),
                _fmt(g.gain_homogeneous[i], ".3f"),
            ]
        if het is not None:
            row += [
                _fmt(het.cost_heterogeneous[i]),
                _fmt(het.gain_heterogeneous[i], ".3f"),
                _fmt(het.gain_heterogeneous_vs_colocated[i], ".3f"),
            ]
        rows.append(row)
    widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)
