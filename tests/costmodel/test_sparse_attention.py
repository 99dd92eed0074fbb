"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the indexer's weights, cache and scoring, and
MLA reading only the top-k tokens; against counts written here from the released configs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opweave.costmodel import (
    ConfigError,
    EngineStepCost,
    Parallelism,
    default_catalog,
    estimate_step,
    load_model,
    model_spec_from_config,
)

CHECKPOINTS = Path(__file__).with_name("checkpoints")
H200 = default_catalog().get("h200")


def config(name: str) -> dict[str, Any]:
    return json.loads((CHECKPOINTS / name).read_text())


def block_fp8(n_in: int, n_out: int) -> float:
    return n_in * n_out + 4 * math.ceil(n_out / 128) * math.ceil(n_in / 128)


def test_deepseek_v3_2_is_deepseek_v3_and_an_indexer_per_layer() -> None:
    """The indexer's wq_b and wk in block FP8 like the other linears; its LayerNorm (weight and
    bias) and weights_proj (one weight per index head) in BF16."""
    c = config("deepseek-v3.2.json")
    v32 = load_model(CHECKPOINTS / "deepseek-v3.2.json")
    v3 = model_spec_from_config({**c, "architectures": ["DeepseekV3ForCausalLM"]})
    assert (v32.family, v3.family) == ("deepseek_v32", "deepseek_v3")
    h, lq, ni, di = c["hidden_size"], c["q_lora_rank"], c["index_n_heads"], c["index_head_dim"]
    indexer = block_fp8(lq, ni * di) + block_fp8(h, di) + 2 * (2 * di + h * ni)
    assert v32.weight_bytes == pytest.approx(v3.weight_bytes + c["num_hidden_layers"] * indexer)


def test_the_cache_holds_the_latent_and_the_index_keys_and_attention_reads_the_top_k() -> None:
    c = config("deepseek-v3.2.json")
    spec = load_model(CHECKPOINTS / "deepseek-v3.2.json")
    layers, topk = c["num_hidden_layers"], c["index_topk"]
    latent = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2  # BF16 (no FP8 KV asked)
    index = c["index_head_dim"] + 4  # FP8 keys and one FP32 scale per 128
    ctx = 131072
    assert float(spec.state_bytes_per_request(ctx)) == layers * (latent + index) * ctx
    attn = next(op for op in spec.layers[5].ops if op.name == "core_attn")
    assert float(attn.state_bytes_read(ctx)) == latent * topk + index * ctx
    assert float(attn.state_bytes_read(1000)) == (latent + index) * 1000  # below the top-k
    flops = float(attn.flops(1, ctx))
    assert flops == attn.attn_flops_per_context_token * topk + ctx * (2 * 64 * 128 + 64)
    # a decode step at 128K reads a fraction of what DeepSeek-V3's dense MLA reads
    v3 = model_spec_from_config({**c, "architectures": ["DeepseekV3ForCausalLM"]})
    sparse = estimate_step(spec, H200, tp=1, ep=8, dp=8, batch=64, context=ctx)
    dense = estimate_step(v3, H200, tp=1, ep=8, dp=8, batch=64, context=ctx)
    assert sparse.breakdown_s["attention"] < dense.breakdown_s["attention"] / 5


def test_an_fp8_cache_stores_dsa_latents_in_the_fp8_ds_mla_record() -> None:
    """An FP8 KV cache holds a DSA layer's latent as vLLM's fp8_ds_mla record (FP8 values, an FP32
    scale per 128, the rope key in BF16: 656 bytes for DeepSeek-V3.2), and a dense MLA layer's at
    one byte a value (576); the indexer's keys are FP8 either way."""
    c = config("deepseek-v3.2.json")
    lkv, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    record = lkv + 4 * (lkv // 128) + 2 * rope
    assert record == 656
    index = c["index_head_dim"] + 4
    sparse = load_model(CHECKPOINTS / "deepseek-v3.2.json", kv_cache_dtype="fp8")
    dense = model_spec_from_config(
        {**c, "architectures": ["DeepseekV3ForCausalLM"]}, kv_cache_dtype="fp8"
    )
    layers = c["num_hidden_layers"]
    assert float(sparse.state_bytes_per_request(1000)) == layers * (record + index) * 1000
    assert float(dense.state_bytes_per_request(1000)) == layers * (lkv + rope) * 1000
    attn = next(op for op in sparse.layers[5].ops if op.name == "core_attn")
    assert float(attn.state_bytes_read(131072)) == record * c["index_topk"] + index * 131072


def test_the_indexer_scores_on_every_tensor_parallel_rank() -> None:
    """Its linears are replicated (as MLA's down-projections): no block-FP8 split, and each of
    8 ranks computes every score while MLA's heads split."""
    spec = load_model(CHECKPOINTS / "deepseek-v3.2.json")
    attn = next(op for op in spec.layers[5].ops if op.name == "core_attn")
    from opweave.costmodel._private.roofline import op_bytes_and_flops

    _, one = op_bytes_and_flops(attn, 1, 4, 100_000)
    _, eight = op_bytes_and_flops(attn, 8, 4, 100_000)
    index = float(attn.index_flops(4, 100_000))
    assert eight == pytest.approx((one - index) / 8 + index)
    estimate_step(spec, H200, tp=8, batch=4, context=4096)  # the indexer's wk (128) not split


def test_glm_5_2_layers_that_share_an_indexer_hold_no_index_keys() -> None:
    c = config("glm-5.2-fp8.json")
    spec = load_model(CHECKPOINTS / "glm-5.2-fp8.json")
    assert spec.family == "glm_moe_dsa"
    dsa = spec.arch.sparse_index
    assert dsa is not None and len(dsa.indexer_layers) == c["indexer_types"].count("full") == 21
    latent, index = (512 + 64) * 2, 128 + 4
    per_token = float(spec.state_bytes_per_request(2)) - float(spec.state_bytes_per_request(1))
    assert per_token == 78 * latent + 21 * index
    shared = c["indexer_types"].index("shared")
    ops = {op.name: op for op in spec.layers[shared].ops}
    assert ops["core_attn"].index_bytes_per_context_token == 0
    assert ops["core_attn"].sparse_attended_tokens == 2048  # it still attends the top-k


def test_the_serving_engine_costs_a_dsa_layer_as_the_decode_step_does() -> None:
    spec = load_model(CHECKPOINTS / "deepseek-v3.2.json")
    par = Parallelism(tp=1, ep=8, dp=8)
    cost = EngineStepCost.build(spec, H200, par)
    step = estimate_step(spec, H200, tp=1, ep=8, dp=8, batch=64, context=50_000)
    engine = float(cost.decode_run_s(np.full(8, 50_000.0), 1)[0])
    assert engine == pytest.approx(step.step_latency_s, rel=0.1)
    # what one request holds: the latent and the index keys of all its tokens
    assert float(cost.kv_bytes(50_000.0)) == pytest.approx(
        float(spec.state_bytes_per_request(50_000)), rel=1e-9
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"indexer_types": ["full"] * 3}, "indexer_types: expected 61 entries"),
        ({"mlp_layer_types": ["sparse"] * 61}, "mlp_layer_types: disagrees"),
        ({"index_topk": 0}, r"index_topk: 0 is out of range"),
        ({"indexer_types": ["shared"] + ["full"] * 60}, "indexer_types: the first layer"),
    ],
)
def test_malformed_sparse_attention_keys(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        model_spec_from_config(config("deepseek-v3.2.json") | change)


def test_transformers_layer_type_names_of_dsa_layers_are_full_attention() -> None:
    """NVIDIA's GLM-5.2 NVFP4 config lists its layers as transformers 5 names them."""
    c = config("glm-5.2-fp8.json") | {"layer_types": ["deepseek_sparse_attention"] * 78}
    assert model_spec_from_config(c).arch.layer_types == ("full_attention",) * 78


def test_dsa_prefill_attends_the_latent_over_the_top_k() -> None:
    """A prefill chunk's sparse MLA: each query over at most index_topk positions, in the
    absorbed form (no up-projection of the prompt so far); the indexer over all positions."""
    spec = load_model(CHECKPOINTS / "deepseek-v3.2.json")
    cost = EngineStepCost.build(spec, H200, Parallelism(tp=1, ep=8, dp=8))
    sparse, index = cost.kinds[:2]
    attn = next(op for op in spec.layers[5].ops if op.name == "core_attn")
    assert sparse.prefill_flops_per_prefix_token == 0
    assert sparse.prefill_flops_per_pair == attn.attn_flops_per_context_token
    assert index.prefill_flops_per_pair == attn.index_flops_per_context_token
    assert (sparse.window, index.window) == (2048, math.inf)
