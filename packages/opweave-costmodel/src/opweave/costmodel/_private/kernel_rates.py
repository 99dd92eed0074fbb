"""How much of a dense GEMM's rate the serving engines' own kernels reach (NVIDIA measures).

A roofline runs every FLOP at the rate a large dense GEMM reaches (``HardwareSpec``'s measured
efficiencies). Two kinds of kernels the engines run stay well below it, and NVIDIA's silicon
database (aiconfigurator-core 0.12.0, Apache-2.0: per GPU from A100 to GB300, per engine and
version, kernel latencies at many shapes) measures by how much. Every figure below is a median
over its GPUs and engines (the newest version of vLLM, SGLang and TensorRT-LLM on each), derived
by the profiler's ``aic_fractions.py`` (printed by ``tools/bench/kernel_fractions.py``, checked
against the tested release by tests/profiler/test_aiconfigurator.py), not fitted to any serving
measurement. They apply on a device that runs the engines' GPU kernels
(``HardwareSpec.engine_kernels``), not on a CPU rank.
"""

from __future__ import annotations

import itertools
import math

from .hardware import HardwareSpec
from .model import OperatorSpec
from .precision import GPU_ARCH, gemm_rate

# [AIC-MOE] The engines' fused-MoE kernels (vLLM's and SGLang's Triton fused_moe, DeepGEMM's and
# FlashInfer's grouped GEMMs, TensorRT-LLM's CUTLASS MoE) run the routed experts' GEMMs well below
# the rate a dense GEMM of the same format reaches: each expert's GEMM is small, its tokens are
# gathered and scattered, and block-scaled formats dequantise per tile. NVIDIA's silicon database
# (aiconfigurator-core 0.12.0, moe_perf tables of vLLM 0.14-0.24, SGLang 0.5.10-0.5.14 and
# TensorRT-LLM 1.0-1.3 on A100 to GB300) measures these kernels; at 8,192 tokens and more, with
# each GPU's slice of an expert at least 512 channels wide, the median over GPUs and engines of
# (FLOPs / latency) / the catalog's dense rate of the format is below (weight-only formats: of
# the dense BF16 rate they run at), per GPU architecture where the database has it (Hopper's
# kernels reach more of their rate than Blackwell's block-FP8 ones), over every GPU otherwise.
# Narrower slices (an expert's channels split over many TP GPUs) fall further: the pooled median
# at each width, relative to the wide figure of the same GPU, engine and format.
GROUPED_GEMM = {
    "bf16": 0.51,
    "fp8": 0.46,
    "fp8-block": 0.24,
    "nvfp4": 0.31,
    "mxfp4": 0.31,
    "int4-wo": 0.38,
}
GROUPED_GEMM_BY_ARCH = {
    "ampere": {"bf16": 0.33, "int4-wo": 0.51},
    "hopper": {"bf16": 0.60, "fp8": 0.44, "fp8-block": 0.36, "mxfp4": 0.43, "int4-wo": 0.30},
    "ada": {"bf16": 0.55, "fp8": 0.44, "fp8-block": 0.42, "mxfp4": 0.54, "int4-wo": 0.54},
    "blackwell": {
        "bf16": 0.49,
        "fp8": 0.47,
        "fp8-block": 0.23,
        "nvfp4": 0.31,
        "mxfp4": 0.30,
        "int4-wo": 0.38,
    },
}
GROUPED_GEMM_WIDTH = ((32, 0.12), (64, 0.25), (128, 0.42), (192, 0.45), (256, 0.60), (384, 0.70))
GROUPED_GEMM_WIDE = 512


def grouped_gemm_fraction(op: OperatorSpec, hw: HardwareSpec, channels: float) -> float:
    """The fraction of its format's dense GEMM rate ``op``'s routed-expert GEMMs reach on
    ``hw`` ([AIC-MOE]), where each GPU holds ``channels`` of an expert's intermediate channels
    (interpolated in log2 between the measured widths); 1 for any other operator, or on a
    device whose experts do not run as fused-MoE kernels (``HardwareSpec.engine_kernels``).

    >>> from opweave.costmodel import default_catalog, load_model
    >>> experts = next(o for o in load_model("qwen3-235b-a22b").operators if o.moe)
    >>> h100 = default_catalog().get("h100")
    >>> grouped_gemm_fraction(experts, h100, 1536), grouped_gemm_fraction(experts, h100, 192)
    (0.6, 0.27)
    """
    if op.moe is None or not hw.engine_kernels:
        return 1.0
    fmt = op.weight_format or "bf16"
    if fmt not in ("mxfp4", "int4-wo") and gemm_rate(fmt, hw).path.startswith("weight-only"):
        fmt = "int4-wo"  # a format run weight-only here (FP8 on A100): the measured W4A16 path
    measured = GROUPED_GEMM_BY_ARCH.get(GPU_ARCH.get(hw.id, ""), {})
    base = measured.get(fmt, GROUPED_GEMM.get(fmt, GROUPED_GEMM["bf16"]))
    if channels >= GROUPED_GEMM_WIDE or channels <= 0:
        return base
    points = (*GROUPED_GEMM_WIDTH, (GROUPED_GEMM_WIDE, 1.0))
    if channels <= points[0][0]:
        return base * points[0][1] * channels / points[0][0]
    for (w0, f0), (w1, f1) in itertools.pairwise(points):
        if channels <= w1:
            t = math.log2(channels / w0) / math.log2(w1 / w0)
            return base * (f0 + t * (f1 - f0))
    return base


# [AIC-ATTN] Prefill ("context") attention: FlashAttention 3 and FlashInfer (vLLM, SGLang),
# TensorRT-LLM's FMHA, FlashMLA and the MLA prefill kernels, causal over prompts of 4,096 tokens
# and more, without a window, BF16. (FLOPs / latency) / the catalog's dense BF16 rate, median over
# GPUs and engines, by head dimension: the database measures 64, 128, 256 (standard heads), 192
# (MLA's prefill, 128 + 64 rope) and 512 (MLA's latent). A head width between takes the nearest
# measured one (in log2).
PREFILL_ATTENTION = {64: 0.50, 128: 0.70, 192: 0.51, 256: 0.70, 512: 0.45}


def prefill_attention_fraction(head_dim: float, hw: HardwareSpec) -> float:
    """The fraction of the dense BF16 rate causal prefill attention over heads ``head_dim``
    wide reaches on ``hw`` ([AIC-ATTN]); 1 off the engines' kernels or without a width.

    >>> from opweave.costmodel import default_catalog
    >>> h100 = default_catalog().get("h100")
    >>> prefill_attention_fraction(64, h100), prefill_attention_fraction(576, h100)
    (0.5, 0.45)
    """
    if not hw.engine_kernels or head_dim <= 0:
        return 1.0
    nearest = min(PREFILL_ATTENTION, key=lambda d: abs(math.log2(d / head_dim)))
    return PREFILL_ATTENTION[nearest]
