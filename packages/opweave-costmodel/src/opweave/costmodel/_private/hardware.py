"""GPU hardware: the schema the cost model reads a device from, the catalog lookup and
hardware files. The built-in GPUs, with their datasheet and price sources, are in
``gpu_catalog.py``.

Sources of the schema's defaults, cited once here and by key below:
  [VLLM] vLLM EngineArgs default gpu_memory_utilization = 0.9 of device memory.
  Fixed costs of a decode step (used by ``fixed_costs.py``; values measured on Hopper, taken for
  the other GPUs where no measurement of their own was found):
  [HAZY] Hazy Research, "Look Ma, No Bubbles! Designing a Low-Latency Megakernel for Llama-1B",
  2025-05-27: on an H100, vLLM and SGLang reach at most 50% of memory bandwidth decoding
  Llama-3.2-1B at batch 1 with around a hundred kernels per forward pass, one megakernel 78%;
  launching a kernel costs about 1.3 us even inside a CUDA graph.
  [VLLM-GAP] vllm-project/vllm#11133: with asynchronous scheduling and CUDA graphs the GPU sits
  idle 150-170 us between two decode steps (5-6 ms before).
  [SGL-HOST] sgl-project/sglang-omni#760, H100, CUDA graphs, no overlap: the host's share of a
  decode step is 1.36-1.38 / 1.65-1.66 / 1.82-1.86 ms at batch 16 / 24 / 32, i.e. 0.90 ms plus
  29 us per request.
  [AIC-AR] NVIDIA's silicon database (aiconfigurator-core 0.12.0, Apache-2.0,
  ``systems/data/<system>/comm/{vllm,sglang,trtllm}/<version>/custom_allreduce_perf.parquet``):
  the engines' custom all-reduce captured in a CUDA graph, as decode steps run it. Per system
  the fastest engine per GPU count and size, fitted to latency + 2(t-1)/t x bytes / bandwidth
  over 1 KiB-1 MiB at 2, 4 and 8 GPUs (``opweave.profiler``'s ``aic_allreduce``; printed by
  ``tools/aic_allreduce.py``): H100 3.0 us and 179 GB/s (within 3.8 us of its 33 points), H200
  3.0 / 188, A100 5.3 / 109, B200 and B300 4.5 / 225, GB200 4.1 / 330, GB300 4.0 / 377.
  Cross-check: vLLM's one-stage custom all-reduce on B300 takes 8 us at 32 KiB and 17 us at
  1 MiB (vllm-project/vllm#37756).
  [SGL-AR] sgl-project/sglang#2904, H100, vLLM's custom all-reduce *without CUDA graphs*: 8.7 /
  9.2 / 11.8 us at 32 KiB and 26.6 / 40.2 / 45.0 us at 1 MiB for TP 2 / 4 / 8 (the eager call
  copies its input into the registered buffer and pays its launch: 2-3x the graph's time).
  [MOE-K] fused-MoE kernel times at decode batch sizes, timed under CUDA graphs by the engines'
  tuning scripts: sgl-project/sglang#11730 (H200, Qwen3-235B-A22B FP8, TP 8: 31.7 us at batch 1,
  36.6, 49.7, 66.9, 92.4, 117.4, 125.0 us at 2-32); vllm-project/vllm#44830 (H100,
  Qwen3-Next-80B-A3B FP8, TP 4: 29.45 us at batch 1); vllm-project/vllm#31448 (B200,
  Qwen3-30B-A3B BF16, TP 1: 39.6 us at batch 1).
Override any field with ``--hardware FILE``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, model_validator

from ..errors import ConfigError, UnknownGPUError, validation_message
from .base import FileSchema, read_data_file, schema_version_problem

HARDWARE_SCHEMA_VERSION = 1
GB = 1e9
TB = 1e12
TFLOPS = 1e12
US = 1e-6

# A hardware entry's numbers are numbers (strict: "2.0" is refused, not read as 2.0), bounded far
# beyond any device on both sides: rates from a megabyte per second, a megaflop and an
# efficiency of 0.1% up to a petabyte per second and an exaflop; up to a petabyte of memory, a
# second of fixed latency, $10,000 per device-hour. Past them an entry is a unit slip or corrupt,
# and the times it gives overflow the simulator's arithmetic (1e-300 B/s turns a step into inf,
# 1e300 B/s into 0).
_Bytes = Annotated[float, Field(strict=True, gt=0, le=1e15)]
_Rate = Annotated[float, Field(strict=True, ge=1e6, le=1e15)]
_Flops = Annotated[float, Field(strict=True, ge=1e6, le=1e18)]
_Seconds = Annotated[float, Field(strict=True, ge=0, le=1.0)]
_Fraction = Annotated[float, Field(strict=True, ge=1e-3, le=1)]


class HardwareSpec(FileSchema):
    """One device type as the cost model sees it (per device; one direction for links)."""

    id: str = Field(min_length=1, max_length=200)
    name: str
    memory_bytes: _Bytes
    mem_bandwidth_bytes_per_s: _Rate = Field(description="Datasheet peak.")
    dense_flops_per_s: _Flops = Field(description="Datasheet dense BF16 tensor peak.")
    fp8_flops_per_s: _Flops | None = Field(
        default=None,
        description="Datasheet dense FP8 tensor peak; None: no FP8 tensor cores (FP8 weights "
        "run weight-only, dequantised to BF16 math).",
    )
    fp4_flops_per_s: _Flops | None = Field(
        default=None,
        description="Datasheet dense FP4 (NVFP4/MXFP4) tensor peak; None: no FP4 tensor cores.",
    )
    fp32_flops_per_s: _Flops | None = Field(
        default=None,
        description="Datasheet FP32 peak without tensor cores (CUDA cores; AMD's vector "
        "units), which a float32 model's math runs at: vLLM's float32 matmul precision is "
        "'highest' (no TF32) unless VLLM_FLOAT32_MATMUL_PRECISION says otherwise. None: the "
        "dense rate (a device measured in float32, such as a CPU profile's).",
    )
    intra_node_link: str = ""
    intra_node_bandwidth_bytes_per_s: _Rate = Field(description="Per direction.")
    intra_node_latency_s: _Seconds = 4 * US
    network_bandwidth_bytes_per_s: _Rate = Field(description="Inter-node, per direction.")
    network_latency_s: _Seconds = 8 * US
    gpus_per_node: int = Field(default=8, strict=True, ge=1, le=1024)
    nvlink_domain_gpus: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=1024,
        description="GPUs one scale-up (NVLink) domain joins, across hosts in a rack-scale "
        "system such as GB200 NVL72; None: one node (gpus_per_node).",
    )
    usd_per_hour: Annotated[float, Field(strict=True, ge=1e-4, le=1e4)] | None = Field(
        default=None, description="On-demand price per device-hour."
    )
    price_source: str = ""
    memory_efficiency: _Fraction = 0.85
    compute_efficiency: _Fraction = Field(
        default=0.80, description="Achievable / datasheet dense BF16 GEMM throughput."
    )
    fp8_compute_efficiency: _Fraction | None = Field(
        default=None,
        description="Achievable / datasheet dense FP8 GEMM throughput, where measured; None: "
        "compute_efficiency.",
    )
    fp4_compute_efficiency: _Fraction | None = Field(
        default=None,
        description="Achievable / datasheet dense FP4 GEMM throughput, where measured; None: "
        "compute_efficiency.",
    )
    link_efficiency: _Fraction = 0.85
    # [HAZY]: (1/0.50 - 1/0.78) x 2.48 GB / 3.35 TB/s = 0.53 ms per Llama-1B step, less the
    # 0.16 ms step gap, over ~100 kernels: 3.7 us per kernel boundary (launch, fill, drain).
    kernel_overhead_s: _Seconds = Field(
        default=3.7 * US, description="Per kernel launch (launch, pipeline fill, drain)."
    )
    # Catalog GPUs carry [AIC-AR]. A hardware file that names none gets [SGL-AR]'s eager-mode
    # floor, 9 us (fitted with 53 GB/s to its 18 points): an upper bound for a graph-captured step.
    allreduce_latency_s: _Seconds = Field(
        default=9 * US, description="Latency floor of one TP all-reduce / all-gather."
    )
    allreduce_bandwidth_bytes_per_s: _Rate | None = Field(
        default=None,
        description="Ring-equivalent bandwidth of decode-size (up to 1 MiB) TP collectives; "
        "None: the intra-node link at link_efficiency.",
    )
    # [PPLX-A2A] and [DEEPEP-LL] in expert_comm.py: 41.6 / 41.7 us per dispatch / combine of one
    # token per GPU over NVLink (Hopper, EP8); DeepEP's low-latency kernels over RDMA at EP16-256
    # take 34-38 us (dispatch) and 40-61 us (combine) beyond their bytes at the NIC's bandwidth.
    alltoall_latency_s: _Seconds = Field(
        default=42 * US,
        description="Latency floor of one expert-parallel all-to-all (a dispatch or a combine), "
        "paid however few tokens move.",
    )
    # Engines that overlap the host's scheduling with the GPU's step ([VLLM-GAP]; SGLang's and
    # TensorRT-LLM's overlap schedulers; OpWeave's runtime runs compiled schedules, paper §6.2)
    # leave only this gap. An engine that does not pays more, per its version: host.py's
    # HOST_PROFILES (``opweave estimate --host``) carry measured values, e.g. [SGL-HOST].
    step_overhead_s: _Seconds = Field(
        default=160 * US,  # [VLLM-GAP]
        description="Per decode step and microbatch: scheduling, sampling launch and the "
        "host-device round trip the GPU waits for.",
    )
    step_overhead_per_request_s: _Seconds = Field(
        default=0.0,
        description="... and per request of the step (host work the engine does not overlap).",
    )
    # An engine that runs steps with prompt chunks outside CUDA graphs (SGLang, TensorRT-LLM's
    # PyTorch flow) enqueues each of their kernels from Python: host.py's [EAGER-PREFILL]
    eager_launch_s: _Seconds = Field(
        default=0.0,
        description="Host time per kernel launch of a step with prompt chunks, which the engine "
        "runs eagerly (outside CUDA graphs): such a step takes at least the forward's launches "
        "times this. 0: the engine graphs or compiles those steps (vLLM V1).",
    )
    # [MOE-K] the H200 series fits 22.6 us + experts touched x (their bytes at the dense
    # bandwidth + 0.33 us) within 6% at every batch size; the same numbers give the H100 and B200
    # points 28.6 us (29.45 measured) and 37.0 us (39.6).
    expert_fixed_latency_s: _Seconds = Field(
        default=22.6 * US,
        description="Fixed time of one MoE layer's routed-expert kernels (align, two grouped "
        "GEMMs, activation, combine), in place of their per-kernel launch costs.",
    )
    expert_overhead_s: _Seconds = Field(
        default=0.33 * US,
        description="Extra time per expert a step touches (one small GEMM's ramp and tail).",
    )
    side_streams: bool = Field(
        default=True,
        strict=True,
        description="The engines run a MoE layer's shared experts on a second stream beside "
        "the routed experts here (CUDA); False where they run them inline (ROCm: vLLM turns it "
        "off, vllm-project/vllm#30085; SGLang makes its second stream only under CUDA).",
    )
    engine_kernels: bool = Field(
        default=True,
        strict=True,
        description="The device runs the serving engines' GPU kernels: routed experts as "
        "fused-MoE grouped GEMMs and prefill attention as FlashAttention-style kernels, at the "
        "fractions of the dense rate NVIDIA's silicon database measures for them "
        "(kernel_rates.py); False: everything at the dense rate (a CPU rank's matmuls).",
    )
    usable_memory_fraction: _Fraction = 0.9
    aliases: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> HardwareSpec:
        for fmt in ("fp8", "fp4"):
            if getattr(self, f"{fmt}_compute_efficiency") is not None and (
                getattr(self, f"{fmt}_flops_per_s") is None
            ):
                raise ValueError(
                    f"{fmt}_compute_efficiency needs {fmt}_flops_per_s (the rate it is a "
                    f"fraction of); give both, or neither for a GPU without {fmt.upper()} "
                    "tensor cores"
                )
        domain = self.nvlink_domain_gpus
        if domain is not None and domain % self.gpus_per_node:
            raise ValueError(
                f"nvlink_domain_gpus ({domain}) must be a multiple of gpus_per_node "
                f"({self.gpus_per_node}): a scale-up domain joins whole nodes"
            )
        return self

    @property
    def scale_up_gpus(self) -> int:
        """GPUs that reach each other over the intra-node (scale-up) link."""
        return self.nvlink_domain_gpus or self.gpus_per_node

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    @property
    def effective_bandwidth(self) -> float:
        return self.mem_bandwidth_bytes_per_s * self.memory_efficiency

    @property
    def effective_flops(self) -> float:
        return self.dense_flops_per_s * self.compute_efficiency

    @property
    def effective_fp32_flops(self) -> float:
        """Achievable float32 rate: the FP32 peak (else the dense one) at compute_efficiency."""
        return (self.fp32_flops_per_s or self.dense_flops_per_s) * self.compute_efficiency

    @property
    def effective_fp8_flops(self) -> float | None:
        """Achievable dense FP8 rate; None without FP8 tensor cores."""
        if self.fp8_flops_per_s is None:
            return None
        return self.fp8_flops_per_s * (self.fp8_compute_efficiency or self.compute_efficiency)

    @property
    def effective_fp4_flops(self) -> float | None:
        """Achievable dense FP4 rate; None without FP4 tensor cores."""
        if self.fp4_flops_per_s is None:
            return None
        return self.fp4_flops_per_s * (self.fp4_compute_efficiency or self.compute_efficiency)

    def require_price(self) -> float:
        if self.usd_per_hour is None:
            raise ConfigError(
                f"GPU {self.id} has no price; give usd_per_hour for it in a --hardware file"
            )
        return self.usd_per_hour


_GPU_ID = re.compile(r"[a-z0-9][a-z0-9._-]*")  # what --gpus lists can name


class HardwareCatalog:
    """GPU lookup by id or alias, with user overrides layered on the built-ins."""

    def __init__(self, gpus: Iterable[HardwareSpec] | None = None) -> None:
        """``gpus``, or the built-in GPUs when None."""
        if gpus is None:
            # the catalog's data module builds its entries from this module's schema
            from .gpu_catalog import BUILTIN_GPUS

            gpus = BUILTIN_GPUS
        self._gpus: dict[str, HardwareSpec] = {}
        for gpu in gpus:
            self.add(gpu)

    def add(self, gpu: HardwareSpec) -> None:
        self._gpus[gpu.id] = gpu

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._gpus)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._gpus.values())

    def resolve(self, name: str) -> str:
        key = name.strip().lower()
        if key in self._gpus:
            return key
        for gpu in self._gpus.values():
            if key in gpu.aliases:
                return gpu.id
        raise UnknownGPUError(
            f"unknown GPU {name!r}; known: {', '.join(self.ids)} (or add one with --hardware FILE)"
        )

    def get(self, name: str) -> HardwareSpec:
        return self._gpus[self.resolve(name)]

    def with_overrides(self, entries: Iterable[Mapping[str, Any]], source: str) -> HardwareCatalog:
        """A new catalog where each entry overrides fields of a GPU or adds a new one.

        Each GPU may appear once: a second entry for the same id (or alias) would silently
        replace the first.
        """
        out = HardwareCatalog(self._gpus.values())
        seen: dict[str, str] = {}
        for n, entry in enumerate(entries):
            if not isinstance(entry, Mapping) or "id" not in entry:
                raise ConfigError(f"{source}: GPU entry {n + 1} needs an 'id'")
            raw = entry["id"]
            if not isinstance(raw, str) or not raw.strip():
                raise ConfigError(
                    f"{source}: GPU entry {n + 1}: 'id' must be a non-empty string, got {raw!r}"
                )
            try:
                gpu_id = out.resolve(raw)
                merged = {**out._gpus[gpu_id].model_dump(), **entry, "id": gpu_id}
            except UnknownGPUError:
                gpu_id = raw.strip().lower()  # ids are looked up case-insensitively
                merged = {"name": raw, **entry, "id": gpu_id}
            if "usd_per_hour" in entry and "price_source" not in entry:
                # a price the file gives is the file's (the catalog's basis was for its own)
                merged["price_source"] = f"given in {source}"
            if gpu_id in seen:
                raise ConfigError(
                    f"{source}: GPU {raw!r} is given twice (also as {seen[gpu_id]!r}); "
                    "merge the two entries into one"
                )
            seen[gpu_id] = raw
            if not _GPU_ID.fullmatch(gpu_id):
                raise ConfigError(
                    f"{source}: GPU id {raw!r} may hold only letters, digits, '.', '_' and '-' "
                    "(ids are written in --gpus lists such as h100:8,a100)"
                )
            aliases = merged.get("aliases") or ()
            if not isinstance(aliases, list | tuple):
                raise ConfigError(f"{source}: GPU {raw!r}: aliases must be a list of GPU ids")
            listed: set[str] = set()
            for alias in aliases:
                key = alias.strip().lower() if isinstance(alias, str) else alias
                if not isinstance(key, str) or not _GPU_ID.fullmatch(key):
                    raise ConfigError(f"{source}: GPU {raw!r}: alias {alias!r} is not a GPU id")
                if key in listed:
                    raise ConfigError(f"{source}: GPU {raw!r}: alias {alias!r} is listed twice")
                listed.add(key)
                try:
                    owner = out.resolve(key)
                except UnknownGPUError:
                    continue
                if owner != gpu_id:
                    raise ConfigError(
                        f"{source}: GPU {raw!r}: alias {alias!r} already names {owner}; "
                        "choose another alias"
                    )
            try:
                out.add(HardwareSpec.model_validate(merged))
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                if not where:  # a rule across fields: its message names them
                    msg = validation_message(err)
                    raise ConfigError(f"{source}: GPU {entry['id']!r}: {msg}") from None
                raise ConfigError(
                    f"{source}: GPU {entry['id']!r} field {where!r}: {validation_message(err)}"
                ) from None
        return out


def load_hardware_file(path: str | Path, base: HardwareCatalog | None = None) -> HardwareCatalog:
    """Layer a TOML or JSON hardware file (``[[gpus]]`` entries) over the catalog.

    A file entry with a known id overrides only the fields it names; a new id must give every
    required field (memory_bytes, mem_bandwidth_bytes_per_s, dense_flops_per_s,
    intra_node_bandwidth_bytes_per_s, network_bandwidth_bytes_per_s).
    """
    path = Path(path)
    data = read_data_file(path, "hardware file")
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list) or not data["gpus"]:
        raise ConfigError(f"hardware file {path} needs a list 'gpus' of GPU entries")
    unknown = sorted(set(data) - {"schema_version", "gpus"})
    if unknown:
        raise ConfigError(
            f"hardware file {path}: unknown key {unknown[0]!r} (a hardware file holds "
            "schema_version and [[gpus]] entries)"
        )
    problem = schema_version_problem(
        data.get("schema_version", HARDWARE_SCHEMA_VERSION),
        HARDWARE_SCHEMA_VERSION,
        toml=path.suffix == ".toml",
    )
    if problem is not None:
        raise ConfigError(f"hardware file {path}: schema_version {problem}")
    return (base or HardwareCatalog()).with_overrides(data["gpus"], str(path))
