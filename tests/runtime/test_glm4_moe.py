"""GLM-4.5 (glm4_moe: GQA attention with q/k/v biases, per-head q/k norms and half of each head
rotated, over DeepSeek-V3's MoE layout) in the runtime.

The tiny model also runs through every family-wide test (exactness, every plan kind, the traced
decode step, the operator contract); here: that its tiny checkpoint has what makes the family
distinct, and tensor and expert parallelism against transformers' tokens.
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import Request, RunOptions, run_plan

MAX_NEW_TOKENS = 16  # the family-wide tests' count: hf_greedy's cache is shared with them


@pytest.fixture(scope="module")
def glm(tiny_model):
    return tiny_model("glm4_moe")


def test_the_tiny_glm_has_biases_norms_partial_rope_and_a_selection_bias(glm):
    config = json.loads((glm / "config.json").read_text())
    assert config["model_type"] == "glm4_moe" and config["architectures"] == ["Glm4MoeForCausalLM"]
    arch = load_model(glm).arch
    assert arch.family == "glm4_moe"
    assert arch.qkv_bias and not arch.o_bias and arch.qk_norm and not arch.qk_norm_per_layer
    assert arch.rope["full_attention"].partial_rotary_factor == 0.5
    assert arch.moe is not None and arch.moe_layers == (1, 2)
    assert arch.moe.scoring_func == "sigmoid" and arch.moe.score_correction_bias
    assert (arch.moe.num_groups, arch.moe.topk_groups) == (2, 1)
    assert arch.moe.routed_scaling_factor == 2.5 and arch.moe.shared_intermediate_size == 32
    with safe_open(glm / "model.safetensors", "pt") as f:
        names = set(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer
    assert bias.abs().min() > 0  # perturbed: a zero bias would not test selection


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2)])
def test_tp2_and_ep2_owners_generate_transformers_greedy_tokens(tp, ep, glm, hf_greedy, prompts):
    """Heads (their biases and norms with them) and expert channels over two tensor-parallel
    ranks; or the experts over two expert-parallel ranks, each an attention replica."""
    plan = canonical_plan(
        load_model(glm), "colocated", gpu="cpu", batch=4, microbatches=1, tp=tp, ep=ep, dp=ep
    )
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    result = run_plan(plan, glm, requests, RunOptions(timeout_s=30.0))
    assert result is not None and len(result.ranks) == 2
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(glm, prompts, MAX_NEW_TOKENS)
