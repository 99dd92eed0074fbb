"""Qwen3.5-MoE and dense Qwen3.5 (gated DeltaNet with four input projections, a multimodal
wrapper checkpoint) and MiniMax-M2 (one q and one k norm over all heads, partial RoPE, sigmoid
routing with a selection bias) in the runtime.

The tiny models also run through every family-wide test (exactness, every plan kind, the
traced decode step, the operator contract); here: what makes each family distinct is in its
tiny checkpoint, tensor parallelism (the layer-wide norms over ranks, key/value heads shared
by ranks included), and the layer-wide norm against a computation of its own.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import BatchMeta, Request, RunOptions, StageModule, TokenBatch, run_plan

MAX_NEW_TOKENS = 16  # the family-wide tests' count: hf_greedy's cache is shared with them


def _names(model_dir) -> set[str]:
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return set(f.keys())


def _tp_tokens(model_dir, strategy: str, tp: int, prompts) -> list[list[int]]:
    mb = 1 if strategy == "colocated" else 2
    plan = canonical_plan(
        load_model(model_dir), strategy, gpu="cpu", batch=4, microbatches=mb, tp=tp
    )
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=30.0))
    assert result is not None
    assert len(result.ranks) == tp * len(plan.owners)
    whole = StageModule.whole_model(model_dir).checkpoint.bytes_read
    assert all(r.weight_bytes_read < whole for r in result.ranks)
    return [list(out.token_ids) for out in result.outputs]


@pytest.fixture(scope="module")
def qwen35(tiny_model):
    return tiny_model("qwen3_5_moe")


@pytest.fixture(scope="module")
def minimax(tiny_model):
    return tiny_model("minimax_m2")


def test_the_tiny_qwen3_5_is_a_wrapper_with_four_gdn_projections(qwen35):
    config = json.loads((qwen35 / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and "text_config" in config
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    names = _names(qwen35)
    prefix = "model.language_model.layers.0.linear_attn."
    assert {
        prefix + p + ".weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    } <= names
    assert not any("in_proj_qkvz" in n for n in names)
    assert any(n.startswith("model.visual.") for n in names)  # present, never read
    arch = load_model(qwen35).arch
    assert arch.layer_types.count("linear_attention") == 3 and arch.attn_output_gate
    assert arch.moe is not None and arch.moe_layers == (0, 1, 2, 3)


def test_the_dense_qwen3_5_is_a_wrapper_with_a_dense_mlp_in_every_layer(tiny_model):
    model_dir = tiny_model("qwen3_5")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["model_type"] == (
        "qwen3_5_text"
    )
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    names = _names(model_dir)
    assert "model.language_model.layers.0.linear_attn.in_proj_z.weight" in names
    assert "model.language_model.layers.3.mlp.gate_proj.weight" in names
    assert not any(".experts." in n for n in names)
    arch = load_model(model_dir).arch
    assert arch.moe is None and arch.attn_output_gate
    assert arch.layer_types.count("full_attention") == 1


def test_dense_qwen3_5_at_tp2_generates_transformers_greedy_tokens(tiny_model, hf_greedy, prompts):
    """Key heads (q, k, v, z, b, a rows) and the dense MLP's channels split over two ranks."""
    model_dir = tiny_model("qwen3_5")
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert _tp_tokens(model_dir, "colocated", 2, prompts) == expected


def test_the_tiny_minimax_has_layer_wide_norms_and_a_routing_bias(minimax):
    arch = load_model(minimax).arch
    assert arch.qk_norm and arch.qk_norm_per_layer
    assert arch.rope["full_attention"].partial_rotary_factor == 0.5
    assert arch.moe is not None and arch.moe.score_correction_bias
    assert arch.moe.scoring_func == "sigmoid"
    with safe_open(minimax / "model.safetensors", "pt") as f:
        bias = f.get_tensor("model.layers.0.block_sparse_moe.e_score_correction_bias")
        assert f.get_tensor("model.layers.0.self_attn.q_norm.weight").shape == (4 * 16,)
    assert bias.abs().min() > 0  # perturbed: a zero bias would not test selection


@pytest.mark.parametrize("strategy", ["afd", "cad"])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "minimax_m2"])
def test_tp2_plans_generate_transformers_greedy_tokens(
    family, strategy, tiny_model, hf_greedy, prompts
):
    """Key heads (Qwen3.5's q, k, v, z, b, a rows) or attention heads (MiniMax's norms summed
    over ranks) and expert channels split over two ranks."""
    model_dir = tiny_model(family)
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert _tp_tokens(model_dir, strategy, 2, prompts) == expected


def test_minimax_at_tp4_counts_a_shared_key_head_once(minimax, hf_greedy, prompts):
    """Two key/value heads over four ranks: each head is held by two ranks, and the key norm's
    sum of squares must count it once."""
    expected = hf_greedy(minimax, prompts, MAX_NEW_TOKENS)
    assert _tp_tokens(minimax, "colocated", 4, prompts) == expected


def test_the_layer_wide_norm_is_transformers(minimax):
    """``qkv_proj`` of a MiniMax layer against its definition written out: q and k normalised
    over all heads at once (not per head), then weighted."""
    from transformers import AutoModelForCausalLM

    stage = StageModule(minimax, [(0, "attn_norm"), (0, "qkv_proj")])
    hf = AutoModelForCausalLM.from_pretrained(minimax).model.layers[0]
    x = torch.randn(3, 64)
    meta = BatchMeta(("a", "b", "c"), (1, 1, 1), (0, 0, 0))
    stage.admit(meta.request_ids)
    out = stage(TokenBatch(meta, {"hidden": x}))
    with torch.no_grad():
        h = hf.input_layernorm(x)
        attn = hf.self_attn
        q = attn.q_proj(h)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.q_norm.weight
    torch.testing.assert_close(out["q"].reshape(3, -1), q, rtol=1e-5, atol=1e-5)
