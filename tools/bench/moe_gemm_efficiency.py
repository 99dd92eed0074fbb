"""How fast the engines' fused-MoE kernels run their GEMMs, from NVIDIA's silicon database.

    python tools/bench/moe_gemm_efficiency.py        # needs the profiler's aiconfigurator extra

The source of ``opweave.costmodel``'s grouped-GEMM figures (``quantize.GROUPED_GEMM``). Reads
every fused-MoE table of aiconfigurator-core's database (``<system>/moe/<engine>/<version>/
moe_perf.parquet``, the newest version of each engine on each GPU OpWeave's catalog has) and,
for steps of at least 8,192 tokens without expert parallelism (where the GEMMs, not the weight
reads, bound the kernel), divides the FLOPs of the experts' three matmuls
(``tokens x top_k x 3 x 2 x hidden x inter / tp``) by the measured latency and by the rate
OpWeave's catalog gives a dense GEMM of that weight format on that GPU (datasheet peak times
its measured efficiency, ``precision.gemm_rate``). Prints:

- per GPU, engine and format: the median of that fraction where each GPU's slice of an expert is
  at least 512 channels wide (``inter / tp >= 512``), and its quartiles;
- per format: the median over those medians (the figure OpWeave uses);
- the fraction at narrower slices relative to the same GPU, engine and format's wide median,
  pooled, by slice width (the width factor OpWeave interpolates).

Balanced token routing where the table has it, else its mildest power law (A100).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from opweave.costmodel import default_catalog
from opweave.costmodel._private.precision import gemm_rate

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


def _tables(root: Path) -> list[tuple[str, str, Path]]:
    from opweave.profiler._private.aic_db import SYSTEMS, version_key

    found = []
    for gpu, system in SYSTEMS.items():
        for engine_dir in sorted((root / system / "moe").glob("*")):
            versions = [v for v in engine_dir.iterdir() if (v / "moe_perf.parquet").is_file()]
            if versions:
                newest = max(versions, key=lambda v: version_key(v.name))
                found.append((gpu, f"{engine_dir.name} {newest.name}", newest / "moe_perf.parquet"))
    return found


def main() -> None:
    import pyarrow.parquet as pq

    from opweave.profiler import open_database

    db = open_database()
    catalog = default_catalog()
    wide: dict[str, list[float]] = defaultdict(list)
    narrow: dict[int, list[float]] = defaultdict(list)
    print(f"Fused-MoE GEMM rate / the catalog's dense GEMM rate of the format ({db.origin})")
    print(f"{'gpu':<15}{'engine':<20}{'format':<11}{'n':>5}{'median':>8}{'p25':>7}{'p75':>7}")
    for gpu, engine, path in _tables(db.root):
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
            q = statistics.quantiles(w, n=4)
            print(f"{gpu:<15}{engine:<20}{fmt:<11}{len(w):>5}{med:>8.2f}{q[0]:>7.2f}{q[2]:>7.2f}")
            for x, f in zip(width.to_numpy(), frac, strict=True):
                if x < WIDE:
                    narrow[min(WIDTHS, key=lambda c: abs(c - x))].append(f / med)
    print("\nPer format, median over GPUs and engines (quantise.GROUPED_GEMM):")
    for fmt, meds in sorted(wide.items()):
        print(f"  {fmt:<10} {statistics.median(meds):.2f}  ({len(meds)} GPU x engine tables)")
    print("\nNarrower slices, fraction of the wide median, pooled (quantise.GROUPED_GEMM_WIDTH):")
    for c in WIDTHS:
        if narrow[c]:
            print(f"  ~{c:>3} channels: {statistics.median(narrow[c]):.2f}  (n={len(narrow[c])})")


if __name__ == "__main__":
    main()
