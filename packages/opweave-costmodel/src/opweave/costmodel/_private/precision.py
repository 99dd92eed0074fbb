"""Precision: the weight format a checkpoint stores, the KV-cache dtype, and the GEMM rate a
format gets on a GPU.

A weight format is a byte layout of one matmul weight (values, scales, zero points) and a
compute path. Every layout here is the one the serving engine holds in GPU memory, so that
``weight_bytes`` stays the resident bytes. Sources, cited by key below:

  [FP8-VLLM] vLLM ``Fp8LinearMethod`` (model_executor/layers/quantization/fp8.py): FP8 E4M3
  weights; per-tensor ``weight_scale`` float32 (``input_scale`` float32 too with
  ``activation_scheme: static``); block-quantised checkpoints' ``weight_scale_inv`` held as a
  float32 grid of ``ceil(out/bn) x ceil(in/bk)`` (``create_fp8_scale_parameter``).
  [DSV3] DeepSeek-V3 Technical Report, §3.3.2: 128x128 block-wise weight scaling (the
  ``weight_block_size: [128, 128]`` that DeepSeek, Qwen and MiniMax FP8 checkpoints carry).
  [NVFP4] NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference"
  (developer blog, 2025-06): FP4 E2M1 values, one FP8 E4M3 scale per 16 values and an FP32
  per-tensor scale; vLLM ``ModelOptNvFp4LinearMethod`` (quantization/modelopt.py) holds
  ``weight`` uint8 ``[out, in/2]``, ``weight_scale`` float8 ``[out, in/16]``, and float32
  ``weight_scale_2`` and ``input_scale`` per tensor.
  [OCP-MX] OCP Microscaling Formats (MX) Specification v1.0: MXFP4 = FP4 E2M1 values in blocks
  of 32 sharing one E8M0 (8-bit) scale, as gpt-oss stores its experts (``*_blocks`` and
  ``*_scales`` uint8 tensors; 4.25 bits per parameter, OpenAI's gpt-oss model card).
  [AWQ] AutoAWQ ``WQLinear_GEMM``: ``qweight`` int32 ``[in, out/8]``, ``qzeros`` int32
  ``[in/g, out/8]``, ``scales`` fp16 ``[in/g, out]``.
  [GPTQ] vLLM ``GPTQLinearMethod``: ``qweight`` int32 ``[in/8, out]``, ``qzeros`` int32
  ``[in/g, out/8]``, ``scales`` fp16 ``[in/g, out]``, ``g_idx`` int32 ``[in]``.
  [CT] compressed-tensors ``_initialize_scale_zero_point`` (quantization/lifecycle/
  initialize.py): scales in the weight's dtype (FP8 E4M3 with an FP32 global scale for FP4);
  its pack-quantized INT4 ``weight_packed`` int32 ``[out, in/8]`` + ``weight_shape`` int64[2],
  zero points saved only for asymmetric schemes, ``weight_g_idx`` int32 ``[in]`` with group
  activation ordering.

Compute paths (:func:`gemm_rate`): FP8 weights run W8A8 on FP8 tensor cores where the GPU has
them, else weight-only: FP8 bytes, dequantised to BF16 math in the kernel ([FP8-DOC] vLLM docs,
"FP8 W8A8": compute capability >= 8.9 runs W8A8, >= 7.5 runs weight-only W8A16 with FP8
Marlin). NVFP4 runs W4A4 on FP4 tensor cores, else weight-only through Marlin ([MO-DOC] vLLM
docs, "NVIDIA Model Optimizer": "on GPUs without a supported native FP4 GEMM kernel, vLLM falls
back to weight-only (W4A16) execution via Marlin"). MXFP4 runs weight-only everywhere: vLLM's
MXFP4 MoE backends in their default order all take BF16 activations ([MXFP4-VLLM]
fused_moe/oracle/mxfp4.py ``select_mxfp4_moe_backend``: SM90/SM100 FlashInfer MXFP4xBF16 first,
MXFP8 activations only on request). INT4 weight-only is BF16 math by definition.
"""

from __future__ import annotations

import fnmatch
import math
import re
from functools import cached_property
from typing import Literal, get_args

from pydantic import Field

from ..errors import ConfigError, UnsupportedPrecisionError
from .base import Frozen
from .hardware import HardwareSpec

WeightFormat = Literal["bf16", "fp16", "fp32", "fp8", "fp8-block", "nvfp4", "mxfp4", "int4-wo"]
KvCacheDtype = Literal["bf16", "fp16", "fp32", "fp8"]
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
# what --quant takes: "bf16" leaves the weights unquantised, in the model's dtype
QUANT_CHOICES = ("bf16", "fp8", "fp8-block", "nvfp4", "mxfp4", "int4-wo", "fp16", "fp32")
KV_CACHE_CHOICES = ("auto", "fp8")
# The label of unquantised weights by compute dtype; the legacy whole-model ``dtype`` override
# float8_e4m3fn (every tensor in FP8, a model dtype, not a quantisation) is labelled fp8.
UNQUANTISED: dict[str, KvCacheDtype] = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "float8_e4m3fn": 1.0}
FP8_BYTES = 1.0


class WeightScheme(Frozen):
    """How one quantised matmul weight of ``out x in`` is stored: values, scales and zeros.

    A scale covers ``scale_rows`` output rows by ``scale_cols`` input columns (None: the whole
    extent): per-tensor is (None, None), per-channel (1, None), group-``g`` (1, g), block
    (128, 128).

    >>> fp8_block_scheme().linear_bytes(in_features=256, out_features=384)  # 98304 + 6 x 4
    98328.0
    """

    format: WeightFormat
    value_bits: int = Field(ge=1, le=16)
    scale_rows: int | None = Field(default=None, ge=1)
    scale_cols: int | None = Field(default=None, ge=1)
    scale_bytes: float = Field(ge=0)
    zero_bytes: float = Field(default=0.0, ge=0, description="Per scale (asymmetric schemes).")
    tensor_bytes: int = Field(default=0, ge=0, description="Per tensor: global/input scales.")
    index_bytes_per_input: int = Field(default=0, ge=0, description="GPTQ-style g_idx.")
    weight_only: bool = Field(
        default=False,
        description="Activations stay in the compute dtype (e.g. ModelOpt W4A16_NVFP4): the "
        "weights are dequantised into compute-dtype math, whatever tensor cores the GPU has.",
    )

    def scales(self, in_features: int, out_features: int) -> int:
        rows = 1 if self.scale_rows is None else math.ceil(out_features / self.scale_rows)
        cols = 1 if self.scale_cols is None else math.ceil(in_features / self.scale_cols)
        return rows * cols

    def linear_bytes(self, in_features: int, out_features: int) -> float:
        """Resident bytes of one ``out_features x in_features`` weight in this scheme."""
        values = in_features * out_features * self.value_bits / 8
        scales = self.scales(in_features, out_features) * (self.scale_bytes + self.zero_bytes)
        return values + scales + self.tensor_bytes + self.index_bytes_per_input * in_features


def fp8_tensor_scheme(*, static_input: bool = False, per_channel: bool = False) -> WeightScheme:
    """FP8 E4M3 with an FP32 scale per tensor (or per output row) [FP8-VLLM]."""
    return WeightScheme(
        format="fp8",
        value_bits=8,
        scale_rows=1 if per_channel else None,
        scale_bytes=4.0,
        tensor_bytes=4 if static_input else 0,
    )


def fp8_block_scheme(rows: int = 128, cols: int = 128) -> WeightScheme:
    """FP8 E4M3 with one FP32 scale per ``rows x cols`` block [DSV3] [FP8-VLLM]."""
    return WeightScheme(
        format="fp8-block", value_bits=8, scale_rows=rows, scale_cols=cols, scale_bytes=4.0
    )


def nvfp4_scheme(group: int = 16) -> WeightScheme:
    """FP4 E2M1, an FP8 E4M3 scale per ``group`` values, FP32 weight and input scales [NVFP4]."""
    return WeightScheme(
        format="nvfp4",
        value_bits=4,
        scale_rows=1,
        scale_cols=group,
        scale_bytes=1.0,
        tensor_bytes=8,
    )


def mxfp4_scheme() -> WeightScheme:
    """FP4 E2M1 with an E8M0 scale per 32 values [OCP-MX]."""
    return WeightScheme(format="mxfp4", value_bits=4, scale_rows=1, scale_cols=32, scale_bytes=1.0)


def int4_scheme(
    group: int | None,
    *,
    scale_bytes: float = 2.0,
    zeros: bool = False,
    g_idx: bool = False,
    tensor_bytes: int = 0,
) -> WeightScheme:
    """INT4 weight-only: packed values, a scale (and a packed 4-bit zero) per group of ``group``
    input columns (None: per output channel) [AWQ] [GPTQ] [CT]."""
    return WeightScheme(
        format="int4-wo",
        value_bits=4,
        scale_rows=1,
        scale_cols=group,
        scale_bytes=scale_bytes,
        zero_bytes=0.5 if zeros else 0.0,
        tensor_bytes=tensor_bytes,
        index_bytes_per_input=4 if g_idx else 0,
    )


class QuantRule(Frozen):
    """A scheme and the linears it applies to: ``Linear`` (every quantisable linear), or module
    patterns as :func:`module_matches` reads them."""

    targets: tuple[str, ...] = ("Linear",)
    scheme: WeightScheme


class Precision(Frozen):
    """The weight formats and KV-cache dtype one model is served in, and where they came from.

    ``rules`` quantise the model's linears (first match wins; none: unquantised); ``ignore``
    keeps modules in the compute dtype. Whatever the rules, routers and gates, embeddings,
    norms and biases stay in the compute dtype, and ``lm_head`` too unless the method's
    convention quantises it (``lm_head``).
    """

    compute_dtype: str = "bfloat16"
    rules: tuple[QuantRule, ...] = ()
    ignore: tuple[str, ...] = Field(default=(), description="Module patterns left unquantised.")
    lm_head: bool = Field(default=False, description="The method quantises lm_head.")
    experts_only: bool = Field(default=False, description="Only routed experts are quantised.")
    method: str = Field(default="", description="Quantisation method, as the engine names it.")
    source: str = Field(default="unquantised checkpoint", description="Where it was read.")
    kv_fp8: bool = Field(default=False, description="The KV cache is held in FP8 E4M3.")
    kv_source: str = "the model's dtype"

    @property
    def quant(self) -> str:
        """The weight format, as ``--quant`` names it (``a+b`` when rules differ)."""
        formats = sorted({r.scheme.format for r in self.rules})
        return "+".join(formats) if formats else UNQUANTISED.get(self.compute_dtype, "fp8")

    @property
    def quantized(self) -> bool:
        return bool(self.rules)

    @property
    def kv_cache_dtype(self) -> KvCacheDtype:
        return "fp8" if self.kv_fp8 else UNQUANTISED.get(self.compute_dtype, "fp8")

    @property
    def dtype_bytes(self) -> float:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def kv_bytes_per_value(self) -> float:
        return FP8_BYTES if self.kv_fp8 else self.dtype_bytes

    def describe(self) -> str:
        """``weights fp8-block (config.json quantization_config ...), KV cache fp8 (...)``."""
        weights = f"weights {self.quant} ({self.source})"
        return f"{weights}, KV cache {self.kv_cache_dtype} ({self.kv_source})"

    @cached_property
    def _ignore(self) -> _Patterns:
        return _Patterns(self.ignore)

    @cached_property
    def _targets(self) -> tuple[tuple[_Patterns | None, WeightScheme], ...]:
        return tuple(
            (None if "Linear" in r.targets else _Patterns(r.targets), r.scheme) for r in self.rules
        )

    def scheme_for(
        self, paths: tuple[str, ...], *, router: bool, expert: bool
    ) -> WeightScheme | None:
        """The scheme of the linear at checkpoint ``paths`` (its names), or None: unquantised."""
        if not self.rules or router or (self.experts_only and not expert):
            return None
        if paths[0] == "lm_head" and not self.lm_head:
            return None
        if any(self._ignore.match(p) for p in paths):
            return None
        for targets, scheme in self._targets:
            if targets is None or any(targets.match(p) for p in paths):
                return scheme
        return None


# -- module names ---------------------------------------------------------------------------
# Multimodal checkpoints prefix the text model; the patterns are matched against the text
# model's own names.
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.", ""),
)


def _normalise(pattern: str) -> str:
    for old, new in _PREFIXES:
        if pattern.startswith(old):
            return new + pattern[len(old) :]
    return pattern


# A group holding a repeat that is itself repeated, ``(.*)*``: Python's backtracking matcher
# can take exponential time on a name it does not match.
_NESTED_REPEAT = re.compile(r"\((?:[^()\\]|\\.)*[*+}](?:[^()\\]|\\.)*\)[*+{]")


def _compile(pattern: str) -> re.Pattern[str]:
    """A checkpoint's ``re:`` module pattern, compiled; a bad one is a :class:`ConfigError`."""
    body = pattern[3:]
    if _NESTED_REPEAT.search(body):
        raise ConfigError(
            f"module pattern {pattern!r} repeats a group that itself repeats, which can take "
            "exponential time to match; simplify it"
        )
    try:
        return re.compile(body)
    except re.error as exc:
        raise ConfigError(
            f"module pattern {pattern!r} is not a valid regular expression ({exc})"
        ) from None


class _Patterns:
    """A list of module patterns, compiled once (checkpoints list hundreds)."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self.plain: set[str] = set()
        self.wild: list[str] = []
        self.regex: list[re.Pattern[str]] = []
        for p in patterns:
            if p.startswith("re:"):
                self.regex.append(_compile(p))
            elif any(c in p for c in "*?["):
                self.wild.append(_normalise(p))
            else:
                self.plain.add(_normalise(p))

    def match(self, path: str) -> bool:
        return module_matches(self, path)


def module_matches(patterns: _Patterns | tuple[str, ...], path: str) -> bool:
    """Whether a module name matches a pattern list, with the conventions checkpoints use:

    - a plain name matches whole dotted components anywhere in the path, and its subtree
      (``gate`` matches ``model.layers.0.mlp.gate``, not ``mlp.gate_proj``; ``lm_head`` matches
      ``lm_head``), as transformers' ``modules_to_not_convert`` and vLLM's exact names do;
    - a pattern with ``*``/``?``/``[`` is an fnmatch wildcard over the path or one of its
      parents (ModelOpt ``exclude_modules``: ``model.layers.61*``; gpt-oss
      ``model.layers.*.self_attn``), as vLLM's ``ModelOptQuantConfigBase.is_layer_excluded``;
    - ``re:<regex>`` is matched from the start of the path (compressed-tensors ``ignore`` and
      ``targets``, vLLM ``_is_equal_or_regex_match``).

    >>> module_matches(("gate", "re:.*lm_head"), "model.layers.3.mlp.gate")
    True
    >>> module_matches(("gate",), "model.layers.3.mlp.gate_proj")
    False
    >>> module_matches(("model.layers.*.self_attn",), "model.layers.3.self_attn.q_proj")
    True
    """
    pats = patterns if isinstance(patterns, _Patterns) else _Patterns(patterns)
    parts = path.split(".")
    n = len(parts)
    if pats.plain and any(
        ".".join(parts[i:j]) in pats.plain for i in range(n) for j in range(i + 1, n + 1)
    ):
        return True
    if pats.wild:
        parents = [".".join(parts[:j]) for j in range(1, n + 1)]
        if any(fnmatch.fnmatchcase(q, w) for w in pats.wild for q in parents):
            return True
    return any(r.match(path) for r in pats.regex)


def exact_pattern(name: str) -> str:
    """A plain module name as a pattern that matches that one module, not its subtree: how
    compressed-tensors checkpoints mean their ``ignore`` entries and vLLM matches them (equal
    name, or ``re:``: ``compressed_tensors/utils.py``, ``should_ignore_layer``). An ignored
    ``linear_attn`` leaves its ``in_proj_qkv`` quantised, as the checkpoint stores it. ``re:``
    patterns are kept.

    >>> exact = exact_pattern("model.language_model.layers.0.linear_attn")
    >>> module_matches((exact,), "model.layers.0.linear_attn.out_proj")
    False
    >>> module_matches((exact_pattern("lm_head"),), "lm_head")
    True
    """
    if name.startswith("re:"):
        return name
    return f"re:{re.escape(_normalise(name))}$"


# -- compute ----------------------------------------------------------------------------------
# Architecture of the catalog's GPU ids (and those the catalog adds for Blackwell racks and the
# H20 / RTX PRO 6000): what an engine's kernels key on. Other ids (a --hardware entry) run
# every format at the rates their fields give.
GPU_ARCH: dict[str, str] = {
    "a100-sxm-80gb": "ampere",
    "a100-sxm-40gb": "ampere",
    "h100-sxm": "hopper",
    "h100-pcie": "hopper",
    "h200-sxm": "hopper",
    "h20": "hopper",
    "l40s": "ada",
    "l4": "ada",
    "b200": "blackwell",
    "b300": "blackwell",
    "gb200": "blackwell",
    "gb300": "blackwell",
    "rtx-pro-6000": "blackwell",
    "mi300x": "cdna3",
}

# (quantisation method, architecture) pairs vLLM refuses, with why. ModelOpt's per-tensor FP8
# needs compute capability 8.9 (``ModelOptFp8Config.get_min_capability`` = 89: no FP8 Marlin
# fallback, unlike ``fp8`` checkpoints), and ROCm builds do not list the ``modelopt`` method
# (vllm/platforms/rocm.py ``RocmPlatform.supported_quantization``; its NVFP4 checkpoints load
# through ``petit_nvfp4`` instead). NVFP4, MXFP4, FP8 and INT4 checkpoints otherwise run on every
# architecture above: MI300X lists ``mxfp4``, ``petit_nvfp4``, ``fp8``, ``awq``, ``gptq`` and
# ``compressed-tensors``, and Ampere runs FP8, NVFP4 and MXFP4 through Marlin kernels.
UNSUPPORTED: dict[tuple[str, str], str] = {
    ("modelopt-fp8", "ampere"): "vLLM's ModelOpt FP8 kernels need compute capability 8.9 "
    "(Ada, Hopper, Blackwell)",
    ("modelopt-fp8", "cdna3"): "vLLM's ROCm build does not load ModelOpt FP8 checkpoints",
    ("modelopt-mixed", "ampere"): "vLLM's ModelOpt FP8 kernels (of its FP8 layers) need compute "
    "capability 8.9 (Ada, Hopper, Blackwell)",
    ("modelopt-mixed", "cdna3"): "vLLM's ROCm build does not load ModelOpt mixed-precision "
    "checkpoints",
}


class GemmRate(Frozen):
    """The rate a GEMM of one weight format reaches on one GPU, and the path it takes."""

    flops_per_s: float = Field(
        description="Effective: the format's datasheet peak x its measured efficiency (the FP8 or "
        "FP4 one where the catalog has it, else compute_efficiency)."
    )
    path: str


# Formats with a tensor-core path of their own: the HardwareSpec rate it runs at where the GPU
# has such tensor cores (else the weight-only path at the dense rate), and the path's name.
_TENSOR_PATHS = {
    "fp8": ("effective_fp8_flops", "fp8 tensor cores (W8A8)"),
    "fp8-block": ("effective_fp8_flops", "fp8 tensor cores (W8A8)"),
    "nvfp4": ("effective_fp4_flops", "fp4 tensor cores (W4A4)"),
}


def gemm_rate(fmt: str, hw: HardwareSpec, method: str = "", math: str = "bf16") -> GemmRate:
    """The FLOP/s a GEMM with ``fmt`` weights (quantised by ``method``) runs at on ``hw``, and
    its path; :class:`UnsupportedPrecisionError` where ``hw`` cannot run it at all. A format
    without tensor cores of its own is dequantised to the model's ``math`` dtype (BF16 and FP16
    run at the same dense rate).

    >>> from opweave.costmodel import default_catalog
    >>> a100 = default_catalog().get("a100")
    >>> gemm_rate("fp8", a100).path  # no FP8 tensor cores
    'weight-only: fp8 weights dequantised to bf16 math'
    >>> h100 = default_catalog().get("h100")  # 1979 dense FP8 TFLOPS at 71%, 989 BF16 at 80%
    >>> round(gemm_rate("fp8-block", h100).flops_per_s / gemm_rate("bf16", h100).flops_per_s, 2)
    1.78
    """
    if fmt not in WEIGHT_FORMATS:
        raise UnsupportedPrecisionError(
            f"unknown weight format {fmt!r}; use one of {', '.join(WEIGHT_FORMATS)}"
        )
    why = UNSUPPORTED.get((method, GPU_ARCH.get(hw.id, "")))
    if why is not None:
        raise UnsupportedPrecisionError(f"{fmt} weights ({method}) cannot run on {hw.id}: {why}")
    field, path = _TENSOR_PATHS.get(fmt, ("", ""))
    rate = getattr(hw, field) if field else None
    if rate is not None:
        return GemmRate(flops_per_s=rate, path=path)
    if fmt == "fp32":
        where = "no tensor cores" if hw.fp32_flops_per_s else "the device's dense rate"
        return GemmRate(flops_per_s=hw.effective_fp32_flops, path=f"fp32 math ({where})")
    if fmt in UNQUANTISED.values():
        return GemmRate(flops_per_s=hw.effective_flops, path=f"{fmt} tensor cores")
    dense = hw.effective_fp32_flops if math == "fp32" else hw.effective_flops
    return GemmRate(
        flops_per_s=dense, path=f"weight-only: {fmt} weights dequantised to {math} math"
    )


def check_runs(precision: Precision, hw: HardwareSpec) -> str:
    """The GEMM path(s) ``precision`` takes on ``hw``; :class:`UnsupportedPrecisionError` when
    ``hw`` cannot run it at all (naming both).

    >>> from opweave.costmodel import default_catalog
    >>> check_runs(Precision(), default_catalog().get("h100"))
    'bf16 tensor cores'
    """
    formats = sorted({r.scheme.format for r in precision.rules if not r.scheme.weight_only})
    weight_only = sorted({r.scheme.format for r in precision.rules if r.scheme.weight_only})
    if not formats and not weight_only:
        formats = [precision.quant]
    math = UNQUANTISED.get(precision.compute_dtype, "bf16")
    try:
        paths = [gemm_rate(f, hw, precision.method, math).path for f in formats]
        if weight_only:
            gemm_rate(weight_only[0], hw, precision.method)  # the method runs here at all
        paths += [f"weight-only: {f} weights dequantised to {math} math" for f in weight_only]
        return "; ".join(paths)
    except UnsupportedPrecisionError as exc:
        why = str(exc).split(": ", 1)[-1]
        raise UnsupportedPrecisionError(
            f"{precision.quant} weights ({precision.source}) cannot run on {hw.id}: {why}; "
            "choose another GPU or checkpoint"
        ) from None
