"""Expert parallelism with data-parallel attention: an MoE owner's experts sharded over its GPUs,
each GPU an attention replica with its own slice of the batch, tokens equal to transformers'."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors import safe_open

from opweave.costmodel import Plan, canonical_plan, load_model
from opweave.runtime import (
    FaultInjection,
    Placement,
    PlanMismatchError,
    Request,
    RunFailedError,
    RunOptions,
    ShardingError,
    StageModule,
    run_plan,
)
from opweave.runtime._private.schedule import rank_ops
from opweave.runtime._private.tensor_parallel import Shard

MAX_NEW_TOKENS = 16  # the same as the other runtime tests, so hf_greedy's cache is shared
TIMEOUT_S = 20.0


def _ep_plan(model_dir: Path, strategy: str, *, ep: int = 2, batch: int = 4, mb: int = 1) -> Plan:
    return canonical_plan(
        load_model(model_dir), strategy, gpu="cpu", batch=batch, microbatches=mb, ep=ep, dp=ep
    )


def _run(model_dir: Path, plan: Plan, prompts, limits=None, **kw) -> dict:
    limits = limits or [MAX_NEW_TOKENS] * len(prompts)
    requests = [Request(tuple(p), n) for p, n in zip(prompts, limits, strict=True)]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=TIMEOUT_S, **kw))
    assert result is not None
    return result.model_dump(mode="json")


def _checkpoint_bytes(model_dir: Path) -> tuple[int, dict[int, int]]:
    """Bytes of every tensor of the language model in the checkpoint (not a multimodal
    wrapper's vision tower), and of each routed expert's (summed over layers), from the
    safetensors header: ``experts.<e>.`` tensors or fused ``[E, ...]`` ones."""
    total, per = 0, {}
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no iterator)
            if name.startswith("model.visual."):
                continue
            t = f.get_slice(name)
            shape = t.get_shape()
            size = {"F32": 4, "BF16": 2, "F16": 2}[t.get_dtype()] * math.prod(shape)
            total += size
            if ".experts." not in name:
                continue
            index = name.split(".experts.", 1)[1].split(".")[0]
            if index.isdigit():
                per[int(index)] = per.get(int(index), 0) + size
            else:  # fused: experts along dim 0
                for e in range(shape[0]):
                    per[e] = per.get(e, 0) + size // shape[0]
    return total, per


@pytest.mark.parametrize("decode_step", ["per-request", "static"])
@pytest.mark.parametrize(
    "family", ["qwen3_moe", "mixtral", "deepseek_v3", "qwen3_5_moe", "minimax_m2"]
)
def test_an_ep2_owner_generates_transformers_tokens(
    family, decode_step, tiny_model, hf_greedy, prompts
):
    model_dir = tiny_model(family)
    plan = _ep_plan(model_dir, "colocated")
    result = _run(model_dir, plan, prompts, decode_step=decode_step)
    assert [o["token_ids"] for o in result["outputs"]] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert [(r["owner"], r["replica"]) for r in ranks] == [(0, 0), (0, 1)]
    # each rank read everything but the other rank's experts
    total, experts = _checkpoint_bytes(model_dir)
    n = len(experts)
    for i, r in enumerate(ranks):
        others = sum(b for e, b in experts.items() if not i * n // 2 <= e < (i + 1) * n // 2)
        assert r["weight_bytes_read"] == total - others


# traced, compiled: each decode iteration one rank program, the exchanges inside its graph
# (compiled: inductor's C++ wrapper)
@pytest.mark.parametrize("decode_step", ["per-request", "static", "traced", "compiled"])
def test_a_data_parallel_rank_without_requests_still_joins_the_exchanges(
    decode_step, tiny_model, hf_greedy, prompts
):
    """More requests than slots, finishing at different steps: one rank prefills a newcomer
    while the other decodes, and a rank whose requests are done idles while the other runs."""
    model_dir = tiny_model("qwen3_moe")
    more = [*prompts, (7, 8, 9), tuple(range(40, 50))]
    limits = [16, 3, 16, 2, 16, 9]
    expected = [
        t[:n] for t, n in zip(hf_greedy(model_dir, more, MAX_NEW_TOKENS), limits, strict=True)
    ]
    plan = _ep_plan(model_dir, "colocated")
    result = _run(model_dir, plan, more, limits, decode_step=decode_step)
    assert [o["token_ids"] for o in result["outputs"]] == expected
    for r in result["ranks"]:
        assert r["traffic_compiles"] == 0  # the warm-up traced every step the exchanges run in


def test_data_parallel_attention_over_a_dense_model(tiny_model, hf_greedy, prompts):
    """dp 2 at ep 1: two attention replicas of half the batch each, every weight on both."""
    model_dir = tiny_model("llama")
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", batch=4, dp=2)
    result = _run(model_dir, plan, prompts)
    assert [o["token_ids"] for o in result["outputs"]] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
    total, _ = _checkpoint_bytes(model_dir)
    assert [r["weight_bytes_read"] for r in result["ranks"]] == [total, total]


def test_an_afd_plan_whose_ffn_owner_has_ep2(tiny_model, hf_greedy, prompts):
    """Attention as two data-parallel replicas, the experts over the FFN owner's two ranks."""
    model_dir = tiny_model("qwen3_moe")
    plan = _ep_plan(model_dir, "afd")
    result = _run(model_dir, plan, prompts, decode_step="static")
    assert [o["token_ids"] for o in result["outputs"]] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert [(r["owner"], r["replica"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the FFN ranks read what the FFN owner's operators read unsharded, less the other
    # rank's experts; the attention ranks read theirs whole
    _, experts = _checkpoint_bytes(model_dir)
    n = len(experts)
    placement = Placement(plan, load_model(model_dir))
    for r in ranks:
        whole = StageModule(model_dir, rank_ops(placement, r["rank"])).checkpoint.bytes_read
        if r["owner"] == 0:
            assert r["weight_bytes_read"] == whole
            continue
        i = r["replica"]
        others = sum(b for e, b in experts.items() if not i * n // 2 <= e < (i + 1) * n // 2)
        assert r["weight_bytes_read"] == whole - others


# (tp, ep, dp): experts with TP over a whole data-parallel replica; expert sets of two GPUs
# each; EP inside one TP group (no exchange: the TP all-reduce sums the sets); the wide-EP layout
# with tensor-parallel attention replicas; 8 experts dealt to 3 sets (2, 3 and 3), by all-to-all
LAYOUTS = [(1, 1, 2), (1, 2, 4), (2, 2, 1), (2, 4, 2), (1, 3, 3)]


@pytest.mark.parametrize(("tp", "ep", "dp"), LAYOUTS, ids=lambda v: str(v))
def test_every_layout_the_planner_offers_generates_transformers_tokens(
    tp, ep, dp, tiny_model, hf_greedy, prompts
):
    """Each rank holds experts [s * E / ep, (s + 1) * E / ep) of set s = g / (tp dp / ep), and
    of those the g-th slice of the channels (g: its place in the replica): read from the
    checkpoint and nothing else of the experts."""
    model_dir = tiny_model("qwen3_moe")
    plan = canonical_plan(
        load_model(model_dir), "colocated", gpu="cpu", batch=4 * dp, tp=tp, ep=ep, dp=dp
    )
    more = [*prompts, (7, 8, 9)]  # attention replicas with unequal numbers of requests
    result = _run(model_dir, plan, more, decode_step="per-request" if tp == 1 else "static")
    assert [o["token_ids"] for o in result["outputs"]] == hf_greedy(model_dir, more, MAX_NEW_TOKENS)
    _, experts = _checkpoint_bytes(model_dir)
    n, g = len(experts), tp * dp
    placement = Placement(plan, load_model(model_dir))
    for r in result["ranks"]:
        s = r["rank"] // (g // ep)
        held = sum(b for e, b in experts.items() if s * n // ep <= e < (s + 1) * n // ep)
        info = placement.ranks[r["rank"]]
        others = StageModule(
            model_dir,
            [ref for ref in rank_ops(placement, r["rank"]) if ref[1] != "experts"],
            shard=Shard(info.tp_rank, info.tp_size),
        ).checkpoint.bytes_read
        assert r["weight_bytes_read"] == others + held // (g // ep)


@pytest.mark.parametrize(
    ("family", "decode_step"), [("deepseek_v3", "per-request"), ("minimax_m2", "traced")]
)
def test_wide_ep_under_tensor_parallel_attention(
    family, decode_step, tiny_model, hf_greedy, prompts
):
    """MLA (its latent cache per attention replica) and MiniMax's layer-wide q/k norms (summed
    over each attention replica's TP group) at tp 2 x dp 2, one expert set per GPU."""
    model_dir = tiny_model(family)
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", batch=8, tp=2, ep=4, dp=2)
    more = [*prompts, (7, 8, 9)]
    result = _run(model_dir, plan, more, decode_step=decode_step)
    assert [o["token_ids"] for o in result["outputs"]] == hf_greedy(model_dir, more, MAX_NEW_TOKENS)


@pytest.mark.parametrize(
    ("plan_kw", "message"),
    [
        ({"ep": 2, "dp": 2, "batch": 3}, r"a resident batch of 3 does not split over dp 2"),
        (
            {"ep": 2, "dp": 2, "batch": 4, "microbatches": 2},
            r"microbatch 0 has 2, 0 slots",
        ),
        ({"ep": 1, "dp": 64, "batch": 64}, r"intermediate size of 32 does not split over tp 64"),
    ],
)
def test_ep_plans_the_runtime_does_not_run_are_refused(plan_kw, message, tiny_model):
    model_dir = tiny_model("qwen3_moe")
    kw = {"batch": 4, "microbatches": 1} | plan_kw
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", **kw)
    with pytest.raises((PlanMismatchError, ShardingError), match=message):
        run_plan(plan, model_dir, [Request((5, 6), 2)])


def test_ep_over_a_dense_model_or_uneven_experts_is_refused(tiny_model):
    llama = tiny_model("llama")
    plan = _ep_plan(llama, "colocated")
    with pytest.raises(PlanMismatchError, match="has no routed experts; use ep 1"):
        run_plan(plan, llama, [Request((5, 6), 2)])
    mixtral = tiny_model("mixtral")  # 4 experts
    plan = canonical_plan(load_model(mixtral), "colocated", gpu="cpu", batch=8, tp=1, ep=8, dp=8)
    with pytest.raises(PlanMismatchError, match="4 routed experts are fewer than ep 8"):
        run_plan(plan, mixtral, [Request((5, 6), 2)])


def test_a_hanging_expert_parallel_peer_fails_the_run_naming_it(tiny_model):
    """Rank 1 hangs: rank 0 waits for it in an expert exchange, and the run ends naming rank 1
    (and its place in the group)."""
    model_dir = tiny_model("qwen3_moe")
    plan = _ep_plan(model_dir, "colocated")
    fault = FaultInjection(rank=1, iteration=3, mode="hang")
    with pytest.raises(RunFailedError) as info:
        run_plan(
            plan,
            model_dir,
            [Request((5, 6, 7), 12), Request((8, 9), 12), Request((10, 11), 12)],
            RunOptions(timeout_s=3, fault=fault),
        )
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("rank 1 (owner 0, replica 0, dp rank 1 of 2: stages embed..")
    assert "stopped responding" in message


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA devices (one NCCL rank each)")
@pytest.mark.parametrize("decode_step", ["per-request", "compiled"])
def test_an_ep2_owner_on_cuda_with_nccl(decode_step, tiny_model, prompts):
    """The exchanges over NCCL (all-to-all; a CUDA graph's all-reduces when compiled); tokens
    equal the single-process runtime's on the same device."""
    from opweave.runtime import LocalModel

    model_dir = tiny_model("qwen3_moe")
    expected = LocalModel(model_dir, device="cuda").generate(prompts, MAX_NEW_TOKENS)
    plan = _ep_plan(model_dir, "colocated")
    result = _run(model_dir, plan, prompts, device="cuda", decode_step=decode_step)
    assert [o["token_ids"] for o in result["outputs"]] == expected
    assert all(r["device"].startswith("cuda") for r in result["ranks"])
