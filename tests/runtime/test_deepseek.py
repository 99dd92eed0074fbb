"""DeepSeek-V3 (MLA, dense first layers, shared + group-limited routed experts) in the runtime.

The tiny ``deepseek_v3`` model also runs through every family-wide test (exactness, every plan
kind, the traced decode step, the operator contract); here: tensor parallelism over MLA, the
size of the latent cache, the router against a computation of its own, config variants, and
configs the runtime refuses.
"""

from __future__ import annotations

import pytest
import torch

from opweave.costmodel import OpWeaveError, canonical_plan, load_model
from opweave.runtime import (
    BatchMeta,
    LocalModel,
    Request,
    RunOptions,
    StageModule,
    TokenBatch,
    run_plan,
    write_tiny_model,
)

MAX_NEW_TOKENS = 16  # the family-wide tests' count: hf_greedy's cache is shared with them


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("deepseek_v3")


def test_the_tiny_model_has_what_makes_the_family(model_dir):
    arch = load_model(model_dir).arch
    assert arch.mla is not None and arch.mla.q_lora_rank and arch.mla.rope_interleave
    assert arch.moe_layers == (1, 2)  # layer 0 dense (first_k_dense_replace 1)
    moe = arch.moe
    assert moe is not None and moe.num_groups == 4 and moe.topk_groups == 2
    assert moe.score_correction_bias and moe.scoring_func == "sigmoid"
    assert moe.shared_intermediate_size == 32 and moe.routed_scaling_factor == 2.5
    assert arch.rope["full_attention"].rope_type == "yarn"


@pytest.mark.parametrize("strategy", ["colocated", "afd", "cad"])
def test_tp2_plans_generate_transformers_greedy_tokens(strategy, model_dir, hf_greedy, prompts):
    """Heads split over two ranks, the latent projections and the cache whole on each; every
    owner at TP 2, so CAD's core attention owner holds the whole latent cache on both ranks."""
    spec = load_model(model_dir)
    mb = 1 if strategy == "colocated" else 2
    plan = canonical_plan(spec, strategy, gpu="cpu", batch=4, microbatches=mb, tp=2)
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]

    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=20.0))

    assert result is not None
    tokens = [out.token_ids for out in result.outputs]
    assert [list(t) for t in tokens] == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    ranks = result.ranks
    assert len(ranks) == 2 * len(plan.owners)
    # each rank reads only its slices: less than the whole model, and the two ranks of an
    # owner the same amount (every sharded tensor splits evenly)
    whole = StageModule.whole_model(model_dir).checkpoint.bytes_read
    assert all(r.weight_bytes_read < whole for r in ranks)
    for owner in range(len(plan.owners)):
        pair = [r.weight_bytes_read for r in ranks[2 * owner : 2 * owner + 2]]
        assert pair[0] == pair[1]


def test_the_cache_holds_the_latent_and_rope_key_per_token_and_layer(model_dir):
    """kv_lora_rank + qk_rope_head_dim values per token per layer (32 + 8 here), not the
    expanded keys and values (4 heads x (24 + 16))."""
    stage = StageModule.whole_model(model_dir)
    prompt = list(range(5, 21))  # 16 tokens: exactly the initial capacity of a cache
    meta = BatchMeta(("r",), (len(prompt),), (0,))
    stage.admit(meta.request_ids)
    stage(TokenBatch(meta, {"token_ids": torch.tensor(prompt)}))
    attention = [op for op in stage.operators if op.name == "core_attn"]
    assert len(attention) == 3
    for op in attention:
        assert op.state_bytes("r") == len(prompt) * (32 + 8) * 4  # float32


def _router_reference(hidden, weight, bias, *, groups, topk_groups, top_k, scale):
    """DeepSeek-V3's routing written out row by row: groups ranked by the sum of their two best
    biased scores, experts chosen by biased score among the best groups, weighted by their
    unbiased scores, renormalised and scaled."""
    scores = torch.sigmoid(hidden.double() @ weight.double().T)
    biased = scores + bias.double()
    size = scores.shape[1] // groups
    ids, weights = [], []
    for row_scores, row_biased in zip(scores.tolist(), biased.tolist(), strict=True):
        rank = [sum(sorted(row_biased[g * size : (g + 1) * size])[-2:]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -rank[g])[:topk_groups]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -row_biased[e])[:top_k]
        total = sum(row_scores[e] for e in chosen)
        ids.append(chosen)
        weights.append([row_scores[e] / total * scale for e in chosen])
    return ids, weights


def test_group_limited_router_matches_its_definition(model_dir):
    stage = StageModule.whole_model(model_dir)
    router = next(op for op in stage.operators if op.name == "router" and op.layer == 1)
    moe = load_model(model_dir).arch.moe
    assert moe is not None
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    meta = BatchMeta(("r",), (64,), (0,))

    out = router(TokenBatch(meta, {"hidden": hidden}))

    ids, weights = _router_reference(
        hidden,
        router.weight,
        router.bias,
        groups=moe.num_groups,
        topk_groups=moe.topk_groups,
        top_k=moe.top_k,
        scale=moe.routed_scaling_factor,
    )
    got_ids, order = torch.sort(out["topk_ids"], dim=-1)  # in expert order, as they are summed
    got_weights = torch.gather(out["topk_weights"], 1, order)
    assert got_ids.tolist() == [sorted(row) for row in ids]
    want_weights = [
        [w for _, w in sorted(zip(row_ids, row_weights, strict=True))]
        for row_ids, row_weights in zip(ids, weights, strict=True)
    ]
    torch.testing.assert_close(
        got_weights.double(), torch.tensor(want_weights, dtype=torch.float64), rtol=1e-6, atol=0
    )
    # the group limit matters for this model: an unlimited top-k picks differently for some rows
    biased = torch.sigmoid(hidden @ router.weight.T) + router.bias
    unlimited = torch.sort(torch.topk(biased, moe.top_k, dim=-1)[1], dim=-1)[0]
    assert (unlimited != got_ids).any(dim=-1).sum() > 0


@pytest.mark.parametrize(
    ("variant", "overrides"),
    [
        ("q_proj", {"q_lora_rank": None}),  # DeepSeek-V2-Lite style: no query LoRA
        ("rope-halves", {"rope_interleave": False}),
        ("one-group", {"n_group": 1, "topk_group": 1}),
        ("two-dense", {"num_hidden_layers": 4, "first_k_dense_replace": 2}),
    ],
)
def test_config_variants_generate_transformers_greedy_tokens(
    variant, overrides, tmp_path, hf_greedy, prompts
):
    folder = write_tiny_model("deepseek_v3", tmp_path / variant, **overrides)
    model = LocalModel(folder)
    assert model.generate(prompts, 8) == hf_greedy(folder, prompts, 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_group": 3}, "n_group: 8 experts do not split into 3 groups"),
        ({"topk_group": 5}, "topk_group: 5 is more than the 4 groups"),
        (
            {"n_group": 8, "topk_group": 2},
            "n_group: 8 groups of one expert; group-limited routing ranks a group by its two "
            "best experts, so a group needs at least 2",
        ),
    ],
)
def test_bad_routing_configs_are_one_line_errors(overrides, message, model_dir, tmp_path):
    import json
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | overrides))
    with pytest.raises(OpWeaveError) as info:
        LocalModel(folder)
    text = str(info.value)
    assert text.endswith(message) and "\n" not in text, text


def test_a_kimi_k2_5_wrapper_checkpoint_serves_its_text_model(
    model_dir, tmp_path, hf_greedy, prompts
):
    """Kimi-K2.5's layout (moonshotai/Kimi-K2.5: model_type kimi_k25 around a kimi_k2 text
    config, weights under language_model.model. and language_model.lm_head): the tiny
    DeepSeek-V3's weights renamed into it give the tiny model's own transformers tokens
    (tensor parallelism over this family is tested above)."""
    import json

    from safetensors.torch import load_file, save_file

    wrapped = tmp_path / "kimi-k2.5"
    wrapped.mkdir()
    text = json.loads((model_dir / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"model_type": "kimi_k25_vision"},
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
    }
    (wrapped / "config.json").write_text(json.dumps(config))
    tensors = load_file(model_dir / "model.safetensors")
    save_file({f"language_model.{k}": v for k, v in tensors.items()}, wrapped / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).exists():
            (wrapped / name).write_bytes((model_dir / name).read_bytes())
    spec = load_model(wrapped)
    assert spec.family == "deepseek_v3" and spec.weight_bytes == load_model(model_dir).weight_bytes
    assert LocalModel(wrapped).generate(prompts, MAX_NEW_TOKENS) == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
