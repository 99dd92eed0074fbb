"""Print how fast the serving engines' own kernels run, from NVIDIA's silicon database: the
source of ``opweave.costmodel``'s kernel fractions (``kernel_rates.py``), derived by
``opweave.profiler._private.aic_fractions`` (see its header for the method). Needs the
profiler's ``aiconfigurator`` extra.

    python tools/bench/kernel_fractions.py
"""

from __future__ import annotations

from opweave.profiler import open_database
from opweave.profiler._private.aic_fractions import WIDE, TableMedian, kernel_fractions


def _table(rows: list[TableMedian], key: str) -> None:
    print(f"{'gpu':<15}{'engine':<20}{key:>10}{'n':>6}{'median':>8}{'p25':>7}{'p75':>7}")
    for r in rows:
        print(
            f"{r.gpu:<15}{r.table:<20}{r.key:>10}{r.points:>6}{r.median:>8.2f}"
            f"{r.p25:>7.2f}{r.p75:>7.2f}"
        )


def main() -> None:
    db = open_database()
    k = kernel_fractions(db)
    print(f"Fused-MoE GEMM rate / the catalog's dense GEMM rate of the format ({db.origin}),")
    print(f">= 8,192 tokens, no EP, >= {WIDE} channels of an expert per GPU")
    _table(k.moe_tables, "format")
    print("\nPer format, median over GPUs and engines (kernel_rates.GROUPED_GEMM):")
    for fmt, value in k.grouped.items():
        print(f"  {fmt:<10} {value:.2f}")
    print("\nPer GPU architecture (kernel_rates.GROUPED_GEMM_BY_ARCH):")
    for arch, formats in k.grouped_by_arch.items():
        print(f"  {arch:<10} " + ", ".join(f"{f} {v:.2f}" for f, v in formats.items()))
    print("\nNarrower slices, fraction of the wide median (kernel_rates.GROUPED_GEMM_WIDTH):")
    for width, value in k.widths.items():
        print(f"  ~{width:>3} channels: {value:.2f}")
    print("\nPrefill attention rate / the catalog's dense BF16 rate (causal, BF16, >= 4K tokens)")
    _table(k.attention_tables, "head_dim")
    print("\nPer head dimension, median over GPUs and engines (kernel_rates.PREFILL_ATTENTION):")
    for dim, value in k.prefill.items():
        print(f"  {dim:>4}  {value:.2f}")


if __name__ == "__main__":
    main()
