"""Planner benchmark: whole deployments for a workload (``opweave plan --isl --osl ...``).

Grid: dense (qwen3-32b, llama-3.3-70b) and MoE/MLA (qwen3-30b-a3b, deepseek-v3) models, on one
GPU type and on two; workloads of a chat (1K prompts, 1K answers), a RAG/summarisation shape
(4K prompts, 1K answers) and a long-prompt shape (8K prompts, 256 answers), as closed loops of
64 and 256 clients and as Poisson arrivals; TPOT SLOs of 50 and 20 ms, with and without a
TTFT SLO. Per setting it prints the planner's wall time, the kind of the best deployment, its
cost, and the cost of each kind (aggregated, P/D, P/D + AFD, P/D + CAD, P/D + OpWeave) as a
ratio to the best; then the median and maximum wall time (target: median <= 2 s on 2 cores)
and how often each kind wins. Prints figures; asserts nothing.

    python tools/bench/deployment_plans.py           # the grid
    python tools/bench/deployment_plans.py --quick   # four settings
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

from opweave.costmodel import Lengths, Workload, load_model
from opweave.planner import KINDS, plan_deployment

MODELS = {
    "qwen3-32b": (("h100",), ("h100", "a100")),
    "llama-3.3-70b": (("h200",), ("h100", "l40s")),
    "qwen3-30b-a3b": (("h100",),),
    "deepseek-v3": (("h200",), ("b200",)),
}
SHAPES = {"chat 1K/1K": (1024, 1024), "rag 4K/1K": (4096, 1024), "long 8K/256": (8192, 256)}
ARRIVALS = {"c64": {"concurrency": 64}, "c256": {"concurrency": 256}, "r8/s": {"rate_per_s": 8.0}}
# (TPOT SLO, TTFT SLO or None) in seconds
SLOS = {"50ms": (0.050, None), "20ms+ttft2s": (0.020, 2.0)}
QUICK = [
    ("qwen3-32b", ("h100",), "rag 4K/1K", "c64", "50ms"),
    ("qwen3-32b", ("h100", "a100"), "chat 1K/1K", "r8/s", "20ms+ttft2s"),
    ("qwen3-30b-a3b", ("h100",), "long 8K/256", "c256", "50ms"),
    ("deepseek-v3", ("h200",), "rag 4K/1K", "r8/s", "50ms"),
]


def settings(quick: bool) -> list[tuple[str, tuple[str, ...], str, str, str]]:
    if quick:
        return QUICK
    return [
        (model, gpus, shape, arrival, slo)
        for model, clusters in MODELS.items()
        for gpus in clusters
        for shape in SHAPES
        for arrival in ARRIVALS
        for slo in SLOS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="four settings only")
    args = parser.parse_args()
    walls: list[float] = []
    wins: Counter[str] = Counter()
    header = f"{'model':<14} {'gpus':<10} {'workload':<12} {'arr':<5} {'SLO':<12} {'wall':>6} "
    header += f"{'best':<11} {'$/Mtok':>8} " + " ".join(f"{k:>10}" for k in KINDS)
    print(header)
    specs = {}
    for model, gpus, shape, arrival, slo in settings(args.quick):
        spec = specs.setdefault(model, load_model(model))
        isl, osl = SHAPES[shape]
        workload = Workload(isl=Lengths.fixed(isl), osl=Lengths.fixed(osl), **ARRIVALS[arrival])
        tpot, ttft = SLOS[slo]
        started = time.perf_counter()
        result = plan_deployment(spec, gpus, workload=workload, tpot_slo_s=tpot, ttft_slo_s=ttft)
        wall = time.perf_counter() - started
        walls.append(wall)
        line = f"{model:<14} {'+'.join(gpus):<10} {shape:<12} {arrival:<5} {slo:<12} {wall:6.2f} "
        best = result.best
        if best is None:
            wins["infeasible"] += 1
            print(line + "infeasible")
            continue
        wins[best.kind] += 1
        cost = best.usd_per_million_tokens
        ratios = [
            "-" if dep is None else f"{dep.usd_per_million_tokens / cost:.2f}x"
            for dep in (result.baselines[k] for k in KINDS)
        ]
        print(line + f"{best.kind:<11} {cost:8.4f} " + " ".join(f"{r:>10}" for r in ratios))
    print()
    print(
        f"planner wall time per setting: median {statistics.median(walls):.2f} s, "
        f"max {max(walls):.2f} s over {len(walls)} settings (target: median <= 2 s)"
    )
    print("best kind: " + ", ".join(f"{k} {n}" for k, n in wins.most_common()))


if __name__ == "__main__":
    main()
