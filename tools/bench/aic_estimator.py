"""NVIDIA AIConfigurator's own estimates of the published rows (``costmodel_accuracy.py --other
aiconfigurator``), printed beside OpWeave's.

``aiconfigurator-core`` (the profiler's ``aiconfigurator`` extra) is a published estimator: its
silicon database and the step model NVIDIA builds on it. Each row is given to it as a user would
describe the deployment:

- the checkpoint: a config the package ships (``CHECKPOINTS``: the row's own checkpoint, or one of
  the same architecture and format where it ships no copy of the row's; a row whose checkpoint is
  BF16 in the package but served in FP8 names the weight formats as its ``--quant`` would);
- the system (``SYSTEMS``), the engine's tables (vllm, sglang or trtllm; Dynamo rows by the engine
  they run; NIM rows are left out, as the page names no backend) at the database's ``current``
  version (the one its own CLI uses), the KV-cache dtype the row's engine ran;
- the parallelism: attention TP ``tp / dp`` over ``dp`` attention-data-parallel ranks, the
  experts over ``ep`` ranks and TP ``tp / ep`` inside each (its ``moe_tp_size`` x
  ``moe_ep_size`` = the GPUs of the instance).

A P/D decode row is one decode step (``EngineHandle.decode_step_latency`` at the requests per
attention rank and the row's context). An aggregated row is the package's aggregated-serving
estimate (``run_agg`` of the engine's backend: a mean-field mix of prefill chunks and decode
steps at ``batch`` requests, with the engine's prefill token budget per step), which gives a TTFT
and a TPOT. Where the package cannot estimate a row (no table for the shape, a layout it refuses)
the row is counted apart with its message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any

# the package's config of the checkpoint each (model, format) of the data files names
CHECKPOINTS: dict[tuple[str, str], tuple[str, dict[str, str]]] = {
    ("deepseek-v3", "fp8-block"): ("deepseek-ai/DeepSeek-R1", {}),
    ("deepseek-v3", "nvfp4"): ("nvidia/DeepSeek-V3.1-NVFP4", {}),
    ("kimi-k2", "fp8-block"): ("moonshotai/Kimi-K2-Instruct", {}),
    ("gpt-oss-120b", "mxfp4"): ("openai/gpt-oss-120b", {}),
    ("minimax-m2.5", "fp8-block"): ("MiniMaxAI/MiniMax-M2.5", {}),
    ("minimax-m2", "fp8-block"): ("MiniMaxAI/MiniMax-M2.5", {}),
    ("qwen3-235b-a22b", "bf16"): ("Qwen/Qwen3-235B-A22B", {}),
    ("qwen3-235b-a22b", "fp8-block"): ("Qwen/Qwen3-235B-A22B-FP8", {}),
    ("qwen3-32b", "bf16"): ("Qwen/Qwen3-32B", {}),
    ("qwen3-32b", "fp8-block"): ("Qwen/Qwen3-32B-FP8", {}),
    ("qwen3-30b-a3b", "fp8-block"): ("Qwen/Qwen3-30B-A3B-FP8", {}),
    ("qwen3-8b", "bf16"): ("Qwen/Qwen3-8B", {}),
    ("qwen3-8b", "fp8-block"): ("Qwen/Qwen3-8B", {"gemm_quant_mode": "fp8_block"}),
    ("qwen3-coder-480b-a35b", "fp8-block"): (
        "Qwen/Qwen3-Coder-480B-A35B-Instruct",
        {"gemm_quant_mode": "fp8_block", "moe_quant_mode": "fp8_block"},
    ),
}
SYSTEMS = {
    "a100-sxm-80gb": "a100_sxm",
    "h100-sxm": "h100_sxm",
    "h200-sxm": "h200_sxm",
    "b200": "b200_sxm",
    "b300": "b300_sxm",
    "gb200": "gb200",
    "gb300": "gb300",
    "l40s": "l40s",
    "rtx-pro-6000": "rtx_pro_6000_server",
}
EXTRA = "opweave-profiler[aiconfigurator]"


class NotCovered(Exception):
    """The package cannot estimate this row (the message says why)."""


def missing() -> str | None:
    """Why the package cannot be used here, or None."""
    try:
        metadata.version("aiconfigurator-core")
    except metadata.PackageNotFoundError:
        return (
            f"--other aiconfigurator needs aiconfigurator-core (pip install '{EXTRA}'), "
            "which is not installed"
        )
    return None


def version() -> str:
    return metadata.version("aiconfigurator-core")


def engine_backend(engine: str) -> str:
    for key, backend in (("tensorrt", "trtllm"), ("sglang", "sglang"), ("vllm", "vllm")):
        if key in engine:
            return backend
    raise NotCovered(f"engine {engine}: no tables of it (its backend is not named)")


@dataclass(frozen=True)
class Deployment:
    """What the package is told about a row."""

    model: str
    quant: str
    gpu: str
    engine: str
    tp: int
    ep: int
    dp: int
    kv_cache_dtype: str


class AicEstimator:
    """aiconfigurator-core's estimates, its compiled engines and models cached per deployment."""

    def __init__(self) -> None:
        logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
        from aiconfigurator_core.sdk.perf_database import resolve_query_version

        self._resolve = resolve_query_version
        self._handles: dict[Any, Any] = {}
        self._models: dict[Any, Any] = {}
        self._databases: dict[Any, Any] = {}
        self.versions: set[str] = set()

    def _inputs(self, d: Deployment) -> tuple[str, str, str, dict[str, Any]]:
        found = CHECKPOINTS.get((d.model, d.quant))
        if found is None:
            raise NotCovered(f"{d.model} ({d.quant}): no config of it in the package")
        system = SYSTEMS.get(d.gpu)
        if system is None:
            raise NotCovered(f"{d.gpu}: no system of it in the database")
        if d.tp % d.dp or d.tp % d.ep:
            raise NotCovered(f"tp {d.tp} is not a multiple of dp {d.dp} and ep {d.ep}")
        checkpoint, formats = found
        kwargs: dict[str, Any] = dict(
            tp_size=d.tp // d.dp,
            attention_dp_size=d.dp,
            moe_tp_size=d.tp // d.ep,
            moe_ep_size=d.ep,
            # named either way: left out, the package takes FP8 from an FP8 checkpoint, where
            # the engines' "auto" keeps the cache in the model dtype
            kvcache_quant_mode="fp8" if d.kv_cache_dtype == "fp8" else "bfloat16",
            **formats,
        )
        return checkpoint, system, engine_backend(d.engine), kwargs

    def _version(self, system: str, backend: str) -> str:
        try:
            found = str(self._resolve(system, backend, "current"))
        except ValueError as exc:
            raise NotCovered(f"{system}/{backend}: {exc}") from exc
        self.versions.add(f"{system}/{backend} {found}")
        return found

    def decode_step_ms(self, d: Deployment, batch: int, context: int) -> float:
        """One decode step of ``batch`` requests per attention rank at ``context`` tokens."""
        from aiconfigurator_core.sdk.engine import EngineHandle

        checkpoint, system, backend, kwargs = self._inputs(d)
        key = (checkpoint, system, backend, tuple(sorted(kwargs.items())))
        try:
            if key not in self._handles:
                version = self._version(system, backend)
                self._handles[key] = EngineHandle.compile(
                    checkpoint, system, backend, backend_version=version, **kwargs
                )
            return float(self._handles[key].decode_step_latency(batch, context, 2))
        except (RuntimeError, ValueError, KeyError) as exc:
            raise NotCovered(_first_line(exc)) from exc

    def serving_ms(
        self, d: Deployment, batch: int, isl: int, osl: int, prefill_budget: int
    ) -> tuple[float, float]:
        """(TTFT, TPOT) of aggregated serving at ``batch`` requests in flight."""
        from aiconfigurator_core.sdk.backends.factory import get_backend
        from aiconfigurator_core.sdk.config import RuntimeConfig
        from aiconfigurator_core.sdk.config_builders import build_model_config
        from aiconfigurator_core.sdk.models import get_model
        from aiconfigurator_core.sdk.models.helpers import resolve_context_fmha_by_data
        from aiconfigurator_core.sdk.perf_database import get_database

        checkpoint, system, backend, kwargs = self._inputs(d)
        try:
            version = self._version(system, backend)
            if (system, backend) not in self._databases:
                self._databases[system, backend] = get_database(system, backend, version)
            database = self._databases[system, backend]
            key = (checkpoint, system, backend, tuple(sorted(kwargs.items())))
            if key not in self._models:
                config = build_model_config(pp_size=1, **kwargs)
                # the prefill attention's format as the package's own CLI resolves it: the
                # checkpoint's, or BF16 where the database has no FP8 table of it
                resolve_context_fmha_by_data(
                    config, checkpoint, database, backend, is_context_role=True
                )
                self._models[key] = get_model(checkpoint, config, backend)
            engine = get_backend(backend)
            runtime = RuntimeConfig(batch_size=batch, isl=isl, osl=osl)
            summary = engine.run_agg(
                self._models[key],
                database,
                runtime,
                ctx_tokens=prefill_budget,
            )
            result = summary.get_result_dict()
        except (RuntimeError, ValueError, KeyError, AssertionError) as exc:
            raise NotCovered(_first_line(exc)) from exc
        if not result:
            raise NotCovered("no aggregated result for this point")
        return float(result["ttft"]), float(result["tpot"])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:160]
