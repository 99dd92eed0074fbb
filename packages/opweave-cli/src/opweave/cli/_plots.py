"""Figures: ``opweave analyze --plot`` (cost per token and ODS gains against context length) and
``opweave plan --plot`` (the cost vs TPOT frontier of an SLO sweep)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from opweave.costmodel import Analysis

__all__ = ["plot_analysis", "plot_frontier"]

_FRONTIER_STYLE = {
    "opweave": ("OpWeave", "black", "o"),
    "colocated": ("colocated", "tab:blue", "s"),
    "afd": ("AFD (attention-FFN disaggregation)", "tab:orange", "^"),
    "cad": ("CAD (core-attention disaggregation)", "tab:green", "v"),
}

_HET_COLOR = "black"
_LINEAR_GAIN_LIMIT = 5.0  # above this bound G_het (near 1) would be flattened: use a log axis


def _tokens(value: float, _pos: object = None) -> str:
    """Tick label for a token count: 512, 4K, 128K, 1M."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def plot_analysis(analysis: Analysis, path: str | Path) -> Path:
    """Write a two-panel PNG of an :func:`~opweave.costmodel.analyze` result to ``path``.

    Top: USD per million tokens of colocated serving (solid) and homogeneous ODS (dashed) per
    GPU type, and heterogeneous ODS (black) when two types were analysed. Bottom: the gains
    G_hom per GPU type and G_het, with each type's bound M/(M - W) as a dotted horizontal line.
    Contexts where colocation cannot hold one request are left blank (NaN), not dropped.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    order = np.argsort(analysis.contexts, kind="stable")
    s = analysis.contexts[order]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (cost_ax, gain_ax) = plt.subplots(
        2, 1, figsize=(9, 8.5), sharex=True, constrained_layout=True
    )
    het = analysis.heterogeneous
    for i, g in enumerate(analysis.gpus):
        color = colors[i % len(colors)]
        label = f"{g.gpu} x{g.tp}"
        cost_ax.plot(s, g.cost_colocated[order], color=color, lw=2, label=f"colocated, {label}")
        cost_ax.plot(
            s,
            g.cost_homogeneous[order],
            color=color,
            lw=2,
            ls="--",
            label=f"homogeneous ODS, {label}",
        )
        gain_ax.plot(s, g.gain_homogeneous[order], color=color, lw=2, label=f"$G_{{hom}}$, {label}")
        gain_ax.axhline(
            g.bound, color=color, lw=1.2, ls=":", label=f"bound $M/(M-W)$ = {g.bound:.3g}, {label}"
        )
        if g.feasible.any() and not g.feasible.all():  # mark where colocation stops fitting
            last = float(s[g.feasible[order]].max())
            cost_ax.axvline(last, color=color, lw=0.8, alpha=0.5)
            gain_ax.axvline(
                last,
                color=color,
                lw=0.8,
                alpha=0.5,
                label=f"longest context colocation fits, {label}",
            )
    if het is not None:
        cost_ax.plot(
            s,
            het.cost_heterogeneous[order],
            color=_HET_COLOR,
            lw=2.5,
            label=f"heterogeneous ODS (attention: {het.attention_gpu}, GEMMs: {het.gemm_gpu})",
        )
        gain_ax.plot(
            s,
            het.gain_heterogeneous[order],
            color=_HET_COLOR,
            lw=2.5,
            label="$G_{het}$ (vs best homogeneous ODS)",
        )
        if het.peak_gain is not None and het.crossing_context_tokens is not None:
            gain_ax.plot(
                [het.crossing_context_tokens],
                [het.peak_gain],
                marker="o",
                color=_HET_COLOR,
                ls="none",
                label=f"$G_{{het}}$ peak {het.peak_gain:.3f}",
            )

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, ScalarFormatter

    cost_ax.set_xscale("log", base=2)
    cost_ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
    cost_ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
    # Keep the whole requested range on the axis, infeasible contexts included.
    cost_ax.set_xlim(float(s[0]) / 1.15, float(s[-1]) * 1.15)
    cost_ax.set_yscale("log")
    cost_ax.set_ylabel("decode cost (USD per million tokens)")
    cost_ax.set_title(f"{analysis.model}: decode cost per token (colocated vs ODS)")
    cost_ax.grid(True, which="both", alpha=0.3)
    cost_ax.legend(fontsize=8, loc="best")

    gain_ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
    if max(g.bound for g in analysis.gpus) > _LINEAR_GAIN_LIMIT:
        gain_ax.set_yscale("log")
        gain_ax.yaxis.set_major_formatter(ScalarFormatter())
        gain_ax.yaxis.set_minor_formatter(NullFormatter())
    gain_ax.set_ylabel("gain (cost ratio, x)")
    gain_ax.set_xlabel("context length (tokens)")
    gain_ax.set_title("ODS gains: $G_{hom}$ over colocation, $G_{het}$ over homogeneous ODS")
    gain_ax.grid(True, which="both", alpha=0.3)
    gain_ax.legend(fontsize=8, loc="best")

    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_frontier(
    frontier: dict[str, list[dict[str, Any] | None]], path: str | Path, *, title: str = ""
) -> Path:
    """Write a PNG of the cost vs TPOT frontier of an SLO sweep to ``path``.

    ``frontier`` maps each strategy to its plan per SLO (``tpot_s``, ``usd_per_million_tokens``,
    ``tpot_slo_s``; ``None`` where it cannot meet that SLO), as ``opweave plan --json`` prints
    it. Each strategy is one line through the (achieved TPOT, cost) of its plans; the SLOs are
    dotted vertical lines, so a point left of its SLO line met it with slack.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(8, 5.5), constrained_layout=True)
    slos = sorted(
        {p["tpot_slo_s"] for points in frontier.values() for p in points if p is not None}
    )
    for slo in slos:
        ax.axvline(slo * 1e3, color="grey", lw=0.8, ls=":")
    # OpWeave last and hollow: where it equals a baseline the baseline shows through
    for name in sorted(frontier, key=lambda n: n == "opweave"):
        label, color, marker = _FRONTIER_STYLE.get(name, (name, None, "o"))
        shown = [p for p in frontier[name] if p is not None]
        if not shown:
            ax.plot([], [], color=color, marker=marker, label=f"{label}: no SLO met")
            continue
        ours = name == "opweave"
        ax.plot(
            [p["tpot_s"] * 1e3 for p in shown],
            [p["usd_per_million_tokens"] for p in shown],
            color=color,
            marker=marker,
            markersize=11 if ours else 6,
            markerfacecolor="none" if ours else color,
            lw=2.2 if ours else 1.4,
            ls="--" if ours else "-",
            zorder=5 if ours else 3,
            label=label,
        )
    from matplotlib.ticker import ScalarFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("TPOT of the plan (ms); dotted: the SLOs")
    ax.set_ylabel("decode cost (USD per million tokens)")
    ax.set_title(title or "cost vs TPOT")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
