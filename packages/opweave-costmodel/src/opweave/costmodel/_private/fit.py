"""Roofline <-> profile: fit efficiency factors to measurements, or synthesise a profile.

A measured profile covers one model on one device; the roofline covers any model but needs three
numbers datasheets do not give: the achieved fraction of peak memory bandwidth and of peak FLOPs,
and a fixed cost per kernel launch. Fitting those to a profile carries what was measured over to
models and batch sizes that were not; synthesising a profile from the roofline lets the planner
treat profiled and unprofiled devices through the same :class:`ProfiledLatency` interface. The
other fixed costs of ``fixed_costs.py`` (the MoE experts' and the per-step cost) are not fitted:
the fit takes them from the profile's device, as the roofline adds them (the per-step cost only
to a synthesised profile's ``sample``: a measured one times the sampling kernel alone).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version

import numpy as np
from pydantic import Field

from ..errors import ConfigError
from .base import Frozen
from .fixed_costs import expert_fixed_s, launches, side_stream_overlaps, step_overhead_s
from .hardware import HardwareSpec
from .kernel_rates import grouped_gemm_fraction
from .model import LayerSpec, ModelSpec, OperatorSpec
from .profile import OpLatencyTable, Profile, Provenance, TransferProfile, profile_key
from .quantize import expert_channels
from .roofline import RooflineLatency, op_bytes_and_flops, shard_fraction

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# Search box of the fit, in decades: efficiencies in [1e-6, 1], launch overhead in [1 ns, 0.1 s].
_EFF_DECADES = (-6.0, 0.0)
_OVERHEAD_DECADES = (-9.0, -1.0)
# Huber threshold on |log error|: quadratic up to a factor of 2, linear beyond, so a few cells
# disturbed by another process (or an operator the roofline cannot describe) do not drag the fit.
_HUBER = float(np.log(2.0))


class EfficiencyFit(Frozen):
    """Fitted efficiency factors and how well the fitted roofline reproduces the profile.

    Error factors are ``exp(|log(predicted / measured)|)`` over every measured grid point:
    1.0 is a perfect fit, 2.0 means off by a factor of two in either direction.
    """

    hardware: HardwareSpec = Field(description="The profile's device with the fitted factors.")
    points: int = Field(description="Measured (op, tp, batch, context) points fitted.")
    rms_log_error: float
    median_error_factor: float
    p90_error_factor: float
    max_error_factor: float
    worst_op: str = Field(description="profile_key of the op with the largest error.")


def profile_operators(model: ModelSpec) -> tuple[tuple[str, OperatorSpec, LayerSpec | None], ...]:
    """Each distinct operator of ``model`` once, as ``(profile_key, op, layer)``, in order.

    Layers of the same attention kind share a key (their operators have the same shapes), so
    this is the set of tables a complete profile holds per TP degree.
    """
    seen: dict[str, tuple[str, OperatorSpec, LayerSpec | None]] = {}
    entries: Iterable[tuple[OperatorSpec, LayerSpec | None]] = (
        *((op, None) for op in model.pre_ops),
        *((op, layer) for layer in model.layers for op in layer.ops),
        *((op, None) for op in model.post_ops),
    )
    for op, layer in entries:
        key = profile_key(op, layer)
        seen.setdefault(key, (key, op, layer))
    return tuple(seen.values())


def _depends_on_context(op: OperatorSpec) -> bool:
    return op.attn_flops_per_context_token > 0 or op.state_bytes_per_context_token > 0


def _points(profile: Profile, model: ModelSpec) -> tuple[np.ndarray, ...]:
    """Per measured point: bytes, FLOPs, kernel launches, the fixed seconds that are not fitted,
    measured seconds, table index."""
    ops = {key: op for key, op, _ in profile_operators(model)}
    hw = profile.device
    # a measured profile times the sampling kernel alone; a synthesised one holds the step cost
    with_step = profile.provenance.source != "measured"
    # a measured or imported profile timed each operator alone, a shared expert's launches
    # included; a synthesised one holds the roofline's time for the step
    alone = profile.provenance.source != "roofline"
    rows: list[tuple[float, float, float, float, float, int]] = []
    for index, table in enumerate(profile.ops):
        op = ops.get(table.op)
        if op is None:
            raise ConfigError(
                f"profile has latencies for {table.op!r}, which model {model.name} lacks; "
                "fit a profile against the model it was measured on"
            )
        for b, row in zip(table.batches, table.latency_s, strict=True):
            for s, t in zip(table.contexts, row, strict=True):
                num_bytes, flops = op_bytes_and_flops(op, table.tp, b, s)
                # routed experts' FLOPs in dense-GEMM terms (their fused-MoE kernels' fraction)
                flops /= grouped_gemm_fraction(
                    op, hw, expert_channels(op, shard_fraction(op, table.tp))
                )
                fixed = expert_fixed_s(op, b, hw) + (step_overhead_s(op, b, hw) if with_step else 0)
                overlapped = not alone and side_stream_overlaps(op, hw, b)
                kernels = float(launches(op, overlapped=overlapped))
                rows.append((num_bytes, flops, kernels, fixed, t, index))
    if not rows:
        raise ConfigError("profile has no operator latencies to fit")
    return tuple(np.asarray(col, dtype=np.float64) for col in zip(*rows, strict=True))


def _huber(r: np.ndarray) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= _HUBER, 0.5 * r * r, _HUBER * (a - 0.5 * _HUBER))


def _objective(theta: np.ndarray, data: tuple[np.ndarray, ...], bw: float, fl: float) -> float:
    """Mean Huber loss of the log error with ``theta`` = log10(eta_mem, eta_flop, t_kernel)."""
    num_bytes, flops, kernels, fixed, measured, _ = data
    eta_m, eta_c, launch = 10.0**theta
    pred = np.maximum(num_bytes / (bw * eta_m), flops / (fl * eta_c)) + kernels * launch + fixed
    return float(np.mean(_huber(np.log(pred) - np.log(measured))))


def _search(data: tuple[np.ndarray, ...], bw: float, fl: float) -> np.ndarray:
    """Global grid search, then a shrinking pattern search (the max() makes it non-smooth)."""
    num_bytes, flops, kernels, fixed, measured, _ = data
    log_t = np.log(measured)
    effs = np.linspace(*_EFF_DECADES, 37)
    launches = np.linspace(*_OVERHEAD_DECADES, 49)
    mem = num_bytes[None, :] / (bw * 10.0 ** effs[:, None])  # [eff, point]
    comp = flops[None, :] / (fl * 10.0 ** effs[:, None])
    roof = np.maximum(mem[:, None, :], comp[None, :, :])  # [eta_m, eta_c, point]
    best, best_err = np.zeros(3), np.inf
    for launch in launches:
        err = np.mean(_huber(np.log(roof + kernels * 10.0**launch + fixed) - log_t), axis=-1)
        i, j = np.unravel_index(np.argmin(err), err.shape)
        if err[i, j] < best_err:
            best_err, best = float(err[i, j]), np.array([effs[i], effs[j], launch])
    lo = np.array([_EFF_DECADES[0], _EFF_DECADES[0], _OVERHEAD_DECADES[0]])
    hi = np.array([_EFF_DECADES[1], _EFF_DECADES[1], _OVERHEAD_DECADES[1]])
    step = 0.25
    while step > 1e-4:
        improved = False
        for axis in range(3):
            for sign in (-1.0, 1.0):
                trial = best.copy()
                trial[axis] = np.clip(trial[axis] + sign * step, lo[axis], hi[axis])
                err = _objective(trial, data, bw, fl)
                if err < best_err - 1e-15:
                    best, best_err, improved = trial, err, True
        if not improved:
            step /= 2
    return best


def fit_efficiency_report(profile: Profile, model: ModelSpec) -> EfficiencyFit:
    """Fit memory/compute efficiency and per-kernel overhead of ``profile.device`` to its tables.

    A robust (Huber) fit of ``log(predicted) - log(measured)`` over every measured point, so
    small and large operators weigh alike and a few outliers do not dominate; the operators'
    bytes and FLOPs come from ``model``.
    """
    data = _points(profile, model)
    hw = profile.device
    bw, fl = hw.mem_bandwidth_bytes_per_s, hw.dense_flops_per_s
    theta = _search(data, bw, fl)
    eta_m, eta_c, launch = (float(v) for v in 10.0**theta)
    fitted = hw.model_copy(
        update={
            "memory_efficiency": min(eta_m, 1.0),
            "compute_efficiency": min(eta_c, 1.0),
            "kernel_overhead_s": launch,
        }
    )
    num_bytes, flops, kernels, fixed, measured, table = data
    pred = np.maximum(num_bytes / fitted.effective_bandwidth, flops / fitted.effective_flops)
    err = np.abs(np.log((pred + kernels * launch + fixed) / measured))
    worst = profile.ops[int(table[int(np.argmax(err))])].op
    return EfficiencyFit(
        hardware=HardwareSpec.model_validate(fitted.model_dump()),
        points=int(err.size),
        rms_log_error=float(np.sqrt(np.mean(err**2))),
        median_error_factor=float(np.exp(np.median(err))),
        p90_error_factor=float(np.exp(np.percentile(err, 90))),
        max_error_factor=float(np.exp(err.max())),
        worst_op=worst,
    )


def fit_efficiency(profile: Profile, model: ModelSpec) -> HardwareSpec:
    """The profile's device with ``memory_efficiency``, ``compute_efficiency`` and
    ``kernel_overhead_s`` fitted to the measurements (see :func:`fit_efficiency_report`).

    >>> from opweave.costmodel import default_catalog, fit_efficiency, load_model
    >>> from opweave.costmodel import synthesize_profile
    >>> model, h100 = load_model("qwen3-32b"), default_catalog().get("h100")
    >>> profile = synthesize_profile(model, h100, batches=(1, 8, 512), contexts=(1024, 8192))
    >>> hw = fit_efficiency(profile, model)
    >>> round(hw.memory_efficiency, 2), round(hw.compute_efficiency, 2)
    (0.89, 0.8)
    """
    return fit_efficiency_report(profile, model).hardware


def _version() -> str:
    try:
        return version("opweave-costmodel")
    except PackageNotFoundError:  # running from a source tree
        return "unknown"


def synthesize_profile(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    tp_degrees: Sequence[int] = (1,),
    batches: Sequence[int] = DEFAULT_BATCHES,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
) -> Profile:
    """A profile whose tables are the roofline of ``hardware`` (provenance ``roofline``).

    Context-independent operators get a single context column, as measured profiles do.
    """
    batches, contexts = sorted(set(batches)), sorted(set(contexts))
    if not batches or not contexts or not tp_degrees:
        raise ConfigError("synthesize_profile needs at least one batch, context and TP degree")
    roof = RooflineLatency(hardware)
    tables = []
    for tp in sorted(set(tp_degrees)):
        for key, op, layer in profile_operators(model):
            cols = contexts if _depends_on_context(op) else contexts[:1]
            latency = tuple(
                tuple(max(roof.op_latency_s(model, op, layer, tp, b, s), 1e-12) for s in cols)
                for b in batches
            )
            tables.append(
                OpLatencyTable(
                    op=key, tp=tp, batches=tuple(batches), contexts=tuple(cols), latency_s=latency
                )
            )
    transfers = []
    for link in ("intra_node", "network"):
        latency_s = roof.transfer_s(link, 0.0)
        transfers.append(
            TransferProfile(
                link=link,
                latency_s=latency_s,
                bandwidth_bytes_per_s=1e9 / (roof.transfer_s(link, 1e9) - latency_s),
            )
        )
    return Profile(
        device=hardware,
        model=model.name,
        config_sha256=model.config_sha256,
        dtype=model.dtype,
        ops=tuple(tables),
        transfers=tuple(transfers),
        provenance=Provenance(
            source="roofline",
            device_name=hardware.name,
            versions={"opweave-costmodel": _version()},
            settings={
                "batches": list(batches),
                "contexts": list(contexts),
                "tp_degrees": sorted(set(tp_degrees)),
            },
            note="synthesised from datasheet peaks and efficiency factors; not measured",
        ),
    )
