"""Gantt chart of one steady-state iteration: one row per resource (compute and links)."""

from __future__ import annotations

from pathlib import Path

from .evaluate import SimResult


def gantt(sim: SimResult, path: str | Path) -> Path:
    """Draw one steady-state iteration of ``sim`` to ``path`` (PNG, SVG or PDF).

    Rows are every owner's compute stream, send link and receive link; bars are coloured by
    microbatch, so idle gaps (bubbles) and compute/communication overlap are visible.
    Needs matplotlib (``pip install opweave-planner[gantt]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from opweave.costmodel.errors import ConfigError

        raise ConfigError(
            "drawing a Gantt chart needs matplotlib; pip install 'opweave-planner[gantt]'"
        ) from exc
    path = Path(path)
    names = sim.pipeline.resource_names()
    used = [r for r in names if any(e.resource == r for e in sim.trace)]
    rows = {r: i for i, r in enumerate(used)}
    t0, t1 = sim.window_s
    scale = 1e3  # milliseconds
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(13, 0.45 * len(used) + 1.6))
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
    ax.set_xlabel("time within one steady-state iteration (ms)")
    plan = sim.plan
    title = (
        f"{plan.model.name} {plan.strategy}: TPOT {sim.tpot_s * 1e3:.2f} ms, "
        f"{sim.stages_per_token} stages/token, compute occupancy "
        f"{100 * sim.compute_occupancy:.0f}%"
    )
    pool = plan.prefill
    if pool is not None:
        title += (
            f"\nbeside a prefill pool of {pool.replicas} engine{'s' if pool.replicas > 1 else ''}"
            f" of {pool.tp * pool.dp} x {pool.gpu} ({pool.gpus} GPUs), which prefill every "
            "prompt and send its KV cache here"
        )
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=cmap(m % 10)) for m in range(plan.microbatches)]
    ax.legend(
        handles,
        [f"microbatch {m}" for m in range(plan.microbatches)],
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        frameon=False,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
