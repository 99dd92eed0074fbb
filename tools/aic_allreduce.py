"""Print the decode-size TP all-reduce of every NVLink system in NVIDIA's silicon database,
fitted as the GPU catalog describes it (``opweave.profiler._private.aic_allreduce``): the
source of the catalog's ``allreduce_latency_s`` / ``allreduce_bandwidth_bytes_per_s``.
Needs the profiler's ``aiconfigurator`` extra.

    python tools/aic_allreduce.py
"""

from __future__ import annotations

from opweave.profiler import open_database
from opweave.profiler._private.aic_allreduce import allreduce_fit
from opweave.profiler._private.aic_db import SYSTEMS

# catalog GPUs whose TP groups talk over NVLink (an NVSwitch, or the NVL72 domain)
NVLINK = ("a100-sxm-80gb", "h100-sxm", "h200-sxm", "b200", "b300", "gb200", "gb300")


def main() -> None:
    db = open_database()
    print(
        f"CUDA-graph all-reduce, fastest engine per size, 1 KiB-1 MiB at 2/4/8 GPUs ({db.origin})"
    )
    print(f"{'gpu':<15}{'system':<12}{'latency us':>11}{'GB/s':>7}{'max res us':>11}  tables")
    for gpu in NVLINK:
        fit = allreduce_fit(db, SYSTEMS[gpu])
        print(
            f"{gpu:<15}{fit.system:<12}{fit.latency_s * 1e6:>11.1f}"
            f"{fit.bandwidth_bytes_per_s / 1e9:>7.0f}{fit.max_residual_s * 1e6:>11.1f}  "
            f"{', '.join(fit.sources)}"
        )


if __name__ == "__main__":
    main()
