"""Cost-model accuracy: ``opweave estimate`` against published decode-step measurements.

The reference is ``costmodel_accuracy_data.toml`` beside this file: decode-step or TPOT figures
that public sources printed (model, GPU, TP, batch, context, measured ms, source per row; see its
header for the scope). For each row the colocated decode step of the cost model
(:func:`opweave.costmodel.estimate_step`) is compared with the measurement; the signed error is
``(estimate - measured) / measured``. Printed: every row, then the median and maximum absolute
error and the mean signed error overall and per group (batch 1, batch > 1, MoE, dense, TP > 1,
per GPU, per engine), and the rows outside the scope apart.

Rows whose figure includes a prefill (``prefill_tokens``: Qwen's speed benchmark divides the
generated tokens by the whole ``generate()`` time) get the prefill added to the estimate, spread
over ``decode_tokens``: a compute roofline, the prefill's FLOPs (causal attention over half the
prompt on average) at the GPU's effective FLOP/s for the model's weight formats, or its weight
reads if longer.

A row's precision: ``dtype`` (the model's dtype), ``quant`` (the weight format, as ``--quant``
names it: fp8, fp8-block, nvfp4, mxfp4, int4-wo; a ``[models]`` config may instead carry the
checkpoint's ``quantization_config``) and ``kv_cache_dtype`` (``auto`` or ``fp8``). The per-row
``prefill %`` column shows how much of the estimate that is.

Each row names the host profile of the engine that measured it (``host``: a key of
``HOST_PROFILES`` in ``opweave/costmodel/_private/host.py``, default ``overlapped``): the per-step
host time of that engine and version, measured apart from the rows compared here. ``--host NAME``
charges one profile to every row instead, to show what the term does; ``--fixed-costs off``
zeroes every fixed-cost term of ``fixed_costs.py`` (per kernel launch, per TP collective, per MoE
expert pass, per step, host profiles included) to show the plain roofline's figures.

``--profile P [--model M] [--gpu G]`` instead compares a measured profile's operator latencies
with the cost model's for the same operators, batch and context points (``--gpu`` takes the
hardware from the catalog rather than the profile's device record). For a measured profile the
per-step overhead is left out of that comparison: the profiler times the ``sample`` kernel, not
the step around it.

Prints figures; asserts nothing. Goal: median <= 6%, max <= 20% over the in-scope rows.

``--set production`` (run after the reference by default) compares the cost model with
``production_decode_data.toml``: measured production deployments in FP8/FP4, with multi-head latent
attention and with expert parallelism and data-parallel attention (engine, GPU, batch, context and
source per row; see its header). A row's deployment maps onto an owner's parallelism as the engines
lay it out: ``tp`` GPUs per instance; with ``dp > 1`` each of the ``dp`` attention ranks holds
``tp/dp`` GPUs and ``batch`` requests, the experts sharded over ``ep``; ``dense_dp = true`` holds
the dense FFN layers whole on every GPU (the engine's layout where the row's source shows it)
instead of tensor-parallel over the group. A checkpoint that is not a built-in (or a built-in in
another format, e.g. NVIDIA's NVFP4 DeepSeek) is read from ``configs/`` beside this file (byte
copies of the published ``config.json`` / ``hf_quant_config.json``; ``[checkpoints]`` in the data
file maps them). A row the cost model cannot describe (a model with no config here, a GPU outside
the catalog, a layout outside its parallelism) is listed with the reason and counted in the
coverage line. Errors are printed per group (fp8, fp4, mla, ep), apart for P/D decode pools (decode
steps only) and aggregated engines, whose TPOT also holds the prefill chunks an engine mixes into
its decode steps: a decode-step estimate leaves those out, so its error there is expected to be
negative. Same goal per group: median <= 6%, max <= 20%.

    python tools/bench/costmodel_accuracy.py
    python tools/bench/costmodel_accuracy.py --set production
    python tools/bench/costmodel_accuracy.py --fixed-costs off
    python tools/bench/costmodel_accuracy.py --host overlapped
    python tools/bench/costmodel_accuracy.py --profile h100-profile.json --model qwen3-32b

``--profiles aiconfigurator`` (needs the profiler's ``aiconfigurator`` extra) compares the
reference rows three ways: the roofline as above, a profile imported from NVIDIA's silicon
database for the row's GPU, engine (vllm, sglang or trtllm by the row's engine name), model,
precision, TP, batch and context (its ``sample`` operator carries the row's host profile, as
the roofline's does), and their difference. Rows on GPUs the database has no system for, or
of engines it has no tables of (gpt-fast; NIM, whose backend its page does not name), are
left out and counted. With ``--set production`` (or ``all``) it does the same for the production
decode rows a tensor-parallel profile describes (rows with expert or attention-data parallelism,
on GPUs the database has no system for, or of engines it has no tables of are counted apart,
with the reason).

    python tools/bench/costmodel_accuracy.py --profiles aiconfigurator [--set production]

``--other aiconfigurator`` (same extra) prints another published estimator beside OpWeave on
the production P/D decode rows and the serving rows: NVIDIA AIConfigurator's own estimates
(``aic_estimator.py`` beside this file says how each row is described to it), per row and
the median errors of both per group, over the rows both describe.

    python tools/bench/costmodel_accuracy.py --other aiconfigurator [--set production|serving]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from opweave.costmodel import (
    BUILTIN_MODELS,
    HOST_PROFILES,
    HardwareSpec,
    LatencyModel,
    ModelSpec,
    RooflineLatency,
    default_catalog,
    estimate_step,
    gemm_flops_per_s,
    host_profile,
    load_model,
    model_spec_from_config,
    profile_operators,
    weight_bytes_per_rank,
    without_fixed_costs,
)
from opweave.costmodel._private.roofline import op_bytes_and_flops
from opweave.costmodel.errors import ConfigError, OpWeaveError
from opweave.profiler import load_profile


def _serving_set() -> ModuleType:
    """``serving_accuracy.py`` beside this file (a script's sibling, not a package)."""
    path = Path(__file__).with_name("serving_accuracy.py")
    spec = importlib.util.spec_from_file_location("serving_accuracy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("serving_accuracy", module)
    spec.loader.exec_module(module)
    return module


DATA = Path(__file__).with_name("costmodel_accuracy_data.toml")
PRODUCTION = Path(__file__).with_name("production_decode_data.toml")
CONFIGS = Path(__file__).with_name("configs")
GROUPS = ("fp8", "fp4", "mla", "ep")
GOAL_MEDIAN, GOAL_MAX = 0.06, 0.20


@dataclass(frozen=True)
class Row:
    model: str
    gpu: str
    tp: int
    batch: int
    context: int
    measured_ms: float
    dtype: str | None
    quant: str | None
    kv_cache_dtype: str
    engine: str
    host: str
    source: str
    prefill_tokens: int
    decode_tokens: int
    in_scope: bool
    scope_note: str


@dataclass(frozen=True)
class Result:
    row: Row
    moe: bool
    estimate_ms: float
    prefill_ms: float
    host: str  # the host profile the estimate charged ("-": the hardware's own per-step cost)

    @property
    def error(self) -> float:
        return (self.estimate_ms - self.row.measured_ms) / self.row.measured_ms


def load_reference(path: Path = DATA) -> tuple[dict[str, dict[str, Any]], list[Row]]:
    data = tomllib.loads(path.read_text())
    rows = [
        Row(
            model=r["model"],
            gpu=r["gpu"],
            tp=int(r["tp"]),
            batch=int(r["batch"]),
            context=int(r["context"]),
            measured_ms=float(r["measured_ms"]),
            dtype=r.get("dtype"),
            quant=r.get("quant"),
            kv_cache_dtype=r.get("kv_cache_dtype", "auto"),
            engine=r["engine"],
            host=r.get("host", "overlapped"),
            source=r["source"],
            prefill_tokens=int(r.get("prefill_tokens", 0)),
            decode_tokens=int(r.get("decode_tokens", 1)),
            in_scope=bool(r.get("in_scope", True)),
            scope_note=r.get("scope_note", ""),
        )
        for r in data["rows"]
    ]
    return data.get("models", {}), rows


def model_for(row: Row, configs: dict[str, dict[str, Any]]) -> ModelSpec:
    """The row's model in its precision: ``dtype`` (the model's dtype, legacy ``float8_e4m3fn``
    rows: every tensor in FP8), ``quant`` (the weight format, ``--quant``'s names; a [models]
    config may carry its checkpoint's ``quantization_config`` instead), ``kv_cache_dtype``."""
    precision = {"dtype": row.dtype, "quant": row.quant, "kv_cache_dtype": row.kv_cache_dtype}
    if row.model in BUILTIN_MODELS:
        return load_model(row.model, **precision)
    return model_spec_from_config(configs[row.model]["config"], name=row.model, **precision)


def prefill_s(model: ModelSpec, hw: HardwareSpec, tp: int, tokens: int) -> float:
    """Compute roofline of a prefill of ``tokens``: FLOPs (attention over ``tokens / 2`` context
    positions on average, as causal attention attends) or the weight reads, whichever is longer."""
    if tokens <= 1:
        return 0.0
    flops = sum(op_bytes_and_flops(op, tp, tokens, tokens / 2)[1] for op in model.operators)
    weights = weight_bytes_per_rank(model.operators, tp)
    return max(flops / gemm_flops_per_s(model, hw), weights / hw.effective_bandwidth)


def evaluate(
    rows: Sequence[Row],
    configs: dict[str, dict[str, Any]],
    hardware: Callable[[str], HardwareSpec],
    host: str | None = "row",
) -> list[Result]:
    """Estimates for ``rows``: each with its own host profile (``host="row"``), one profile for
    all (a name), or the hardware's per-step cost as given (``None``)."""
    results = []
    for row in rows:
        model = model_for(row, configs)
        hw = hardware(row.gpu)
        applied = None if host is None else row.host if host == "row" else host
        profile = None if applied is None else host_profile(applied)
        est = estimate_step(
            model, hw, tp=row.tp, batch=row.batch, context=row.context, host=profile
        )
        pre = prefill_s(model, hw, row.tp, row.prefill_tokens) / row.decode_tokens
        moe = any(op.moe is not None for op in model.operators)
        results.append(
            Result(row, moe, (est.step_latency_s + pre) * 1e3, pre * 1e3, applied or "-")
        )
    return results


def summary(results: Sequence[Result | ProductionResult]) -> str:
    errs = [r.error for r in results]
    if not errs:
        return "n=0"
    absolute = [abs(e) for e in errs]
    return (
        f"n={len(errs):<3} median |err| {100 * statistics.median(absolute):5.1f}%   "
        f"max |err| {100 * max(absolute):5.1f}%   mean signed {100 * statistics.mean(errs):+6.1f}%"
    )


def print_rows(results: Sequence[Result]) -> None:
    head = (
        f"{'model':<15}{'gpu':<8}{'tp':>3}{'batch':>6}{'context':>8}{'meas ms':>9}"
        f"{'est ms':>9}{'err':>8}{'prefill':>9}  {'host':<12}engine"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        row = r.row
        pre = f"{100 * r.prefill_ms / r.estimate_ms:6.1f}%" if r.prefill_ms else "-"
        print(
            f"{row.model:<15}{row.gpu:<8}{row.tp:>3}{row.batch:>6}{row.context:>8}"
            f"{row.measured_ms:>9.2f}{r.estimate_ms:>9.2f}{100 * r.error:>+7.1f}%{pre:>9}  "
            f"{r.host:<12}{row.engine}"
        )


def print_groups(results: Sequence[Result]) -> None:
    groups: list[tuple[str, Callable[[Result], bool]]] = [
        ("all in scope", lambda r: True),
        ("batch 1", lambda r: r.row.batch == 1),
        ("batch > 1", lambda r: r.row.batch > 1),
        ("MoE", lambda r: r.moe),
        ("dense", lambda r: not r.moe),
        ("TP > 1", lambda r: r.row.tp > 1),
        ("TP 1", lambda r: r.row.tp == 1),
    ]
    for gpu in sorted({r.row.gpu for r in results}):
        groups.append((f"GPU {gpu}", lambda r, g=gpu: r.row.gpu == g))
    for host in sorted({r.host for r in results}):
        groups.append((f"host {host}", lambda r, h=host: r.host == h))
    for engine in sorted({r.row.engine for r in results}):
        groups.append((f"engine {engine}", lambda r, e=engine: r.row.engine == e))
    for name, keep in groups:
        print(f"{name:<26}{summary([r for r in results if keep(r)])}")


def run_reference(fixed_costs: bool, host: str) -> None:
    configs, rows = load_reference()
    catalog = default_catalog()

    def hardware(gpu: str) -> HardwareSpec:
        return catalog.get(gpu) if fixed_costs else without_fixed_costs(catalog.get(gpu))

    results = evaluate(rows, configs, hardware, host if fixed_costs else None)
    inside = [r for r in results if r.row.in_scope]
    outside = [r for r in results if not r.row.in_scope]
    label = (
        "plain roofline (fixed costs off)"
        if not fixed_costs
        else "with fixed costs, each row's host profile"
        if host == "row"
        else f"with fixed costs, host profile {host} for every row"
    )
    gpus = sorted({r.row.gpu for r in inside})
    moe = sum(r.moe for r in inside)
    print(
        f"Cost model vs published decode steps, {label}: {len(inside)} rows in scope over "
        f"{len(gpus)} GPU types ({', '.join(gpus)}), {moe} MoE and {len(inside) - moe} dense"
    )
    print_rows(inside)
    print(f"\nErrors, signed = (estimate - measured) / measured ({label})")
    print_groups(inside)
    errs = [abs(r.error) for r in inside]
    if errs:
        met = statistics.median(errs) <= GOAL_MEDIAN and max(errs) <= GOAL_MAX
        print(
            f"goal median <= {100 * GOAL_MEDIAN:.0f}% and max <= {100 * GOAL_MAX:.0f}%: "
            f"{'met' if met else 'not met'}"
        )
    if outside:
        print("\nOut of scope (not in the statistics):")
        print_rows(outside)
        print(f"{'out of scope':<26}{summary(outside)}")
        for note in sorted({r.row.scope_note for r in outside}):
            print(f"  why: {note}")
    print("\nSources:")
    for source in sorted({r.row.source.split(",")[0] for r in results}):
        print(f"  {source}")


# -- production deployments (production_decode_data.toml) --------------------------------------
@dataclass(frozen=True)
class ProductionRow:
    model: str
    gpu: str
    tp: int
    ep: int
    dp: int
    dense_dp: bool
    batch: float
    context: int
    measured_ms: float
    quant: str
    kv_cache_dtype: str
    engine: str
    deployment: str
    groups: tuple[str, ...]
    prefill_tokens: int
    decode_tokens: int
    in_scope: bool
    scope_note: str
    decode_max_batch: float | None = None  # P/D: the decode workers' cap per rank (recipe)

    @property
    def decoding(self) -> float:
        """Requests per rank in the decode batch: the concurrency's share, at most the cap."""
        cap = self.decode_max_batch
        return self.batch if cap is None else min(self.batch, cap)


@dataclass(frozen=True)
class ProductionResult:
    row: ProductionRow
    estimate_ms: float | None  # None: the cost model cannot describe the row
    why: str = ""

    @property
    def error(self) -> float:
        assert self.estimate_ms is not None
        return (self.estimate_ms - self.row.measured_ms) / self.row.measured_ms


def load_production(path: Path = PRODUCTION) -> tuple[dict[str, Any], list[ProductionRow]]:
    data = tomllib.loads(path.read_text())
    rows = [
        ProductionRow(
            model=r["model"],
            gpu=r["gpu"],
            tp=int(r["tp"]),
            ep=int(r["ep"]),
            dp=int(r["dp"]),
            dense_dp=bool(r.get("dense_dp", False)),
            batch=float(r["batch"]),
            context=int(r["context"]),
            measured_ms=float(r["measured_ms"]),
            quant=r["quant"],
            kv_cache_dtype=r.get("kv_cache_dtype", "auto"),
            engine=r["engine"],
            deployment=r["deployment"],
            groups=tuple(r["group"]),
            prefill_tokens=int(r.get("prefill_tokens", 0)),
            decode_tokens=int(r.get("decode_tokens", 1)),
            in_scope=bool(r.get("in_scope", True)),
            scope_note=r.get("scope_note", ""),
            decode_max_batch=r.get("decode_max_batch"),
        )
        for r in data["rows"]
    ]
    return data, rows


def production_model(row: ProductionRow, data: dict[str, Any]) -> ModelSpec:
    """The row's checkpoint: a file of ``configs/`` where ``[checkpoints]`` maps the model and
    format to one, a ``[models]`` config, else the built-in in the row's format (``--quant``
    for an unquantised built-in; a built-in already in that format as it is)."""
    kv = row.kv_cache_dtype
    name = data.get("checkpoints", {}).get(f"{row.model}/{row.quant}")
    if name is not None:
        return load_model(str(CONFIGS / name), kv_cache_dtype=kv)
    if row.model in data.get("models", {}):
        config = data["models"][row.model]["config"]
        return model_spec_from_config(config, name=row.model, quant=row.quant, kv_cache_dtype=kv)
    if row.model not in BUILTIN_MODELS:
        raise ConfigError(f"no config of {row.model} here (a built-in or configs/)")
    own = load_model(row.model, kv_cache_dtype=kv)
    if own.precision.quantized:
        if own.precision.quant != row.quant:
            raise ConfigError(f"built-in {row.model} is {own.precision.quant}, not {row.quant}")
        return own
    return load_model(row.model, quant=row.quant, kv_cache_dtype=kv)


def production_batches(row: ProductionRow) -> tuple[int, int]:
    """The whole batches per DP rank on either side of the row's (fractional) decode batch."""
    low = max(1, int(row.decoding))
    return low, low + 1


def production_step_ms(
    row: ProductionRow,
    model: ModelSpec,
    hw: HardwareSpec,
    latency: LatencyModel | None = None,
) -> float:
    """Decode step of the row's deployment: an owner of ``tp / dp`` GPUs per DP rank, ``dp``
    ranks, experts over ``ep``; ``batch`` requests per DP rank (per instance at ``dp = 1``).
    A fractional batch (a concurrency that does not divide evenly) interpolates between the
    whole batches on either side. ``latency``: operator latencies from a profile (its
    ``sample`` carries the host time) instead of the roofline with the overlapped host."""
    if row.tp % row.dp:
        raise ConfigError(f"dp {row.dp} does not divide tp {row.tp}")
    tp = row.tp // row.dp
    profile = host_profile("overlapped") if latency is None else None

    def step(batch: int) -> float:
        est = estimate_step(
            model,
            hw,
            tp=tp,
            ep=row.ep,
            dp=row.dp,
            dense_dp=row.dense_dp,
            batch=batch * row.dp,
            context=row.context,
            latency=latency,
            host=profile,
        )
        return est.step_latency_s * 1e3

    low, _ = production_batches(row)
    frac = row.decoding - low
    ms = step(low) if frac <= 0 else (1 - frac) * step(low) + frac * step(low + 1)
    pre = prefill_s(model, hw, tp, row.prefill_tokens) / row.decode_tokens
    return ms + pre * 1e3


def evaluate_production(
    rows: Sequence[ProductionRow], data: dict[str, Any]
) -> list[ProductionResult]:
    catalog = default_catalog()
    models: dict[tuple[str, str, str], ModelSpec | str] = {}
    out = []
    for row in rows:
        key = (row.model, row.quant, row.kv_cache_dtype)
        if key not in models:
            try:
                models[key] = production_model(row, data)
            except OpWeaveError as exc:
                models[key] = str(exc)
        model = models[key]
        try:
            if isinstance(model, str):
                raise ConfigError(model)
            hw = catalog.get(row.gpu)
            out.append(ProductionResult(row, production_step_ms(row, model, hw)))
        except (OpWeaveError, KeyError) as exc:
            out.append(ProductionResult(row, None, str(exc).strip("'\"")))
    return out


def print_production_rows(results: Sequence[ProductionResult]) -> None:
    head = (
        f"{'model':<15}{'quant':<10}{'gpu':<9}{'tp':>3}{'ep':>4}{'dp':>4}{'batch':>7}"
        f"{'context':>8}{'meas ms':>9}{'est ms':>9}{'err':>8}  {'deploy':<11}{'groups':<13}engine"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        row = r.row
        est = "-" if r.estimate_ms is None else f"{r.estimate_ms:.2f}"
        err = "-" if r.estimate_ms is None else f"{100 * r.error:+.1f}%"
        print(
            f"{row.model:<15}{row.quant:<10}{row.gpu:<9}{row.tp:>3}{row.ep:>4}{row.dp:>4}"
            f"{row.decoding:>7g}{row.context:>8}{row.measured_ms:>9.2f}{est:>9}{err:>8}  "
            f"{row.deployment:<11}{','.join(row.groups):<13}{row.engine}"
        )


def run_production() -> None:
    data, rows = load_production()
    scoped = [r for r in rows if r.in_scope]
    results = evaluate_production(scoped, data)
    described = [r for r in results if r.estimate_ms is not None]
    missing = [r for r in results if r.estimate_ms is None]
    print(
        f"\nCost model vs measured production decode ({PRODUCTION.name}): {len(scoped)} rows in "
        f"scope ({len(rows) - len(scoped)} out of scope), {len(described)} described by the cost "
        f"model ({100 * len(described) / max(1, len(scoped)):.0f}%)"
    )
    print_production_rows(described)
    print(
        "\nErrors, signed = (estimate - measured) / measured; pd: decode pools (decode steps "
        "only), aggregated: TPOT with prefill chunks mixed in (not in a decode-step estimate)"
    )
    met = []
    for group in GROUPS:
        for deployment in ("pd", "aggregated"):
            part = [
                r for r in described if group in r.row.groups and r.row.deployment == deployment
            ]
            label = f"{group} {deployment}"
            print(f"{label:<26}{summary(part)}")
            if part and deployment == "pd":
                errs = [abs(r.error) for r in part]
                met.append(statistics.median(errs) <= GOAL_MEDIAN and max(errs) <= GOAL_MAX)
    for deployment in ("pd", "aggregated"):
        part = [r for r in described if r.row.deployment == deployment]
        print(f"{'all ' + deployment:<26}{summary(part)}")
    served = serving_results(results, data)
    print(
        "\nAggregated rows with the serving model (estimate_serving: prefill chunks mixed into "
        "the decode steps, the row's client replayed)"
    )
    print_production_rows(served)
    for group in GROUPS:
        part = [r for r in served if group in r.row.groups]
        print(f"{group + ' aggregated (serving)':<26}{summary(part)}")
    print(f"{'all aggregated (serving)':<26}{summary(served)}")
    print(
        f"goal median <= {100 * GOAL_MEDIAN:.0f}% and max <= {100 * GOAL_MAX:.0f}% per group "
        f"(pd rows): {'met' if met and all(met) else 'not met'} "
        f"({sum(met)} of {len(met)} groups)"
    )
    if missing:
        print("\nNot described (not in the statistics):")
        reasons: dict[str, int] = {}
        for r in missing:
            why = f"{r.row.model} on {r.row.gpu} tp {r.row.tp} ep {r.row.ep} dp {r.row.dp}: {r.why}"
            reasons[why] = reasons.get(why, 0) + 1
        for why, n in sorted(reasons.items()):
            print(f"  {n} x {why}")


def serving_results(
    results: Sequence[ProductionResult], data: dict[str, Any]
) -> list[ProductionResult]:
    """The aggregated rows among ``results`` (in-scope rows, in file order) re-estimated by
    the serving model."""
    raw = [r for r in data["rows"] if r.get("in_scope", True)]
    out = []
    for source, r in zip(raw, results, strict=True):
        if r.estimate_ms is None or source["deployment"] != "aggregated":
            continue
        try:
            model = production_model(r.row, data)
            out.append(ProductionResult(r.row, _serving_set().production_tpot_ms(source, model)))
        except OpWeaveError as exc:
            out.append(ProductionResult(r.row, None, str(exc)))
    return [r for r in out if r.estimate_ms is not None]


_SERVING_MODELS: dict[tuple[str, str, str], ModelSpec] = {}


def serving_model(row: dict[str, Any]) -> ModelSpec:
    """A serving row's checkpoint, resolved as the production rows' are."""
    key = (row["model"], row["quant"], row.get("kv_cache_dtype", "auto"))
    if key in _SERVING_MODELS:
        return _SERVING_MODELS[key]
    data, _ = load_production()
    as_row = ProductionRow(
        model=row["model"],
        gpu=row["gpu"],
        tp=int(row["tp"]),
        ep=int(row["ep"]),
        dp=int(row["dp"]),
        dense_dp=bool(row.get("dense_dp", False)),
        batch=1.0,
        context=1,
        measured_ms=1.0,
        quant=row["quant"],
        kv_cache_dtype=row.get("kv_cache_dtype", "auto"),
        engine=row["engine"],
        deployment=row["deployment"],
        groups=(),
        prefill_tokens=0,
        decode_tokens=1,
        in_scope=True,
        scope_note="",
    )
    _SERVING_MODELS[key] = production_model(as_row, data)
    return _SERVING_MODELS[key]


def run_profile(path: Path, model_name: str | None, gpu: str | None) -> None:
    profile = load_profile(path)
    model = load_model(model_name or profile.model)
    if model.config_sha256 != profile.config_sha256:
        raise ConfigError(
            f"{path} was measured on model {profile.model!r}, not {model.name!r}; "
            "pass the model it was measured on with --model"
        )
    hw = default_catalog().get(gpu) if gpu else profile.device
    roof = RooflineLatency(hw)
    ops = {key: (op, layer) for key, op, layer in profile_operators(model)}
    # The profiler times the sampling kernel alone; a synthesised profile holds the roofline's
    # sample latency, step cost included.
    drop = {"step"} if profile.provenance.source == "measured" else set()
    print(
        f"Profile {path} ({profile.provenance.source} on {profile.provenance.device_name}, "
        f"{profile.provenance.date}) against the cost model on {hw.id}"
        + (" (per-step cost left out of sample)" if drop else "")
    )
    head = f"{'operator':<22}{'tp':>3}{'points':>7}  {'median |err|':>12}{'max |err|':>10}"
    print(head + f"{'mean signed':>13}")
    print("-" * (len(head) + 13))
    every: list[float] = []
    # a measured or imported profile times each operator alone: a shared expert with its
    # launches, which the roofline leaves out where it runs beside the routed experts
    alone = profile.provenance.source != "roofline"
    for table in profile.ops:
        op, _ = ops[table.op]
        if alone:
            op = op.alone()
        errs = []
        for b in table.batches:
            for s in table.contexts:
                terms = roof.op_terms_s(op, table.tp, b, s)
                model_s = sum(v for k, v in terms.items() if k not in drop)
                meas_s = table(b, s) * (1.0 + profile.stall_overhead)
                errs.append((model_s - meas_s) / meas_s)
        every.extend(errs)
        absolute = [abs(e) for e in errs]
        print(
            f"{table.op:<22}{table.tp:>3}{len(errs):>7}  "
            f"{100 * statistics.median(absolute):>11.1f}%{100 * max(absolute):>9.1f}%"
            f"{100 * statistics.mean(errs):>+12.1f}%"
        )
    if every:
        absolute = [abs(e) for e in every]
        print(
            f"all operators: {len(every)} points, median |err| "
            f"{100 * statistics.median(absolute):.1f}%, max |err| {100 * max(absolute):.1f}%, "
            f"mean signed {100 * statistics.mean(every):+.1f}% "
            "(signed = (model - profile) / profile)"
        )


# the engines the silicon database measured, by the names the reference rows give them
DATABASE_ENGINES = (
    ("vllm", "vllm"),
    ("sglang", "sglang"),
    ("tensorrt", "trtllm"),
    ("trt", "trtllm"),
)


def _engine(name: str) -> str | None:
    """The database's engine for a row's engine name; None for an engine it has no tables of
    (gpt-fast; NIM, whose page does not say which backend ran)."""
    low = name.lower()
    return next((engine for prefix, engine in DATABASE_ENGINES if low.startswith(prefix)), None)


def run_imported() -> None:
    """The reference rows: roofline vs a profile imported from the silicon database."""
    from opweave.costmodel import ProfiledLatency
    from opweave.profiler import import_profile, open_database
    from opweave.profiler._private.aic_db import SYSTEMS

    configs, rows = load_reference()
    catalog = default_catalog()
    db = open_database()
    inside = [r for r in rows if r.in_scope]
    on_gpus = [r for r in inside if catalog.resolve(r.gpu) in SYSTEMS]
    covered = [r for r in on_gpus if _engine(r.engine) is not None]
    apart = sorted({r.engine for r in on_gpus if _engine(r.engine) is None})
    roof = {id(r.row): r for r in evaluate(covered, configs, catalog.get)}
    results: list[tuple[Result, Result]] = []
    for row in covered:
        model = model_for(row, configs)
        hw = catalog.get(row.gpu)
        hw = host_profile(row.host).apply(hw) if row.host else hw
        run = import_profile(
            model,
            hw.id,
            engine=_engine(row.engine) or "",
            tp=[row.tp],
            batches=(row.batch,),
            contexts=(row.context,),
            database=db,
            hardware=hw,
        )
        est = estimate_step(
            model,
            hw,
            tp=row.tp,
            batch=row.batch,
            context=row.context,
            latency=ProfiledLatency(run.profile),
        )
        pre = prefill_s(model, hw, row.tp, row.prefill_tokens) / row.decode_tokens
        base = roof[id(row)]
        results.append(
            (base, Result(row, base.moe, (est.step_latency_s + pre) * 1e3, pre * 1e3, row.host))
        )
    print(
        f"Published decode steps: roofline vs a profile imported from the silicon database "
        f"({db.origin}); {len(covered)} of {len(inside)} in-scope rows are on GPUs and engines "
        "it covers"
    )
    if apart:
        left = len(on_gpus) - len(covered)
        print(
            f"Not compared: {left} rows of engines the database has no tables of "
            f"({', '.join(apart)})"
        )
    head = (
        f"{'model':<15}{'gpu':<15}{'tp':>3}{'batch':>6}{'context':>8}{'meas ms':>9}"
        f"{'roof ms':>9}{'err':>8}{'imp ms':>9}{'err':>8}{'imp-roof':>9}  engine"
    )
    print(head)
    print("-" * len(head))
    for base, imp in results:
        row = base.row
        diff = (imp.estimate_ms - base.estimate_ms) / base.estimate_ms
        print(
            f"{row.model:<15}{row.gpu:<15}{row.tp:>3}{row.batch:>6}{row.context:>8}"
            f"{row.measured_ms:>9.2f}{base.estimate_ms:>9.2f}{100 * base.error:>+7.1f}%"
            f"{imp.estimate_ms:>9.2f}{100 * imp.error:>+7.1f}%{100 * diff:>+8.1f}%  {row.engine}"
        )
    groups: list[tuple[str, Callable[[Result], bool]]] = [
        ("all covered", lambda r: True),
        ("batch 1", lambda r: r.row.batch == 1),
        ("batch > 1", lambda r: r.row.batch > 1),
        ("MoE", lambda r: r.moe),
        ("dense", lambda r: not r.moe),
        ("TP > 1", lambda r: r.row.tp > 1),
        ("TP 1", lambda r: r.row.tp == 1),
    ]
    for gpu in sorted({b.row.gpu for b, _ in results}):
        groups.append((f"GPU {gpu}", lambda r, g=gpu: r.row.gpu == g))
    for engine in sorted({b.row.engine for b, _ in results}):
        groups.append((f"engine {engine}", lambda r, e=engine: r.row.engine == e))
    print("\nErrors, signed = (estimate - measured) / measured")
    print_side_by_side(results, groups, width=22)


def print_production_pairs(
    pairs: Sequence[tuple[ProductionResult, ProductionResult]], labels: tuple[str, str]
) -> None:
    """Production rows with two estimates each (``labels``: their column names) and errors."""
    head = (
        f"{'model':<15}{'quant':<10}{'gpu':<9}{'tp':>3}{'ep':>4}{'dp':>4}{'batch':>7}"
        f"{'context':>8}{'meas ms':>9}{labels[0]:>9}{'err':>8}{labels[1]:>9}{'err':>8}  "
        f"{'deploy':<11}engine"
    )
    print(head)
    print("-" * len(head))
    for first, second in pairs:
        row = first.row
        assert first.estimate_ms is not None and second.estimate_ms is not None
        print(
            f"{row.model:<15}{row.quant:<10}{row.gpu:<9}{row.tp:>3}{row.ep:>4}{row.dp:>4}"
            f"{row.decoding:>7g}{row.context:>8}{row.measured_ms:>9.2f}{first.estimate_ms:>9.2f}"
            f"{100 * first.error:>+7.1f}%{second.estimate_ms:>9.2f}{100 * second.error:>+7.1f}%  "
            f"{row.deployment:<11}{row.engine}"
        )


def production_groups(
    pairs: Sequence[tuple[ProductionResult, ProductionResult]], kinds: Sequence[str]
) -> list[tuple[str, Callable[[Any], bool]]]:
    """Groups of paired production rows: each of ``kinds`` (fp8, fp4, mla, ep), each GPU and
    each engine among them."""
    groups: list[tuple[str, Callable[[Any], bool]]] = [
        (g, lambda r, g=g: g in r.row.groups) for g in kinds
    ]
    for gpu in sorted({m.row.gpu for m, _ in pairs}):
        groups.append((f"GPU {gpu}", lambda r, g=gpu: r.row.gpu == g))
    for engine in sorted({m.row.engine for m, _ in pairs}):
        groups.append((f"engine {engine}", lambda r, e=engine: r.row.engine == e))
    return groups


def print_side_by_side(
    pairs: Sequence[tuple[Any, Any]],
    groups: Sequence[tuple[str, Callable[[Any], bool]]],
    width: int,
    labels: tuple[str, str] = ("roofline", "imported"),
) -> None:
    """Per group with rows, the errors of each pair's first estimate (the roofline's) over its
    second's (the imported profile's, or another estimator's)."""
    for name, keep in groups:
        base = [b for b, _ in pairs if keep(b)]
        if base:
            print(f"{name:<{width}}{labels[0]} {summary(base)}")
            print(f"{'':<{width}}{labels[1]} {summary([i for _, i in pairs if keep(i)])}")


def run_imported_production() -> None:
    """The production decode rows a TP-only profile can describe: roofline vs imported.

    A P/D row compares decode steps. An aggregated row's TPOT holds the prefill chunks mixed
    into the decode steps, which a profile of decode operators has no tables for: both sides
    take the serving replay's TPOT (``serving_results``), the imported side with its decode
    step in place of the roofline's (the difference of the two at the row's batch and
    context), the prefill chunks' share the roofline's on both."""
    from opweave.costmodel import ProfiledLatency
    from opweave.profiler import import_profile, open_database
    from opweave.profiler._private.aic_db import SYSTEMS

    data, rows = load_production()
    catalog, db = default_catalog(), open_database()
    skipped: dict[str, int] = {}
    pairs: list[tuple[ProductionResult, ProductionResult]] = []
    overlapped = host_profile("overlapped")
    for row, source in zip(rows, data["rows"], strict=True):
        if not row.in_scope:
            continue
        engine = _engine(row.engine.split("+")[-1])
        why = (
            "expert or attention-data parallelism (a profile holds TP tables only)"
            if row.ep > 1 or row.dp > 1
            else f"no database system for {row.gpu}"
            if catalog.resolve(row.gpu) not in SYSTEMS
            else f"no database tables of {row.engine}"
            if engine is None
            else ""
        )
        if not why:
            model = production_model(row, data)
            hw = overlapped.apply(catalog.get(row.gpu))
            try:
                run = import_profile(
                    model,
                    hw.id,
                    engine=engine or "",
                    tp=[row.tp],
                    batches=production_batches(row),
                    contexts=(row.context,),
                    database=db,
                    hardware=hw,
                )
            except OpWeaveError as exc:
                why = str(exc)
            else:
                imported = production_step_ms(row, model, hw, ProfiledLatency(run.profile))
                roof = production_step_ms(row, model, catalog.get(row.gpu))
                if row.deployment == "aggregated":
                    tpot = _serving_set().production_tpot_ms(source, model)
                    roof, imported = tpot, tpot + imported - roof
                pairs.append((ProductionResult(row, roof), ProductionResult(row, imported)))
        if why:
            skipped[why] = skipped.get(why, 0) + 1
    print(
        f"\nProduction decode ({PRODUCTION.name}): roofline vs a profile imported from the "
        f"silicon database ({db.origin}); {len(pairs)} rows compared"
    )
    print_production_pairs(pairs, ("roof ms", "imp ms"))
    groups: list[tuple[str, Callable[[ProductionResult], bool]]] = [
        ("all compared", lambda r: True),
        ("pd", lambda r: r.row.deployment == "pd"),
        ("aggregated", lambda r: r.row.deployment == "aggregated"),
    ]
    groups += production_groups(pairs, [g for g in GROUPS if g != "ep"])
    print(
        "\nErrors, signed = (estimate - measured) / measured (aggregated rows: TPOT of the "
        "serving replay, prefill chunks mixed in; the imported side with its decode steps)"
    )
    print_side_by_side(pairs, groups, width=28)
    if skipped:
        print("\nNot compared:")
        for why, n in sorted(skipped.items()):
            print(f"  {n} x {why}")


# -- another published estimator on the same rows (--other aiconfigurator) -----------------------
def _aic_estimator() -> ModuleType:
    """``aic_estimator.py`` beside this file (a sibling script, importable by name)."""
    here = str(Path(__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import aic_estimator

    return aic_estimator


def run_other_production(estimator: Any) -> None:
    """The production P/D decode rows: OpWeave's decode step beside aiconfigurator's (its
    ``decode_step_latency`` at the same deployment, requests per attention rank and context;
    a fractional batch interpolated between the whole batches on either side, as OpWeave's)."""
    aic = _aic_estimator()
    data, rows = load_production()
    ours = evaluate_production([r for r in rows if r.in_scope and r.deployment == "pd"], data)
    pairs: list[tuple[ProductionResult, ProductionResult]] = []
    skipped: dict[str, int] = {}
    for r in ours:
        row = r.row
        if r.estimate_ms is None:
            continue
        d = aic.Deployment(
            row.model, row.quant, row.gpu, row.engine, row.tp, row.ep, row.dp, row.kv_cache_dtype
        )
        low, high = production_batches(row)
        frac = row.decoding - low
        try:
            ms = estimator.decode_step_ms(d, low, row.context)
            if frac > 0:
                ms = (1 - frac) * ms + frac * estimator.decode_step_ms(d, high, row.context)
        except aic.NotCovered as exc:
            why = f"{row.model} on {row.gpu} tp {row.tp} ep {row.ep} dp {row.dp}: {exc}"
            skipped[why] = skipped.get(why, 0) + 1
            continue
        pairs.append((r, ProductionResult(row, ms)))
    print(
        f"\nProduction P/D decode rows ({PRODUCTION.name}): OpWeave's decode step beside "
        f"aiconfigurator-core {aic.version()}'s own ({', '.join(sorted(estimator.versions))}); "
        f"{len(pairs)} rows both describe"
    )
    print_production_pairs(pairs, ("opweave", "aic"))
    groups: list[tuple[str, Callable[[Any], bool]]] = [("all", lambda r: True)]
    groups += production_groups(pairs, GROUPS)
    print("\nErrors, signed = (estimate - measured) / measured")
    print_side_by_side(pairs, groups, width=28, labels=("opweave ", "aic     "))
    if skipped:
        print("\nNot estimated by aiconfigurator:")
        for why, n in sorted(skipped.items()):
            print(f"  {n} x {why}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fixed-costs", choices=("on", "off"), default="on")
    parser.add_argument(
        "--host",
        choices=("row", *HOST_PROFILES),
        default="row",
        help="host profile: each row's (default) or one for every row",
    )
    parser.add_argument(
        "--set",
        choices=("reference", "production", "serving", "all"),
        default="all",
        help="which published measurements to compare with (default: every set)",
    )
    parser.add_argument("--profile", type=Path, help="compare this measured profile instead")
    parser.add_argument(
        "--profiles",
        choices=("aiconfigurator",),
        help="compare the reference and production decode rows (--set) with profiles "
        "imported from this source beside the roofline",
    )
    parser.add_argument(
        "--other",
        choices=("aiconfigurator",),
        help="print another published estimator's figures beside OpWeave's on the production "
        "P/D decode rows and the serving rows (--set)",
    )
    parser.add_argument("--model", help="model the profile was measured on (default: its name)")
    parser.add_argument("--gpu", help="catalog GPU to model the profile with (default: its device)")
    args = parser.parse_args(argv)
    try:
        if args.profile is not None:
            run_profile(args.profile, args.model, args.gpu)
        elif args.other == "aiconfigurator":
            aic = _aic_estimator()
            why = aic.missing()
            if why is not None:
                parser.exit(2, f"error: {why}\n")
            estimator = aic.AicEstimator()
            if args.set in ("production", "all"):
                run_other_production(estimator)
            if args.set in ("serving", "all"):
                _serving_set().run_other(serving_model, estimator)
        elif args.profiles == "aiconfigurator":
            if args.set in ("reference", "all"):
                run_imported()
            if args.set in ("production", "all"):
                run_imported_production()
        else:
            if args.set in ("reference", "all"):
                run_reference(args.fixed_costs == "on", args.host)
            if args.set in ("production", "all"):
                run_production()
            if args.set in ("serving", "all"):
                _serving_set().run_serving(serving_model)
    except OpWeaveError as exc:
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    main()
