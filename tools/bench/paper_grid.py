"""Planner benchmark: the paper's evaluation grid (§7.2, §7.4) and search ablation (Table 3).

Grid: models gemma-3-27b and qwen3-next-80b-a3b on clusters H100, H100+L40S, H100+A100, and
deepseek-v3 (MLA, a dense prefix before its MoE block) on H200 and H200+H100; contexts 8K, 32K,
128K; a strict and a relaxed TPOT SLO. Per setting it prints the USD per million tokens
of colocated, AFD, CAD, OpWeave homogeneous and heterogeneous (the optimum of the whole space
when mixing GPU types is allowed), OpWeave's gain over the best feasible baseline, the best
plan's stages per token, inter-node bytes per token and compute occupancy, and the planner's
wall time; then means per strategy and the ablation table. Prints figures; asserts nothing.

Inventory column (OW-inv): OpWeave again, bounded to the fleet of ``INVENTORY`` (16 H100 and
8 of the second GPU type: the issue's example user), with its wall time; the means say what the
bound costs against the unbounded (scale-invariant) optimum. DeepSeek-V3's fleet is 16 H200 and
16 H100.

SLOs. Relaxed = 50 ms (20 tokens/s per request: a common interactive-chat TPOT target, several
times reading speed). Strict = 20 ms (50 tokens/s: agentic/streaming use). Every strategy can
reach 3-7 ms at batch 1 on these models, so neither SLO is infeasible outright; they decide how
far batching may go, and at 20 ms the per-stage transfer latency and bubbles of 100+-stage
fine-grained plans take a real share of the budget.

``--profiles aiconfigurator`` (the profiler's ``aiconfigurator`` extra) plans every setting again
on profiles imported from NVIDIA's silicon database for each GPU of the cluster and prints the
best plan's cost and gain beside the roofline's.

Targets on 2 cores: one setting planned in <= 10 s, the whole grid in <= 10 minutes, peak
memory < 2 GB.

``--fixed-costs off`` plans every setting on the plain roofline (the cost model's fixed costs
per kernel, per collective, per MoE expert pass and per step zeroed), to set the grid's figures
beside those of the default model.

    python tools/bench/paper_grid.py            # full grid + ablation
    python tools/bench/paper_grid.py --quick    # one setting + ablation on it
    python tools/bench/paper_grid.py --fixed-costs off --no-ablation
    python tools/bench/paper_grid.py --models deepseek-v3 --no-ablation
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from typing import Any

from opweave.costmodel import HardwareCatalog, default_catalog, load_model, without_fixed_costs
from opweave.planner import plan

CONTEXTS = {"8K": 8192, "32K": 32768, "128K": 131072}
SLOS = {"strict": 0.020, "relaxed": 0.050}
CLUSTERS = {
    "H100": ("h100",),
    "H100+L40S": ("h100", "l40s"),
    "H100+A100": ("h100", "a100"),
    "H200": ("h200",),
    "H200+H100": ("h200", "h100"),
}
# which clusters each model is planned on
MODEL_CLUSTERS = {
    "gemma-3-27b": ("H100", "H100+L40S", "H100+A100"),
    "qwen3-next-80b-a3b": ("H100", "H100+L40S", "H100+A100"),
    "deepseek-v3": ("H200", "H200+H100"),
}
MODELS = tuple(MODEL_CLUSTERS)
STRATEGIES = ("colocated", "afd", "cad", "opweave_homogeneous", "opweave_heterogeneous")
INVENTORY = {"h100": 16, "l40s": 8, "a100": 8, "h200": 16}
SHORT = {
    "colocated": "coloc",
    "afd": "AFD",
    "cad": "CAD",
    "opweave_homogeneous": "OW-hom",
    "opweave_heterogeneous": "OW-het",
}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_IMPORTED: dict[tuple[str, str], Any] = {}


def imported(model_name: str, gpu: str) -> Any:
    """A profile of ``model_name`` on ``gpu`` from NVIDIA's silicon database (memoised)."""
    from opweave.profiler import import_profile

    key = (model_name, gpu)
    if key not in _IMPORTED:
        _IMPORTED[key] = import_profile(load_model(model_name), gpu).profile
    return _IMPORTED[key]


def run_setting(
    model_name: str,
    ctx: str,
    slo: str,
    cluster: str,
    catalog: HardwareCatalog,
    profiles: str | None = None,
) -> dict[str, Any]:
    model = load_model(model_name)
    given = [imported(model_name, g) for g in CLUSTERS[cluster]] if profiles else []
    start, cpu = time.perf_counter(), time.process_time()
    result = plan(
        model,
        CLUSTERS[cluster],
        context=CONTEXTS[ctx],
        tpot_slo_s=SLOS[slo],
        catalog=catalog,
        profiles=given,
    )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    doc = result.to_json()
    row: dict[str, Any] = {
        "model": model_name,
        "context": ctx,
        "slo": slo,
        "cluster": cluster,
        "wall_s": wall,
        "cpu_s": cpu,
        "search": doc["search"],
        "plans": {},
    }
    for name in STRATEGIES:
        entry = doc["baselines"].get(name)
        row["plans"][name] = entry if entry and entry.get("strategy") else None
    base = [
        row["plans"][b]["usd_per_million_tokens"]
        for b in ("colocated", "afd", "cad")
        if row["plans"][b]
    ]
    best = doc["best"]
    row["best"] = best
    row["gain"] = (min(base) / best["usd_per_million_tokens"]) if base and best else None
    fleet = {g: INVENTORY[g] for g in CLUSTERS[cluster]}
    start = time.perf_counter()
    bounded = plan(
        model,
        CLUSTERS[cluster],
        context=CONTEXTS[ctx],
        tpot_slo_s=SLOS[slo],
        inventory=fleet,
        catalog=catalog,
        profiles=given,
    )
    row["inventory_wall_s"] = time.perf_counter() - start
    row["inventory"] = bounded.to_json()["best"]
    return row


def _best_and_gain(row: dict[str, Any]) -> str:
    best = row["best"]
    if not best:
        return "infeasible"
    gain = f"{row['gain']:.2f}x" if row["gain"] else "-"
    return f"${best['usd_per_million_tokens']:.3f} gain {gain}"


def fmt_usd(entry: dict[str, Any] | None) -> str:
    return f"{entry['usd_per_million_tokens']:.3f}" if entry else "infeas"


def print_grid(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'model':<19}{'ctx':>5} {'SLO':<8}{'cluster':<10}"
        + "".join(f"{SHORT[s]:>8}" for s in STRATEGIES)
        + f"{'OW-inv':>8}"
        + f"{'gain':>7}{'stages':>7}{'kB/tok':>8}{'occ':>6}{'sims':>6}{'wall_s':>8}"
        + f"{'cpu_s':>7}"
    )
    print(
        "USD per million tokens (OW-inv = OpWeave on at most 16 H100, 8 L40S or A100, 16 H200; "
        "gain = best feasible baseline / OpWeave; stages, inter-node kB per token and compute "
        "occupancy of OpWeave's plan)"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        best = r["best"]
        shown = [
            fmt_usd(r["plans"][s]) if s != "opweave_heterogeneous" or "+" in r["cluster"] else "-"
            for s in STRATEGIES
        ]
        cells = "".join(f"{c:>8}" for c in [*shown, fmt_usd(r["inventory"])])
        gain = f"{r['gain']:.2f}x" if r["gain"] else "-"
        extra = f"{'-':>7}{'-':>8}{'-':>6}"
        if best:
            extra = (
                f"{best['stages_per_token']:>7}"
                f"{best['internode_bytes_per_token'] / 1e3:>8.1f}"
                f"{100 * best['compute_occupancy']:>5.0f}%"
            )
        print(
            f"{r['model']:<19}{r['context']:>5} {r['slo']:<8}{r['cluster']:<10}{cells}"
            f"{gain:>7}{extra}{r['search']['simulator_calls']:>6}{r['wall_s']:>8.2f}"
            f"{r['cpu_s']:>7.2f}"
        )


def print_means(rows: list[dict[str, Any]]) -> None:
    print("\nMeans over the settings where each strategy is feasible")
    head = (
        f"{'strategy':<24}{'feasible':>9}{'stages/token':>14}{'inter-node kB/tok':>19}"
        f"{'compute occ.':>14}{'mean batch/GPU':>16}"
    )
    print(head)
    print("-" * len(head))
    for s in STRATEGIES:
        entries = [r["plans"][s] for r in rows if r["plans"].get(s)]
        total = sum(1 for r in rows if s != "opweave_heterogeneous" or "+" in r["cluster"])
        if not entries:
            print(f"{s:<24}{0:>4}/{total:<4}")
            continue
        stages = statistics.mean(e["stages_per_token"] for e in entries)
        kb = statistics.mean(e["internode_bytes_per_token"] for e in entries) / 1e3
        occ = statistics.mean(e["compute_occupancy"] for e in entries)
        batch = statistics.mean(
            sum(o["replicas"] * o["resident_batch"] for o in e["owners"])
            / sum(o["replicas"] * o["tp"] for o in e["owners"])
            for e in entries
        )
        print(
            f"{s:<24}{len(entries):>4}/{total:<4}{stages:>14.1f}{kb:>19.1f}{100 * occ:>13.0f}%"
            f"{batch:>16.1f}"
        )
    gains = [r["gain"] for r in rows if r["gain"]]
    if gains:
        print(
            f"\nOpWeave vs best feasible baseline: mean {statistics.mean(gains):.2f}x, "
            f"max {max(gains):.2f}x, min {min(gains):.2f}x over {len(gains)} settings"
        )
    bound = [
        r["inventory"]["usd_per_million_tokens"] / r["best"]["usd_per_million_tokens"]
        for r in rows
        if r["inventory"] and r["best"]
    ]
    if bound:
        print(
            f"OpWeave bounded to the inventory vs unbounded: mean {statistics.mean(bound):.3f}x, "
            f"max {max(bound):.3f}x the cost, feasible in {len(bound)}/{len(rows)} settings"
        )
    het = [
        r["plans"]["opweave_homogeneous"]["usd_per_million_tokens"]
        / r["plans"]["opweave_heterogeneous"]["usd_per_million_tokens"]
        for r in rows
        if "+" in r["cluster"]
        and r["plans"].get("opweave_heterogeneous")
        and r["plans"].get("opweave_homogeneous")
    ]
    if het:
        print(
            f"OpWeave heterogeneous vs homogeneous: mean {statistics.mean(het):.3f}x, "
            f"max {max(het):.3f}x over {len(het)} settings"
        )


def ablation(model_name: str, ctx: str, slo: str, catalog: HardwareCatalog) -> None:
    print(f"\nAblation (Table 3): {model_name}, context {ctx}, {slo} SLO ({SLOS[slo] * 1e3:g} ms)")
    head = (
        f"{'cluster':<11}{'frontier':>9}{'B&B':>5}{'sim calls':>11}{'candidates':>12}"
        f"{'frontier cut':>14}{'wall_s':>8}{'cpu_s':>7}{'same optimum':>14}"
    )
    print(head)
    print("-" * len(head))
    model = load_model(model_name)
    for cluster in ("H100", "H100+A100"):
        ref = None
        for frontier, bnb in ((True, True), (False, True), (True, False), (False, False)):
            start, cpu = time.perf_counter(), time.process_time()
            res = plan(
                model,
                CLUSTERS[cluster],
                context=CONTEXTS[ctx],
                tpot_slo_s=SLOS[slo],
                frontier_pruning=frontier,
                branch_and_bound=bnb,
                catalog=catalog,
            )
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            doc = {k: v for k, v in res.to_json().items() if k != "search"}
            ref = ref or doc
            print(
                f"{cluster:<11}{'on' if frontier else 'off':>9}{'on' if bnb else 'off':>5}"
                f"{res.search.simulator_calls:>11}{res.search.candidates:>12}"
                f"{res.search.frontier_removed:>14}{wall:>8.2f}{cpu:>7.2f}"
                f"{'yes' if doc == ref else 'NO':>14}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one setting + its ablation")
    parser.add_argument("--no-ablation", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated models of the grid (default: {','.join(MODELS)})",
    )
    parser.add_argument(
        "--fixed-costs",
        choices=("on", "off"),
        default="on",
        help="off: plan on the plain roofline (the cost model's fixed costs zeroed)",
    )
    parser.add_argument(
        "--profiles",
        choices=("aiconfigurator",),
        help="also plan every setting on profiles imported from NVIDIA's silicon database "
        "(the profiler's aiconfigurator extra) and print their gains beside the roofline's",
    )
    args = parser.parse_args()
    catalog = default_catalog()
    if args.fixed_costs == "off":
        catalog = HardwareCatalog(without_fixed_costs(gpu) for gpu in catalog)
        print("Plain roofline: every fixed cost of the cost model zeroed\n")
    settings = (
        [("gemma-3-27b", "32K", "relaxed", "H100+A100")]
        if args.quick
        else [
            (m, c, s, k)
            for m in MODELS
            if m in args.models.split(",")
            for c in CONTEXTS
            for s in SLOS
            for k in MODEL_CLUSTERS[m]
        ]
    )
    start = time.perf_counter()
    rows = [run_setting(*setting, catalog) for setting in settings]
    grid_s = time.perf_counter() - start
    print_grid(rows)
    print_means(rows)
    if args.profiles:
        side = [run_setting(*setting, catalog, args.profiles) for setting in settings]
        print("\nImported profiles (aiconfigurator) beside the roofline, same settings:")
        print(f"{'model':<20}{'ctx':>5} {'slo':<8}{'cluster':<11}{'roofline':>22}{'imported':>22}")
        for r, i in zip(rows, side, strict=True):
            print(
                f"{r['model']:<20}{r['context']:>5} {r['slo']:<8}{r['cluster']:<11}"
                f"{_best_and_gain(r):>22}{_best_and_gain(i):>22}"
            )
        gains = [(r["gain"], i["gain"]) for r, i in zip(rows, side, strict=True)]
        both = [(a, b) for a, b in gains if a and b]
        if both:
            print(
                f"mean gain over the best baseline: roofline "
                f"{statistics.mean(a for a, _ in both):.2f}x, imported "
                f"{statistics.mean(b for _, b in both):.2f}x ({len(both)} settings)"
            )
    walls = [r["wall_s"] for r in rows]
    cpus = [r["cpu_s"] for r in rows]
    inv = [r["inventory_wall_s"] for r in rows]
    print(
        f"\nPlanner time per setting: wall median {statistics.median(walls):.2f} s, mean "
        f"{statistics.mean(walls):.2f} s, max {max(walls):.2f} s (CPU mean "
        f"{statistics.mean(cpus):.2f} s, max {max(cpus):.2f} s); with the inventory: median "
        f"{statistics.median(inv):.2f} s, max {max(inv):.2f} s; whole grid ({len(rows)} "
        f"settings, both) {grid_s:.1f} s; peak RSS {peak_rss_mb():.0f} MB"
    )
    if not args.no_ablation:
        start = time.perf_counter()
        ablation("gemma-3-27b", "32K", "relaxed", catalog)
        print(f"ablation {time.perf_counter() - start:.1f} s; peak RSS {peak_rss_mb():.0f} MB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
