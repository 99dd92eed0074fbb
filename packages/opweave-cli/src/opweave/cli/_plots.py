"""Figures: ``opweave analyze --plot`` (cost per token and ODS gains against context length) and
``opweave plan --plot`` (the cost vs TPOT frontier of an SLO sweep).

Every figure is titled with the model, the GPUs and the context; axes are in plain units
(dollars per million tokens as ``$0.20``, tokens, milliseconds) and legends are in words, not
the paper's symbols. ``analysis_figure`` and ``frontier_figure`` return the figure (tests read
its text); ``plot_analysis`` and ``plot_frontier`` write it to a file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from opweave.costmodel import Analysis

__all__ = ["analysis_figure", "frontier_figure", "plot_analysis", "plot_frontier"]

_FRONTIER_STYLE = {
    "opweave": ("OpWeave", "black", "o"),
    "colocated": ("colocated", "tab:blue", "s"),
    "afd": ("AFD (attention-FFN disaggregation)", "tab:orange", "^"),
    "cad": ("CAD (core-attention disaggregation)", "tab:green", "v"),
}

_HET_COLOR = "black"
_SHARED_COLOR = "dimgray"  # a line drawn once for several GPU types
_LINEAR_GAIN_LIMIT = 5.0  # above this a gain bound would flatten the gains near 1: log axis
_LOG_COST_RATIO = 10.0  # costs spanning more than this ratio get a log axis
_COINCIDE_RTOL = 1e-9  # two lines closer than this (relative) are drawn once
_DPI = 120


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tokens(value: float, _pos: object = None) -> str:
    """A token count: 512, 4K, 128K, 1M (binary units), or 50,000 when not a whole unit."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if value >= size and float(value / size).is_integer():
            return f"{value / size:.0f}{unit}"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.4g}"


def _usd(value: float, _pos: object = None) -> str:
    """A dollar amount as a plain decimal with at least two places: $0.20, $0.0035, $1.50, $12."""
    if not math.isfinite(value):
        return ""
    sign = "-" if value < 0 else ""
    amount = float(f"{abs(value):.6g}")  # drop float noise from tick positions
    whole, _, frac = str(np.format_float_positional(amount, trim="-")).partition(".")
    if amount >= 10 and not frac:
        return f"{sign}${whole}"
    return f"{sign}${whole}.{frac.ljust(2, '0')}"


def _plain(value: float, _pos: object = None) -> str:
    """A plain number for a tick: 1, 1.5, 0.25, 120 (never 2x10^-1 or an offset)."""
    if not math.isfinite(value):
        return ""
    return str(np.format_float_positional(float(f"{value:.6g}"), trim="-"))


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _groups(values: Iterable[float]) -> list[list[int]]:
    """Indices of ``values`` grouped where they coincide (equal within 1e-9 relative)."""
    out: list[list[int]] = []
    firsts: list[float] = []
    for i, v in enumerate(values):
        for group, first in zip(out, firsts, strict=True):
            if math.isclose(v, first, rel_tol=_COINCIDE_RTOL, abs_tol=0.0):
                group.append(i)
                break
        else:
            out.append([i])
            firsts.append(v)
    return out


def _dollar_axis(ax: Axes, values: Iterable[float]) -> None:
    """The y axis of a cost in dollars: ticks like $0.20, log scale only over a wide range."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    finite = [v for v in values if math.isfinite(v) and v > 0]
    ratio = max(finite) / min(finite) if finite else 1.0
    if ratio > _LOG_COST_RATIO:
        ax.set_yscale("log")
        subs = (1.0, 2.0, 3.0, 5.0) if ratio < 100 else (1.0, 2.0, 5.0) if ratio < 1e4 else (1.0,)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    else:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_formatter(FuncFormatter(_usd))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _plain_axis(axis: Any, formatter: Callable[[float, object], str] = _plain) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(formatter))
    axis.set_minor_formatter(NullFormatter())


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    try:
        fig.savefig(path, dpi=_DPI)
    finally:
        _pyplot().close(fig)
    return path


# -- opweave analyze --plot ------------------------------------------------------------------


def _unit(gpu: str, tp: int) -> str:
    """One analysed unit: ``h100 x4`` is a tensor-parallel group of four H100s."""
    return f"{gpu} x{tp}"


def _context_range(contexts: Sequence[float]) -> str:
    lo, hi = min(contexts), max(contexts)
    if lo == hi:
        return f"context {_tokens(lo)} tokens"
    return f"context {_tokens(lo)} to {_tokens(hi)} tokens"


def analysis_figure(analysis: Analysis) -> Figure:
    """The two-panel figure of an :func:`~opweave.costmodel.analyze` result.

    Top: dollars per million tokens of colocated serving (solid) and homogeneous ODS (dashed)
    per GPU type, and of heterogeneous ODS (black) when two types were analysed. Bottom: the
    gain of homogeneous ODS over colocation per GPU type and of heterogeneous ODS over the best
    homogeneous ODS, with each type's bound on the homogeneous gain (usable memory over the
    memory left beside the weights) as a dotted line -- drawn once where types share it.
    Contexts where colocation cannot hold one request are left blank (NaN), not dropped.
    """
    plt = _pyplot()
    order = np.argsort(analysis.contexts, kind="stable")
    s = analysis.contexts[order]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    units = [_unit(g.gpu, g.tp) for g in analysis.gpus]
    gpu_colors = [colors[i % len(colors)] for i in range(len(analysis.gpus))]
    fig, (cost_ax, gain_ax) = plt.subplots(
        2, 1, figsize=(10, 9.5), sharex=True, constrained_layout=True
    )
    fig.suptitle(
        f"{analysis.model} on {_and(units)}: {_context_range(list(s))}",
        fontsize=12,
    )
    het = analysis.heterogeneous
    costs: list[float] = []
    for g, unit, color in zip(analysis.gpus, units, gpu_colors, strict=True):
        cost_ax.plot(s, g.cost_colocated[order], color=color, lw=2, label=f"colocated, {unit}")
        cost_ax.plot(
            s,
            g.cost_homogeneous[order],
            color=color,
            lw=2,
            ls="--",
            label=f"homogeneous ODS, {unit}",
        )
        costs += [*g.cost_colocated.tolist(), *g.cost_homogeneous.tolist()]
        gain_ax.plot(
            s,
            g.gain_homogeneous[order],
            color=color,
            lw=2,
            label=f"homogeneous ODS gain over colocated, {unit}",
        )
    for group in _groups(g.bound for g in analysis.gpus):
        bound = analysis.gpus[group[0]].bound
        shared = len(group) > 1
        gain_ax.axhline(
            bound,
            color=_SHARED_COLOR if shared else gpu_colors[group[0]],
            lw=1.2,
            ls=":",
            label=(
                f"homogeneous ODS gain bound {bound:.3g} (usable memory / memory left "
                "beside the weights), "
                + (
                    f"the same for {_and([units[i] for i in group])}: one line"
                    if shared
                    else units[group[0]]
                )
            ),
        )
    _mark_contexts(analysis, s, order, units, gpu_colors, cost_ax, gain_ax)
    if het is not None:
        cost_ax.plot(
            s,
            het.cost_heterogeneous[order],
            color=_HET_COLOR,
            lw=2.5,
            label=f"heterogeneous ODS (attention on {het.attention_gpu}, GEMMs on {het.gemm_gpu})",
        )
        costs += het.cost_heterogeneous.tolist()
        gain_ax.plot(
            s,
            het.gain_heterogeneous[order],
            color=_HET_COLOR,
            lw=2.5,
            label="heterogeneous ODS gain over the best homogeneous ODS",
        )
        if het.peak_gain is not None and het.crossing_context_tokens is not None:
            gain_ax.plot(
                [het.crossing_context_tokens],
                [het.peak_gain],
                marker="o",
                color=_HET_COLOR,
                ls="none",
                label=(
                    f"peak heterogeneous ODS gain {het.peak_gain:.3f}, where the two GPUs' "
                    "homogeneous ODS costs cross"
                ),
            )

    from matplotlib.ticker import LogLocator

    cost_ax.set_xscale("log", base=2)
    cost_ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
    _plain_axis(cost_ax.xaxis, _tokens)
    # Keep the whole requested range on the axis, infeasible contexts included.
    cost_ax.set_xlim(float(s[0]) / 1.15, float(s[-1]) * 1.15)
    _dollar_axis(cost_ax, costs)
    cost_ax.set_ylabel("decode cost ($ per million tokens)")
    cost_ax.set_title("decode cost per token: colocated vs operator-disaggregated (ODS)")
    cost_ax.grid(True, which="both", alpha=0.3)
    cost_ax.legend(fontsize=8, loc="best")

    if max(g.bound for g in analysis.gpus) > _LINEAR_GAIN_LIMIT:
        gain_ax.set_yscale("log")
        gain_ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    _plain_axis(gain_ax.yaxis)
    gain_ax.set_ylabel("gain (cost ratio, times)")
    gain_ax.set_xlabel("context length (tokens)")
    gain_ax.set_title(
        "gain of homogeneous ODS over colocated"
        + ("" if het is None else ", of heterogeneous ODS over the best homogeneous ODS")
    )
    gain_ax.grid(True, which="both", alpha=0.3)
    # below the panel: the gain curves run through every corner of it
    gain_ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    return fig


def _mark_contexts(
    analysis: Analysis,
    s: np.ndarray,
    order: np.ndarray,
    units: list[str],
    colors: list[str],
    cost_ax: Axes,
    gain_ax: Axes,
) -> None:
    """Vertical lines where colocation stops fitting one request, and where its batch falls
    below the one that makes the GEMMs compute-bound (where homogeneous ODS starts to gain);
    one line per distinct context, naming every GPU type it stands for."""
    fits: list[tuple[float, int]] = []
    turns: list[tuple[float, int]] = []
    for i, g in enumerate(analysis.gpus):
        feasible = g.feasible[order]
        if feasible.any() and not feasible.all():
            fits.append((float(s[feasible].max()), i))
        turn = _turn(s[feasible], g.b_max[order][feasible], g.b_star)
        if turn is not None:
            turns.append((turn, i))
    for group in _groups(x for x, _ in fits):
        x, members = fits[group[0]][0], [fits[k][1] for k in group]
        color = _SHARED_COLOR if len(members) > 1 else colors[members[0]]
        cost_ax.axvline(x, color=color, lw=0.8, alpha=0.5)
        gain_ax.axvline(
            x,
            color=color,
            lw=0.8,
            alpha=0.5,
            label=f"longest context colocation fits, {_and([units[i] for i in members])}",
        )
    for group in _groups(x for x, _ in turns):
        x, members = turns[group[0]][0], [turns[k][1] for k in group]
        batches = _and([f"{analysis.gpus[i].b_star:.0f}" for i in members])
        gain_ax.axvline(
            x,
            color=_SHARED_COLOR if len(members) > 1 else colors[members[0]],
            lw=0.8,
            ls="-.",
            alpha=0.7,
            label=(
                f"colocated batch falls below {batches} requests, the batch where the GEMMs "
                f"become compute-bound, {_and([units[i] for i in members])}"
            ),
        )


def _turn(s: np.ndarray, b_max: np.ndarray, b_star: float) -> float | None:
    """The context where the colocated batch ``b_max`` (falling with ``s``) crosses ``b_star``,
    interpolated in log-log between the grid points around it; None outside the grid."""
    below = np.flatnonzero(b_max < b_star)
    if below.size == 0 or below[0] == 0:
        return None
    k = int(below[0])
    s0, s1, b0, b1 = (float(v) for v in (s[k - 1], s[k], b_max[k - 1], b_max[k]))
    if not (b0 > 0 and b1 > 0 and b0 != b1):
        return s1
    t = (math.log(b_star) - math.log(b0)) / (math.log(b1) - math.log(b0))
    return math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0)))


def plot_analysis(analysis: Analysis, path: str | Path) -> Path:
    """Write :func:`analysis_figure` of ``analysis`` to ``path`` (PNG, SVG or PDF)."""
    return _save(analysis_figure(analysis), path)


# -- opweave plan --plot ---------------------------------------------------------------------


def _frontier_title(
    model: str | None, gpus: Sequence[str], context_tokens: int | None, title: str
) -> str:
    if model is None and not gpus and context_tokens is None:
        return title or "cost vs TPOT"
    head = model or "cost vs TPOT"
    if gpus:
        head += f" on {_and(list(gpus))}"
    if context_tokens is not None:
        head += f", context {_tokens(context_tokens)} tokens"
    return head + "\ncost vs TPOT of each strategy's cheapest plan per SLO"


def frontier_figure(
    frontier: dict[str, list[dict[str, Any] | None]],
    *,
    model: str | None = None,
    gpus: Sequence[str] = (),
    context_tokens: int | None = None,
    title: str = "",
) -> Figure:
    """The cost vs TPOT frontier of an SLO sweep.

    ``frontier`` maps each strategy to its plan per SLO (``tpot_s``, ``usd_per_million_tokens``,
    ``tpot_slo_s``; ``None`` where it cannot meet that SLO), as ``opweave plan --json`` prints
    it. Each strategy is one line through the (achieved TPOT, cost) of its plans; the SLOs are
    dotted vertical lines, so a point left of its SLO line met it with slack. The title names
    ``model``, the ``gpus`` searched and ``context_tokens``; ``title`` is used only when none of
    them is given.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6), constrained_layout=True)
    slos = sorted(
        {p["tpot_slo_s"] for points in frontier.values() for p in points if p is not None}
    )
    for k, slo in enumerate(slos):
        ax.axvline(slo * 1e3, color="grey", lw=0.8, ls=":", label="TPOT SLOs" if k == 0 else None)
    costs: list[float] = []
    # OpWeave last and hollow: where it equals a baseline the baseline shows through
    for name in sorted(frontier, key=lambda n: n == "opweave"):
        label, color, marker = _FRONTIER_STYLE.get(name, (name, None, "o"))
        shown = [p for p in frontier[name] if p is not None]
        if not shown:
            ax.plot([], [], color=color, marker=marker, label=f"{label}: no SLO met")
            continue
        ours = name == "opweave"
        costs += [p["usd_per_million_tokens"] for p in shown]
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
    _dollar_axis(ax, costs)
    _plain_axis(ax.xaxis)
    ax.set_xlabel("TPOT of the plan (ms)")
    ax.set_ylabel("decode cost ($ per million tokens)")
    ax.set_title(_frontier_title(model, gpus, context_tokens, title), fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def plot_frontier(
    frontier: dict[str, list[dict[str, Any] | None]],
    path: str | Path,
    *,
    model: str | None = None,
    gpus: Sequence[str] = (),
    context_tokens: int | None = None,
    title: str = "",
) -> Path:
    """Write :func:`frontier_figure` to ``path`` (PNG, SVG or PDF)."""
    fig = frontier_figure(
        frontier, model=model, gpus=gpus, context_tokens=context_tokens, title=title
    )
    return _save(fig, path)
