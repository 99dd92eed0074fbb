"""How fast the serving engines' own kernels run, from NVIDIA's silicon database.

    python tools/bench/kernel_fractions.py        # needs the profiler's aiconfigurator extra

The source of ``opweave.costmodel``'s kernel fractions (``kernel_rates.py``). Reads the
database of aiconfigurator-core (the newest version of each engine on each GPU OpWeave's catalog
has) and divides each measured kernel's FLOPs per second by the rate OpWeave's catalog gives a
dense GEMM of the same format on that GPU (datasheet peak times its measured efficiency,
``precision.gemm_rate``):

- fused MoE (``<system>/moe/<engine>/<version>/moe_perf.parquet``), steps of at least 8,192
  tokens without expert parallelism (where the GEMMs, not the weight reads, bound the kernel):
  the FLOPs of the experts' three matmuls (``tokens x top_k x 3 x 2 x hidden x inter / tp``).
  Per GPU, engine and format the median where each GPU's slice of an expert is at least 512
  channels wide, then per format the median over those (``GROUPED_GEMM``); narrower slices
  relative to the same table's wide median, pooled, by slice width (``GROUPED_GEMM_WIDTH``).
  Balanced routing where the table has it, else its mildest power law (A100).
- prefill attention (``<system>/attention/<engine>/<version>/context_attention_perf.parquet``):
  causal, BF16, no window, prompts of at least 4,096 tokens, FLOPs
  ``batch x heads x isl (isl + 1) / 2 x head_dim x 4``; per GPU, engine and head dimension
  the median, then per head dimension the median over those (``PREFILL_ATTENTION``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from opweave.costmodel import default_catalog
from opweave.costmodel._private.precision import GPU_ARCH, gemm_rate

MIN_TOKENS = 8192
WIDE = 512
WIDTHS = (32, 64, 128, 192, 256, 384)
# the database's dtype names -> OpWeave weight formats (w4a16: MXFP4 weights, BF16 math)
FORMATS = {
    "bfloat16": "bf16",
    "fp8": "fp8",
    "fp8_block": "fp8-block",
    "nvfp4": "nvfp4",
    "w4a16_mxfp4": "mxfp4",
    "int4_wo": "int4-wo",
}


def _tables(root: Path, op: str, table: str) -> list[tuple[str, str, Path]]:
    """(catalog GPU, "engine version", path) of the newest ``table`` of ``op`` per engine."""
    from opweave.profiler._private.aic_db import SYSTEMS, version_key

    found = []
    for gpu, system in SYSTEMS.items():
        for engine_dir in sorted((root / system / op).glob("*")):
            versions = [v for v in engine_dir.iterdir() if (v / table).is_file()]
            if versions:
                newest = max(versions, key=lambda v: version_key(v.name))
                found.append((gpu, f"{engine_dir.name} {newest.name}", newest / table))
    return found


def grouped_gemms(root: Path, origin: str) -> None:
    import pyarrow.parquet as pq

    catalog = default_catalog()
    wide: dict[str, list[float]] = defaultdict(list)
    by_arch: dict[tuple[str, str], list[float]] = defaultdict(list)
    narrow: dict[int, list[float]] = defaultdict(list)
    print(f"Fused-MoE GEMM rate / the catalog's dense GEMM rate of the format ({origin})")
    print(f"{'gpu':<15}{'engine':<20}{'format':<11}{'n':>5}{'median':>8}{'p25':>7}{'p75':>7}")
    for gpu, engine, path in _tables(root, "moe", "moe_perf.parquet"):
        hw = catalog.get(gpu)
        t = pq.read_table(path).to_pandas()
        t = t[(t.num_tokens >= MIN_TOKENS) & (t.moe_ep_size == 1)]
        dist = "balanced" if "balanced" in set(t.distribution) else "power_law_1.01"
        t = t[t.distribution == dist]
        for dtype, rows in t.groupby("moe_dtype"):
            fmt = FORMATS.get(str(dtype))
            if fmt is None:
                continue
            rate = gemm_rate(fmt, hw).flops_per_s
            width = rows.inter_size / rows.moe_tp_size
            flops = rows.num_tokens * rows.topk * 6.0 * rows.hidden_size * width
            frac = (flops / (rows.latency * 1e-3) / rate).to_numpy()
            is_wide = (width >= WIDE).to_numpy()
            if is_wide.sum() < 3:
                continue
            w = sorted(frac[is_wide])
            med = statistics.median(w)
            wide[fmt].append(med)
            by_arch[(GPU_ARCH[gpu], fmt)].append(med)
            q = statistics.quantiles(w, n=4)
            print(f"{gpu:<15}{engine:<20}{fmt:<11}{len(w):>5}{med:>8.2f}{q[0]:>7.2f}{q[2]:>7.2f}")
            for x, f in zip(width.to_numpy(), frac, strict=True):
                if x < WIDE:
                    narrow[min(WIDTHS, key=lambda c: abs(c - x))].append(f / med)
    print("\nPer format, median over GPUs and engines (kernel_rates.GROUPED_GEMM):")
    for fmt, meds in sorted(wide.items()):
        print(f"  {fmt:<10} {statistics.median(meds):.2f}  ({len(meds)} GPU x engine tables)")
    print("\nPer GPU architecture and format, median over its GPUs and engines:")
    for (arch, fmt), meds in sorted(by_arch.items()):
        print(f"  {arch:<10} {fmt:<10} {statistics.median(meds):.2f}  ({len(meds)} tables)")
    print(
        "\nNarrower slices, fraction of the wide median, pooled (kernel_rates.GROUPED_GEMM_WIDTH):"
    )
    for c in WIDTHS:
        if narrow[c]:
            print(f"  ~{c:>3} channels: {statistics.median(narrow[c]):.2f}  (n={len(narrow[c])})")


def prefill_attention(root: Path) -> None:
    import pyarrow.parquet as pq

    catalog = default_catalog()
    by_dim: dict[int, list[float]] = defaultdict(list)
    print("\nPrefill attention rate / the catalog's dense BF16 rate (causal, BF16, >= 4K tokens)")
    print(f"{'gpu':<15}{'engine':<20}{'head_dim':>9}{'n':>6}{'median':>8}{'p25':>7}{'p75':>7}")
    for gpu, engine, path in _tables(root, "attention", "context_attention_perf.parquet"):
        rate = catalog.get(gpu).effective_flops
        t = pq.read_table(path).to_pandas()
        keep = (t.isl >= 4096) & (t.attn_dtype == "bfloat16") & (t.kv_cache_dtype == "bfloat16")
        if "window_size" in t:
            keep &= t.window_size == 0
        t = t[keep]
        flops = t.batch_size * t.num_heads * t.isl * (t.isl + 1) / 2 * t.head_dim * 4
        frac = flops / (t.latency * 1e-3) / rate
        for dim in sorted(set(t.head_dim)):
            f = sorted(frac[t.head_dim == dim])
            if len(f) < 3:
                continue
            med = statistics.median(f)
            by_dim[int(dim)].append(med)
            q = statistics.quantiles(f, n=4)
            print(f"{gpu:<15}{engine:<20}{dim:>9}{len(f):>6}{med:>8.2f}{q[0]:>7.2f}{q[2]:>7.2f}")
    print("\nPer head dimension, median over GPUs and engines (kernel_rates.PREFILL_ATTENTION):")
    for dim, meds in sorted(by_dim.items()):
        print(f"  {dim:>4}  {statistics.median(meds):.2f}  ({len(meds)} GPU x engine tables)")


def main() -> None:
    from opweave.profiler import open_database

    db = open_database()
    grouped_gemms(db.root, db.origin)
    prefill_attention(db.root)


if __name__ == "__main__":
    main()
