"""How much of a dense GEMM's rate the engines' own kernels reach, from the silicon database: the
source of the cost model's kernel fractions (``opweave.costmodel``'s ``kernel_rates.py``).

Each measured kernel's FLOPs per second is divided by the rate the GPU catalog gives a dense GEMM
of the same format on that GPU (datasheet peak times its measured efficiency,
``precision.gemm_rate``), over the newest version of each engine's table on each GPU the catalog
has:

- fused MoE (``moe_perf``), steps of at least 8,192 tokens without expert parallelism (where the
  GEMMs, not the weight reads, bound the kernel), FLOPs ``tokens x top_k x 6 x hidden x
  inter / tp``: per GPU, engine and format the median where each GPU's slice of an expert is at
  least 512 channels wide; per format the median over those (over every GPU, and per GPU
  architecture); narrower slices relative to the same table's wide median, pooled, by width.
  Balanced routing where the table has it, else its mildest power law (A100).
- prefill attention (``context_attention_perf``): causal, BF16, no window, prompts of at least
  4,096 tokens, FLOPs ``batch x heads x isl (isl + 1) / 2 x head_dim x 4``: per GPU, engine and
  head dimension the median, then per head dimension the median over those.

``tools/bench/kernel_fractions.py`` prints them; a test checks the cost model carries them.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from opweave.costmodel import GPU_ARCH, default_catalog, gemm_rate

from .aic_db import ENGINES, SYSTEMS, Database
from .aic_kernels import table_version

MIN_TOKENS = 8192
WIDE = 512
WIDTHS = (32, 64, 128, 192, 256, 384)
MIN_PROMPT = 4096
# the database's dtype names -> OpWeave weight formats (w4a16: MXFP4 weights, BF16 math)
FORMATS = {
    "bfloat16": "bf16",
    "fp8": "fp8",
    "fp8_block": "fp8-block",
    "nvfp4": "nvfp4",
    "w4a16_mxfp4": "mxfp4",
    "int4_wo": "int4-wo",
}
_MOE = ("num_tokens", "hidden_size", "inter_size", "topk", "moe_tp_size", "moe_ep_size")
_ATTN = ("batch_size", "isl", "num_heads", "head_dim")


@dataclass(frozen=True)
class TableMedian:
    """One (GPU, engine table, format or head dimension) median, with its quartiles."""

    gpu: str
    table: str  # "engine version"
    key: str  # weight format, or head dimension
    points: int
    median: float
    p25: float
    p75: float


@dataclass
class KernelFractions:
    grouped: dict[str, float] = field(default_factory=dict)
    grouped_by_arch: dict[str, dict[str, float]] = field(default_factory=dict)
    widths: dict[int, float] = field(default_factory=dict)
    prefill: dict[int, float] = field(default_factory=dict)
    moe_tables: list[TableMedian] = field(default_factory=list)
    attention_tables: list[TableMedian] = field(default_factory=list)


def _newest(db: Database, op: str, table: str) -> list[tuple[str, str, Path]]:
    """(catalog GPU, "engine version", folder) of the newest ``table`` of ``op`` per engine."""
    found = []
    for gpu, system in SYSTEMS.items():
        for engine in ENGINES:
            version = table_version(db, system, op, engine, table)
            if version is not None:
                found.append((gpu, f"{engine} {version}", db.root / system / op / engine / version))
    return found


def _median(gpu: str, table: str, key: str, values: np.ndarray) -> TableMedian:
    q = np.percentile(values, (25, 50, 75))
    return TableMedian(gpu, table, key, int(values.size), float(q[1]), float(q[0]), float(q[2]))


def kernel_fractions(db: Database) -> KernelFractions:
    """Every kernel fraction the cost model carries, from ``db`` (see the module's header)."""
    catalog = default_catalog()
    out = KernelFractions()
    wide: dict[str, list[float]] = defaultdict(list)
    by_arch: dict[tuple[str, str], list[float]] = defaultdict(list)
    narrow: dict[int, list[float]] = defaultdict(list)
    for gpu, table, folder in _newest(db, "moe", "moe_perf"):
        cols = db.read(folder, "moe_perf", (*_MOE, "distribution", "moe_dtype", "latency"))
        keep = (cols["num_tokens"] >= MIN_TOKENS) & (cols["moe_ep_size"] == 1)
        dists = set(cols["distribution"][keep].tolist())
        keep &= cols["distribution"] == ("balanced" if "balanced" in dists else "power_law_1.01")
        for dtype in sorted(set(cols["moe_dtype"][keep].tolist())):
            fmt = FORMATS.get(str(dtype))
            if fmt is None:
                continue
            rows = keep & (cols["moe_dtype"] == dtype)
            width = cols["inter_size"][rows] / cols["moe_tp_size"][rows]
            flops = cols["num_tokens"][rows] * cols["topk"][rows] * 6.0 * cols["hidden_size"][rows]
            rate = gemm_rate(fmt, catalog.get(gpu)).flops_per_s
            frac = flops * width / (cols["latency"][rows] * 1e-3) / rate
            if (width >= WIDE).sum() < 3:
                continue
            med = _median(gpu, table, fmt, frac[width >= WIDE])
            out.moe_tables.append(med)
            wide[fmt].append(med.median)
            by_arch[(GPU_ARCH[gpu], fmt)].append(med.median)
            for x, f in zip(width[width < WIDE], frac[width < WIDE], strict=True):
                narrow[min(WIDTHS, key=lambda c: abs(c - x))].append(f / med.median)
    out.grouped = {fmt: statistics.median(v) for fmt, v in sorted(wide.items())}
    for (arch, fmt), v in sorted(by_arch.items()):
        out.grouped_by_arch.setdefault(arch, {})[fmt] = statistics.median(v)
    out.widths = {c: statistics.median(narrow[c]) for c in WIDTHS if narrow[c]}
    by_dim: dict[int, list[float]] = defaultdict(list)
    for gpu, table, folder in _newest(db, "attention", "context_attention_perf"):
        cols = db.read(
            folder,
            "context_attention_perf",
            (*_ATTN, "attn_dtype", "kv_cache_dtype", "window_size", "latency"),
            defaults={"window_size": 0},
        )
        keep = (cols["isl"] >= MIN_PROMPT) & (cols["window_size"] == 0)
        keep &= (cols["attn_dtype"] == "bfloat16") & (cols["kv_cache_dtype"] == "bfloat16")
        isl = cols["isl"][keep].astype(np.float64)
        flops = cols["batch_size"][keep] * cols["num_heads"][keep] * isl * (isl + 1) / 2
        flops = flops * cols["head_dim"][keep] * 4
        frac = flops / (cols["latency"][keep] * 1e-3) / catalog.get(gpu).effective_flops
        for dim in sorted(set(cols["head_dim"][keep].tolist())):
            values = frac[cols["head_dim"][keep] == dim]
            if values.size < 3:
                continue
            med = _median(gpu, table, str(dim), values)
            out.attention_tables.append(med)
            by_dim[int(dim)].append(med.median)
    out.prefill = {dim: statistics.median(v) for dim, v in sorted(by_dim.items())}
    return out
