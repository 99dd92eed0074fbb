"""Planner and runtime meet in the cost model's operator sequence: it must be the same."""

from __future__ import annotations

import pytest

from opweave.costmodel import load_model
from opweave.runtime import TINY_CONFIGS, StageModule, operator_sequence

FAMILIES = list(TINY_CONFIGS)  # every family the runtime implements


@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_runs_the_operators_the_cost_model_plans(family, tiny_model) -> None:
    model_dir = tiny_model(family)
    spec = load_model(model_dir)
    assert [(op.layer, op.name) for op in spec.operators] == [
        (ref.layer, ref.name) for ref in operator_sequence(model_dir)
    ]
    kinds = {"full": "full_attention", "sliding": "sliding_attention", "linear": "linear_attention"}
    assert [kinds[layer.attention.value] for layer in spec.layers] == list(spec.arch.layer_types)
    # the runtime builds exactly these operators, each holding the weights the cost model counts
    stage = StageModule.whole_model(model_dir)
    assert [(op.layer, op.name) for op in stage.operators] == [
        (op.layer, op.name) for op in spec.operators
    ]
    assert stage.weight_bytes == spec.weight_bytes
