"""Plans with a prefill pool: prefill ranks compute the prompts, the decode ranks never prefill.

Each run forks the decode ranks and the prefill pool's ranks (gloo on 127.0.0.1) under the
offline driver; the tokens must be transformers' greedy tokens, and the state bytes the pool
reports must be what the model's config says a prompt's state weighs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opweave.costmodel import Plan, PrefillPool, canonical_plan, load_model
from opweave.runtime import (
    FaultInjection,
    Placement,
    Request,
    RunFailedError,
    RunOptions,
    run_plan,
)

MAX_NEW_TOKENS = 16  # as the other runtime tests, so hf_greedy's cache is shared
TIMEOUT_S = 20.0


def _pd_plan(model_dir: Path, strategy: str, *, tp: int = 1, pool: int = 2) -> Plan:
    plan = canonical_plan(
        load_model(model_dir),
        strategy,
        gpu="cpu",
        batch=4 if strategy == "colocated" else 2,
        microbatches=1 if strategy == "colocated" else 2,
        tp=tp,
        replicas=1 if strategy == "colocated" else 2,
    )
    return plan.model_copy(update={"prefill": PrefillPool(gpu="cpu", tp=tp, replicas=pool)})


def _state_bytes_per_request(model_dir: Path, prompt_tokens: int) -> int:
    """A prompt's state, from config.json alone: keys and values of every full-attention layer
    (a sliding layer keeps at most its window), a linear-attention layer's conv window and
    float32 recurrent state, an MLA layer's latent (compressed KV and rope key) per token."""
    c = json.loads((model_dir / "config.json").read_text())
    dtype = {"float32": 4, "bfloat16": 2, "float16": 2}[c["dtype"]]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kinds = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    total = 0
    for kind in kinds:
        if kind == "linear_attention":
            key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
            value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
            conv = (2 * key_dim + value_dim) * (c["linear_conv_kernel_dim"] - 1) * dtype
            recurrent = (
                c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
            ) * 4
            total += conv + recurrent
        elif "kv_lora_rank" in c:
            total += (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * prompt_tokens * dtype
        else:
            tokens = prompt_tokens
            if kind == "sliding_attention":
                tokens = min(prompt_tokens, c["sliding_window"])
            total += 2 * c["num_key_value_heads"] * head_dim * tokens * dtype
    return total


CASES = {
    "llama-colocated": ("llama", "colocated", 1, "per-request"),
    # the states through torch.distributed point-to-point (gloo), the path CUDA takes (NCCL)
    "llama-cad-tp2-gloo-p2p": ("llama", "cad", 2, "torch-p2p"),
    "llama-afd-tp2": ("llama", "afd", 2, "per-request"),
    "gemma3-cad-static": ("gemma3_text", "cad", 1, "static"),
    "deepseek_v3-afd-static": ("deepseek_v3", "afd", 1, "static"),
    "qwen3_next-cad-tp2-static": ("qwen3_next", "cad", 2, "static"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_prefill_pool_prefills_and_the_decode_ranks_continue_token_exact(
    case, tiny_model, hf_greedy, prompts
):
    family, strategy, tp, step = CASES[case]
    model_dir = tiny_model(family)
    plan = _pd_plan(model_dir, strategy, tp=tp)
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    p2p = step == "torch-p2p"
    options = RunOptions(
        timeout_s=TIMEOUT_S, decode_step="per-request" if p2p else step, test_torch_p2p=p2p
    )
    result = run_plan(plan, model_dir, requests, options)
    assert result is not None
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
    # every request's state went over once, weighing what its config says
    for out in result.outputs:
        assert out.transfer_bytes == _state_bytes_per_request(model_dir, len(out.prompt_token_ids))
        assert out.ttft_s is not None and out.ttft_s > 0
        assert out.tpot_s is not None and out.tpot_s > 0
    assert result.transfer is not None
    assert result.transfer.prefills == len(prompts)
    assert result.transfer.bytes == sum(o.transfer_bytes or 0 for o in result.outputs)
    # one message per request and state-holding decode rank (every TP rank of the replica
    # that holds its slot, of the one owner with a core_attn)
    assert result.transfer.messages == len(prompts) * tp
    decode = [r for r in result.ranks if r.pool == "decode"]
    prefill = [r for r in result.ranks if r.pool == "prefill"]
    assert len(prefill) == 2 * tp and all(r.owner == -1 for r in prefill)
    assert sum(r.iterations for r in prefill) == len(prompts) * tp  # each prompt once per TP rank
    assert len(decode) == sum(o.replicas * o.tp for o in plan.owners)
    # the decode ranks never ran a prompt: every launch of theirs was in a decode iteration
    for r in decode:
        assert r.submissions > 0
        assert r.submissions == round(r.submissions_per_token * r.decode_iterations)
    assert all(r.requests_held_at_end == 0 for r in result.ranks)


# (family, strategy, decode tp, prefill tp): key/value heads (a sliding layer's ring too),
# gated DeltaNet's conv channels and recurrent heads, and MLA's latent (whole on every rank)
# re-cut from the pool's TP to the decode owners'
RESHARD = [
    ("llama", "afd", 2, 1),
    ("gemma3_text", "colocated", 1, 2),
    ("qwen3_next", "cad", 2, 1),
    ("deepseek_v3", "colocated", 2, 1),
]


@pytest.mark.parametrize(("family", "strategy", "tp", "pool_tp"), RESHARD)
def test_a_prefill_pool_at_another_tp_than_the_decode_owners(
    family, strategy, tp, pool_tp, tiny_model, hf_greedy, prompts
):
    model_dir = tiny_model(family)
    plan = _pd_plan(model_dir, strategy, tp=tp)
    plan = plan.model_copy(update={"prefill": PrefillPool(gpu="cpu", tp=pool_tp, replicas=1)})
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=TIMEOUT_S))
    assert result is not None
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
    # each request's state went to the tp ranks of one decode replica, each taking its cut:
    # together the whole state, or, for MLA's latent, the whole of it on each
    assert result.transfer is not None
    assert result.transfer.messages == len(prompts) * tp
    whole = sum(_state_bytes_per_request(model_dir, len(p)) for p in prompts)
    assert result.transfer.bytes == whole * (tp if family == "deepseek_v3" else 1)


@pytest.mark.parametrize(
    ("mode", "expect"),
    [("kill", "killed by signal 9"), ("hang", "stopped responding"), ("exit", "exited")],
)
def test_a_prefill_rank_that_dies_or_hangs_fails_the_run_naming_it(mode, expect, tiny_model):
    """Rank 2 is the prefill pool's (after the AFD plan's two decode ranks); it fails at its
    second prefill, while the decode ranks wait for that request's state."""
    model_dir = tiny_model("llama")
    plan = canonical_plan(load_model(model_dir), "afd", gpu="cpu", batch=2, microbatches=2)
    plan = plan.model_copy(update={"prefill": PrefillPool(gpu="cpu", tp=1, replicas=1)})
    fault = FaultInjection(rank=2, iteration=1, mode=mode)
    with pytest.raises(RunFailedError) as info:
        run_plan(
            plan,
            model_dir,
            [Request((5, 6, 7), 8), Request((8, 9), 8)],
            RunOptions(timeout_s=3, fault=fault),
        )
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("rank 2 (prefill replica 0: the whole model's prefill)")
    assert expect in message


def test_a_decode_rank_that_dies_fails_a_pd_run_naming_it(tiny_model):
    model_dir = tiny_model("llama")
    plan = _pd_plan(model_dir, "afd", pool=1)
    fault = FaultInjection(rank=2, iteration=3, mode="kill")  # owner 1's first replica
    with pytest.raises(RunFailedError) as info:
        run_plan(plan, model_dir, [Request((5, 6, 7), 12)], RunOptions(timeout_s=3, fault=fault))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("rank 2 (owner 1, replica 0: stages L0.ffn_norm..L0.down_proj")
    assert "killed by signal 9" in message


def test_a_seeded_sampled_request_draws_the_same_tokens_with_and_without_the_pool(tiny_model):
    """The prefill rank draws the first token from the request's seed; the decode rank's
    generator continues after that draw, so every token is the one the plan without a pool
    samples."""
    from opweave.runtime import Cluster, SamplingParams, StepDriver, StepItem

    model_dir = tiny_model("llama")
    model = load_model(model_dir)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    prompt = tuple(range(5, 17))

    def sample(plan: Plan) -> list[int]:
        cluster = Cluster(plan, model, model_dir, RunOptions(timeout_s=TIMEOUT_S))
        try:
            driver = StepDriver(cluster)
            driver.add("a", prompt, params)
            driver.step([StepItem("a", 0, len(prompt))])
            for _ in range(7):
                known = len(driver.requests["a"].token_ids)
                driver.step([StepItem("a", known - 1, 1)])
            tokens = driver.requests["a"].token_ids[len(prompt) :]
            driver.drop("a")
            driver.flush()
            cluster.shutdown()
        finally:
            cluster.close()
        return tokens

    plan = canonical_plan(model, "afd", gpu="cpu", batch=2, microbatches=2)
    alone = sample(plan)
    pool = PrefillPool(gpu="cpu", tp=1, replicas=1)
    assert sample(plan.model_copy(update={"prefill": pool})) == alone
    assert len(alone) == 8


def test_a_prefill_pool_beside_an_expert_parallel_ffn_owner(tiny_model, hf_greedy, prompts):
    """The attention owner whole (it holds the KV cache), the FFN owner's experts over two
    data-parallel ranks, and a prefill pool: the pool's state goes to the attention owner, the
    expert exchange stays among the FFN owner's ranks, and the tokens are transformers'."""
    model_dir = tiny_model("qwen3_moe")
    plan = canonical_plan(load_model(model_dir), "afd", gpu="cpu", batch=4, microbatches=1)
    ffn = plan.owners[1].model_copy(update={"ep": 2, "dp": 2})
    plan = plan.model_copy(
        update={
            "owners": [plan.owners[0], ffn],
            "prefill": PrefillPool(gpu="cpu", tp=1, replicas=1),
        }
    )
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=TIMEOUT_S))
    assert result is not None
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
    assert [r.pool for r in result.ranks] == ["decode"] * 3 + ["prefill"]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_prefill_and_decode(family, tiny_model, hf_greedy, prompts):
    """A DeepSeek-style P/D deployment: decode on tp 2 x dp 2 with one expert set per GPU, the
    KV cache over its two attention replicas, and a prefill replica laid out the same way (its
    attention replicas take prefills in turn, the other joining the expert exchanges without
    rows); each request's state goes to the attention replica holding its slot."""
    model_dir = tiny_model(family)
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", batch=4, tp=2, ep=4, dp=2)
    pool = PrefillPool(gpu="cpu", tp=2, ep=4, dp=2, replicas=1)
    plan = plan.model_copy(update={"prefill": pool})
    more = [*prompts, (7, 8, 9)]
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in more]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=TIMEOUT_S))
    assert result is not None
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(model_dir, more, MAX_NEW_TOKENS)
    assert [r.pool for r in result.ranks] == ["decode"] * 4 + ["prefill"] * 4
    assert all(r.iterations > 0 for r in result.ranks if r.pool == "prefill")  # both took turns
    # every prompt's state moved once, to the two TP ranks of one attention replica
    assert result.transfer is not None and result.transfer.messages == 2 * len(more)


def test_each_prefill_replica_gives_its_prompts_to_its_attention_replicas_in_turn(tiny_model):
    """Round robin over 2 replicas, then over each one's 2 attention replicas: all four
    (replica, attention replica) pairs prefill, none idles for good."""
    model_dir = tiny_model("qwen3_moe")
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", batch=4)
    pool = PrefillPool(gpu="cpu", tp=1, ep=2, dp=2, replicas=2)
    placement = Placement(plan.model_copy(update={"prefill": pool}), load_model(model_dir))
    pairs = [(seq % 2, placement.prefill_dp_rank(seq)) for seq in range(8)]
    assert sorted(set(pairs)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert pairs[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_a_prefill_batch_holds_at_most_the_token_budget():
    """A batch takes prompts in order while their tokens fit vLLM's default budget (8192); a
    longer prompt runs alone."""
    from opweave.runtime._private.messages import Prefill
    from opweave.runtime._private.prefill import BATCH_TOKENS, _token_batches
    from opweave.runtime._private.work import SamplingParams

    def prompt(seq: int, n: int) -> Prefill:
        return Prefill(seq, f"r{seq}", seq, (1,) * n, SamplingParams())

    prompts = [prompt(0, 5000), prompt(1, 3000), prompt(2, 300), prompt(3, 9000), prompt(4, 1)]
    batches = [[p.seq for p in b] for b in _token_batches(prompts)]
    assert BATCH_TOKENS == 8192
    assert batches == [[0, 1], [2], [3], [4]]
