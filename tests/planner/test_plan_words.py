"""The plan's text output in plain words: what runs where, without repeating the best plan."""

from __future__ import annotations

from collections import Counter

from opweave.costmodel import Owner, canonical_plan, load_model
from opweave.planner import describe_plan, plan


def test_a_layer_pipeline_of_identical_groups_is_called_so() -> None:
    """One stage per layer block tiled over two owners alternates whole blocks between them:
    a pipeline, not an operator split and not colocated."""
    qwen = load_model("qwen3-32b")
    coloc = canonical_plan(qwen, "colocated", gpu="a100-sxm-80gb", batch=8, tp=2)
    group = Owner(gpu="a100-sxm-80gb", tp=2, replicas=1, resident_batch=8)
    pipe = coloc.model_copy(update={"strategy": "opweave", "owners": (group, group)})
    text = describe_plan(pipe)
    assert text.startswith("layer pipeline over 2 identical owners, each 1 replica of 2 x ")
    assert "colocated" not in text
    assert describe_plan(coloc) == (
        "colocated: 1 replica of 2 x a100-sxm-80gb (TP2) holding 8 requests"
    )


def test_the_text_names_gpu_counts_and_nodes_and_never_repeats_the_best() -> None:
    result = plan(load_model("qwen3-32b"), ["h100", "a100"], context=8192, tpot_slo_s=0.05)
    assert result.best is not None
    lines = result.describe()
    doc = result.summary(result.best)
    # nodes summarised by size and GPU, counted independently from the JSON
    counts = Counter((n["gpus"], n["gpu"]) for n in doc["nodes"])
    expected = ", ".join(f"{k} x {g} {gpu}" for (g, gpu), k in counts.items())
    total = len(doc["nodes"])
    assert f"({total} node{'s' if total > 1 else ''}: {expected})" in lines[1]
    # no baseline row is the best plan again (here colocated is the best of every strategy)
    assert any(p == result.best for p in result.baselines.values())
    best_text = describe_plan(result.best).split(":", 1)[1]
    assert not any(best_text in line for line in lines[2:] if line.startswith("    "))
    assert not any(" 1.00x: " in line and "OpWeave" in line for line in lines)
    # no jargon of the plan file in the words
    text = "\n".join(lines)
    for jargon in ("template cuts", "-stage template", " b64 ", "none+block"):
        assert jargon not in text
