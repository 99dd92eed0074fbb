"""Gantt chart of one steady-state iteration: one row per resource (compute and links)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from opweave.costmodel import Plan

from .evaluate import SimResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _gpus(plan: Plan) -> str:
    """The GPUs of a plan's decode owners, per type: ``8 h100 + 4 a100`` (all replicas)."""
    count: dict[str, int] = {}
    for o in plan.owners:
        count[o.gpu] = count.get(o.gpu, 0) + o.replicas * o.gpus_per_replica
    return " + ".join(f"{n} {gpu}" for gpu, n in count.items())


def _usd(amount: float) -> str:
    """Dollars as a plain decimal with two significant digits or cents: $0.70, $0.0035, $12.40."""
    places = 2 if amount <= 0 else max(2, 1 - math.floor(math.log10(amount)))
    return f"${amount:.{places}f}"


def _title(sim: SimResult) -> str:
    """Model, GPUs and context first, then what the iteration achieves, in plain units."""
    plan = sim.plan
    lines = [
        f"{plan.model.name} on {_gpus(plan)} GPUs, context {plan.context_tokens:,} tokens: "
        f"{plan.strategy} plan, {plan.microbatches} microbatch"
        + ("es" if plan.microbatches > 1 else "")
    ]
    cost = sim.usd_per_million_tokens
    lines.append(
        f"time per output token {sim.tpot_s * 1e3:.2f} ms"
        + ("" if cost is None or not math.isfinite(cost) else f", {_usd(cost)} per million tokens")
        + f", {sim.stages_per_token} stage{'s' if sim.stages_per_token != 1 else ''} per token"
        f", compute busy "
        f"{100 * sim.compute_occupancy:.0f}% of the time"
    )
    pool = plan.prefill
    if pool is not None:
        lines.append(
            f"beside a prefill pool of {pool.replicas} engine{'s' if pool.replicas > 1 else ''}"
            f" of {pool.tp * pool.dp} {pool.gpu} ({pool.gpus} GPUs), which prefill every "
            "prompt and send its KV cache here"
        )
    return "\n".join(lines)


def gantt_figure(sim: SimResult) -> Figure:
    """The Gantt chart of one steady-state iteration of ``sim`` as a matplotlib figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from opweave.costmodel.errors import ConfigError

        raise ConfigError(
            "drawing a Gantt chart needs matplotlib; pip install 'opweave-planner[gantt]'"
        ) from exc
    names = sim.pipeline.resource_names()
    used = [r for r in names if any(e.resource == r for e in sim.trace)]
    rows = {r: i for i, r in enumerate(used)}
    t0, t1 = sim.window_s
    scale = 1e3  # milliseconds
    cmap = plt.get_cmap("tab10")
    plan = sim.plan
    fig, ax = plt.subplots(figsize=(13, 0.45 * len(used) + 2.0))
    for ev in sim.trace:
        y = rows[ev.resource]
        color = cmap(ev.microbatch % 10)
        ax.barh(
            y,
            (ev.end_s - ev.start_s) * scale,
            left=(ev.start_s - t0) * scale,
            height=0.7,
            color=color,
            alpha=1.0 if ev.kind == "compute" else 0.55,
            linewidth=0,
        )
    ax.set_yticks(range(len(used)))
    ax.set_yticklabels(used, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) * scale)
    ax.xaxis.set_major_formatter(FuncFormatter(_ms))
    ax.set_xlabel("time within one steady-state iteration (ms)")
    ax.set_title(_title(sim), fontsize=10)
    handles = [Patch(color=cmap(m % 10)) for m in range(plan.microbatches)]
    ax.legend(
        handles,
        [f"microbatch {m}" for m in range(plan.microbatches)],
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        frameon=False,
        title="compute solid,\ntransfers pale",
        title_fontsize=8,
    )
    fig.tight_layout()
    return fig


def _ms(value: float, _pos: object = None) -> str:
    """A plain tick in milliseconds: 0, 2.5, 10 (no offset, no powers of ten)."""
    if not math.isfinite(value):
        return ""
    return str(np.format_float_positional(float(f"{value:.6g}"), trim="-"))


def gantt(sim: SimResult, path: str | Path) -> Path:
    """Draw one steady-state iteration of ``sim`` to ``path`` (PNG, SVG or PDF).

    Rows are every owner's compute stream, send link and receive link; bars are coloured by
    microbatch, so idle gaps (bubbles) and compute/communication overlap are visible. The
    title names the model, the GPUs and the context. Needs matplotlib
    (``pip install opweave-planner[gantt]``).
    """
    fig = gantt_figure(sim)
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path
