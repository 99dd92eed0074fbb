"""The CLI's figures: ``analyze --plot``, ``plan --plot`` (frontier), ``simulate --gantt``."""

from __future__ import annotations

import re

import numpy as np

from opweave.cli._plots import plot_analysis
from opweave.costmodel import default_catalog, load_model
from opweave.costmodel._private.analysis import analyze

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_analysis_writes_png(tmp_path):
    cat = default_catalog()
    # Up to 1M tokens: the longest contexts do not fit colocated and must not break the plot.
    result = analyze(
        load_model("llama-3.3-70b"),
        [cat.get("h100"), cat.get("a100")],
        np.geomspace(512, 1 << 20, 50),
        tp=4,
    )
    path = tmp_path / "analysis.png"
    assert plot_analysis(result, path) == path
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000


def test_plot_single_gpu_with_large_bound(tmp_path):
    cat = default_catalog()
    # tp=2 leaves little room beside 141 GB of weights: bound ~50, log gain axis.
    result = analyze(load_model("llama-3.3-70b"), [cat.get("h100")], [1024, 4096, 8192], tp=2)
    assert result.gpus[0].bound > 5
    path = plot_analysis(result, tmp_path / "single.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


# -- what the figures say: titles, plain tick labels, legends in words -----------------------

PAPER_SYMBOLS = ("G_hom", "G_het", "G_{", "b*", "b^*", "M/(M-W)", "M/(M - W)", "M-W")


def _texts(fig):
    """Title, tick labels and legend entries of every panel of ``fig`` (drawn first, so the
    tick labels are the ones a reader sees)."""
    fig.canvas.draw()
    titles = [fig.get_suptitle()] + [ax.get_title() for ax in fig.axes]
    ticks = []
    legend = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            ticks += [t.get_text() for t in axis.get_ticklabels(which="both")]
            ticks.append(axis.get_offset_text().get_text())
        if ax.get_legend() is not None:
            legend += [t.get_text() for t in ax.get_legend().get_texts()]
    return " | ".join(titles), [t for t in ticks if t], legend


def _check_plain(ticks, legend):
    assert ticks
    for text in ticks:
        assert "×10" not in text and "$10^" not in text and "10^{" not in text, text
        assert not re.search(r"\de[+-]?\d", text), text  # no 2e-01
    for text in legend:
        assert not any(sym in text for sym in PAPER_SYMBOLS), text
        assert "$G" not in text and "mathdefault" not in text, text


def test_analysis_figure_names_model_gpus_context_in_plain_units():
    import matplotlib.pyplot as plt

    from opweave.cli._plots import analysis_figure

    cat = default_catalog()
    result = analyze(
        load_model("llama-3.3-70b"),
        [cat.get("h100"), cat.get("a100")],
        np.geomspace(512, 1 << 20, 50),
        tp=4,
    )
    fig = analysis_figure(result)
    try:
        title, ticks, legend = _texts(fig)
        assert "llama-3.3-70b" in title
        assert "h100-sxm" in title and "a100-sxm-80gb" in title
        assert "context 512 to 1M tokens" in title
        _check_plain(ticks, legend)
        dollars = [t for t in fig.axes[0].get_yticklabels() if t.get_text()]
        assert dollars and all(t.get_text().startswith("$") for t in dollars)
        assert "$0.20" in [t.get_text() for t in dollars]  # cents, not 2x10^-1
        assert any("homogeneous ODS gain bound" in t for t in legend)
        assert any("heterogeneous ODS gain over the best homogeneous ODS" in t for t in legend)
        assert any("the batch where the GEMMs become compute-bound" in t for t in legend)
        # h100 and a100 bounds differ (1.846 vs 1.839): two bound lines, each named once
        bounds = [t for t in legend if "gain bound" in t]
        assert len(bounds) == 2 and not any("the same for" in t for t in bounds)
    finally:
        plt.close(fig)


def test_coinciding_bounds_are_drawn_once_and_say_so():
    import matplotlib.pyplot as plt

    from opweave.cli._plots import analysis_figure

    cat = default_catalog()
    # the SXM and PCIe H100 have the same memory: at the same TP their bounds are equal
    result = analyze(
        load_model("llama-3.3-70b"), [cat.get("h100"), cat.get("h100-pcie")], [1024, 8192], tp=4
    )
    a, b = result.gpus
    assert a.bound == b.bound
    fig = analysis_figure(result)
    try:
        _, ticks, legend = _texts(fig)
        _check_plain(ticks, legend)
        gain_ax = fig.axes[1]
        flat = [
            line
            for line in gain_ax.get_lines()
            if line.get_linestyle() == ":" and len(set(line.get_ydata())) == 1
        ]
        assert len(flat) == 1 and flat[0].get_ydata()[0] == a.bound
        label = flat[0].get_label()
        assert "the same for h100-sxm x4 and h100-pcie x4" in label and "one line" in label
    finally:
        plt.close(fig)


def test_single_gpu_log_gain_axis_has_plain_ticks():
    import matplotlib.pyplot as plt

    from opweave.cli._plots import analysis_figure

    cat = default_catalog()
    result = analyze(load_model("llama-3.3-70b"), [cat.get("h100")], [1024, 4096, 8192], tp=2)
    fig = analysis_figure(result)
    try:
        title, ticks, legend = _texts(fig)
        assert "llama-3.3-70b on h100-sxm x2: context 1K to 8K tokens" in title
        assert "heterogeneous" not in title  # one GPU type: no heterogeneous gain
        assert fig.axes[1].get_yscale() == "log"
        _check_plain(ticks, legend)
    finally:
        plt.close(fig)


FRONTIER = {
    "opweave": [
        {"tpot_slo_s": 0.02, "tpot_s": 0.019, "usd_per_million_tokens": 0.41},
        {"tpot_slo_s": 0.05, "tpot_s": 0.045, "usd_per_million_tokens": 0.2},
    ],
    "colocated": [None, {"tpot_slo_s": 0.05, "tpot_s": 0.048, "usd_per_million_tokens": 0.3}],
    "afd": [None, None],
    "cad": [{"tpot_slo_s": 0.02, "tpot_s": 0.018, "usd_per_million_tokens": 4.5}, None],
}


def test_frontier_figure_names_model_gpus_context_in_plain_units(tmp_path):
    import matplotlib.pyplot as plt

    from opweave.cli._plots import frontier_figure, plot_frontier

    for frontier in (FRONTIER, {**FRONTIER, "cad": [None, None]}):  # log and linear cost axes
        fig = frontier_figure(
            frontier, model="qwen3-32b", gpus=["h100", "a100"], context_tokens=8192
        )
        try:
            title, ticks, legend = _texts(fig)
            assert "qwen3-32b on h100 and a100, context 8K tokens" in title
            _check_plain(ticks, legend)
            dollars = [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
            assert dollars and all(t.startswith("$") for t in dollars), dollars
            assert "$0.20" in dollars
            assert "AFD (attention-FFN disaggregation): no SLO met" in legend
        finally:
            plt.close(fig)
    path = plot_frontier(FRONTIER, tmp_path / "f.png", model="m", gpus=["h100"])
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_gantt_figure_names_model_gpus_context():
    import matplotlib.pyplot as plt

    from opweave.costmodel import canonical_plan
    from opweave.planner import simulate_plan
    from opweave.planner._private.gantt import gantt_figure

    qwen = load_model("qwen3-32b")
    plan = canonical_plan(
        qwen, "afd", gpu="h100-sxm", batch=10, microbatches=3, context_tokens=8192, tp=2
    )
    fig = gantt_figure(simulate_plan(plan, qwen))
    try:
        title, ticks, legend = _texts(fig)
        assert "qwen3-32b on 4 h100-sxm GPUs, context 8,192 tokens" in title
        assert "ms" in title and "per million tokens" in title
        _check_plain(ticks, legend)
        assert fig.axes[0].get_xlabel() == "time within one steady-state iteration (ms)"
    finally:
        plt.close(fig)
