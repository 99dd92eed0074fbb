"""``plot_analysis`` writes a readable PNG of an analysis."""

from __future__ import annotations

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
