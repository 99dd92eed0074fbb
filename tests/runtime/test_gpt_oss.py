"""gpt-oss (sliding/full alternation, attention sinks, biased experts with the clamped SwiGLU)
in the runtime.

The tiny ``gpt_oss`` model also runs through every family-wide test (exactness, every plan
kind, the traced decode step, the operator contract); here: tensor parallelism, the sink
softmax against a computation of its own, and that the tiny model reaches the SwiGLU clamp.
"""

from __future__ import annotations

import math

import pytest
import torch

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import BatchMeta, Request, RunOptions, StageModule, TokenBatch, run_plan

MAX_NEW_TOKENS = 16  # the family-wide tests' count: hf_greedy's cache is shared with them


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("gpt_oss")


def test_the_tiny_model_has_what_makes_the_family(model_dir):
    arch = load_model(model_dir).arch
    assert arch.layer_types == ("sliding_attention", "full_attention")
    assert arch.sliding_window == 8 and arch.attn_sinks and arch.qkv_bias and arch.o_bias
    assert arch.moe is not None and arch.moe.router_bias and arch.moe.expert_bias
    rope = arch.rope["full_attention"]
    assert rope.rope_type == "yarn" and not rope.truncate


@pytest.mark.parametrize("strategy", ["colocated", "afd", "cad"])
def test_tp2_plans_generate_transformers_greedy_tokens(strategy, model_dir, hf_greedy, prompts):
    """Heads (with their sinks) and expert channels split over two ranks; the experts' down
    bias counted once."""
    mb = 1 if strategy == "colocated" else 2
    plan = canonical_plan(
        load_model(model_dir), strategy, gpu="cpu", batch=4, microbatches=mb, tp=2
    )
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]

    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=20.0))

    assert result is not None
    tokens = [list(out.token_ids) for out in result.outputs]
    assert tokens == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    whole = StageModule.whole_model(model_dir).checkpoint.bytes_read
    assert len(result.ranks) == 2 * len(plan.owners)
    assert all(r.weight_bytes_read < whole for r in result.ranks)


def test_sinks_join_the_softmax_and_are_dropped(model_dir):
    """A prefill of the full layer against the sink softmax written out per head: weights
    ``exp(s_j) / (sum_j exp(s_j) + exp(sink))`` over the causal keys."""
    stage = StageModule(model_dir, [(1, "core_attn")])
    op = stage.operators[0]
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, d = 6, 4, 2, 16
    q = torch.randn(n, heads, d, generator=gen)
    k = torch.randn(n, kv_heads, d, generator=gen)
    v = torch.randn(n, kv_heads, d, generator=gen)
    meta = BatchMeta(("r",), (n,), (0,))
    stage.admit(meta.request_ids)

    out = op(TokenBatch(meta, {"q": q, "k": k, "v": v}))["hidden"].view(n, heads, d)

    sinks = op.sinks.double().tolist()
    scale = 1 / math.sqrt(d)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        for i in range(n):
            scores = [(q[i, h].double() @ k[j, kv].double()).item() * scale for j in range(i + 1)]
            denom = sum(math.exp(s) for s in scores) + math.exp(sinks[h])
            want = sum(math.exp(s) / denom * v[j, kv].double() for j, s in enumerate(scores))
            torch.testing.assert_close(out[i, h].double(), want, rtol=1e-5, atol=1e-6)


def test_the_swiglu_clamp_is_reached(model_dir, prompts):
    """The tiny model's limit (1.5) clips some gate and up values, so the tokens check it."""
    stage = StageModule.whole_model(model_dir)
    experts = next(op for op in stage.operators if op.name == "experts")
    seen = []
    gate = experts._gate

    def spy(gate_up):
        seen.append(gate_up.abs().max().item())
        return gate(gate_up)

    experts._gate = spy
    meta = BatchMeta(("r",), (len(prompts[2]),), (0,))
    stage.admit(meta.request_ids)
    stage(TokenBatch(meta, {"token_ids": torch.tensor(prompts[2])}))
    assert max(seen) > load_model(model_dir).arch.moe.swiglu_limit


@pytest.mark.parametrize(("tp", "ep", "dp"), [(1, 2, 2)], ids=str)
def test_expert_parallel_plans_generate_transformers_greedy_tokens(
    tp, ep, dp, model_dir, hf_greedy, prompts
):
    """Experts (with their biases) sharded over expert sets, each expert's channels over its
    set's GPUs; the down bias counted once per set."""
    plan = canonical_plan(
        load_model(model_dir), "colocated", gpu="cpu", batch=4 * dp, tp=tp, ep=ep, dp=dp
    )
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]

    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=20.0, decode_step="static"))

    assert result is not None
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
