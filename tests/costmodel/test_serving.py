"""Serving estimates (issue 38): prefill cost, the scheduler simulation, aggregated serving."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import ClassVar

import numpy as np
import pytest
from pydantic import ValidationError

from opweave.costmodel import (
    ConfigError,
    EngineSetup,
    EngineStepCost,
    GraphBatches,
    Lengths,
    Parallelism,
    Workload,
    causal_pairs,
    decode_handoff_s,
    decode_pool,
    default_batch_limits,
    default_catalog,
    estimate_serving,
    estimate_step,
    host_profile,
    kv_transfer_s,
    load_model,
    prefill_pool,
    sglang_graph_max_bs,
    sglang_mem_fraction,
    simulate,
)

# Qwen/Qwen3-32B config.json (huggingface.co): the numbers an independent count needs
Q32 = {
    "hidden": 5120,
    "layers": 64,
    "heads": 64,
    "kv_heads": 8,
    "head_dim": 128,
    "intermediate": 25600,
    "vocab": 151936,
}


def independent_prefill_flops(start: int, tokens: int, tp: int) -> float:
    """Matmul FLOPs of a Qwen3-32B prefill chunk from its config: 2 x weights x tokens for
    the projections and MLP, 4 x heads x head_dim per causal query-key pair, the LM head at
    one position; split over ``tp`` GPUs."""
    h, d = Q32["hidden"], Q32["head_dim"]
    q, kv = Q32["heads"] * d, Q32["kv_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * Q32["intermediate"]
    pairs = sum(range(start + 1, start + tokens + 1))
    attention = 4 * Q32["heads"] * d * pairs
    layers = Q32["layers"] * (2 * per_layer * tokens + attention)
    return (layers + 2 * h * Q32["vocab"]) / tp


@pytest.fixture(scope="module")
def qwen32():
    return load_model("qwen3-32b")


@pytest.fixture(scope="module")
def h100():
    return default_catalog().get("h100")


@pytest.mark.parametrize(("start", "tokens", "tp"), [(0, 4096, 1), (8192, 2048, 4), (0, 1, 2)])
def test_prefill_flops_match_an_independent_count(qwen32, h100, start, tokens, tp) -> None:
    cost = EngineStepCost.build(qwen32, h100, Parallelism(tp=tp))
    flops, _ = cost.prefill_work(start, tokens)
    expected = independent_prefill_flops(start, tokens, tp)
    # the rest is norms, rope, the router-free activations: well under 1%
    assert flops == pytest.approx(expected, rel=0.01)
    assert flops >= expected


def test_a_long_prefill_chunk_is_compute_bound_and_reads_the_weights_once(qwen32, h100) -> None:
    tp = 4
    cost = EngineStepCost.build(qwen32, h100, Parallelism(tp=tp))
    flops, num_bytes = cost.prefill_work(0, 8192)
    weights = qwen32.weight_bytes / tp
    kv_written = 8192 * 64 * 2 * (8 // tp) * 128 * 2
    assert num_bytes > weights + kv_written  # and activations, per token
    # the weights once per step: a second chunk in the same step adds no weight bytes
    _, twice = cost.prefill_work(0, 16384)
    assert twice - num_bytes == pytest.approx(num_bytes - weights, rel=0.02)
    assert num_bytes / h100.effective_bandwidth < flops / h100.effective_flops  # compute-bound
    seconds = cost.step_s(np.zeros(0), [(0, 8192)])
    compute = independent_prefill_flops(0, 8192, tp) / h100.effective_flops
    # at most: the math, every byte at the memory's rate, the two ring all-reduces per layer
    # of the chunk's hidden states over NVLink, and a millisecond of launches
    ring = 2 * (tp - 1) / tp * 8192 * Q32["hidden"] * 2
    allreduce = 2 * 64 * ring / (h100.intra_node_bandwidth_bytes_per_s * h100.link_efficiency)
    upper = compute + num_bytes / h100.effective_bandwidth + allreduce + 1e-3
    assert compute < seconds < upper


def test_prefill_attention_runs_at_the_kernels_measured_fraction(qwen32, h100) -> None:
    """[AIC-ATTN]: causal prefill attention over 128-wide heads reaches 0.70 of the dense BF16
    rate in NVIDIA's database (median over GPUs and engines); a CPU rank's runs at the rate."""
    start, tokens = 16384, 8192  # compute-bound: the pairs' FLOPs dwarf the cache's bytes
    pairs = sum(range(start + 1, start + tokens + 1))
    pair_flops = Q32["layers"] * 4 * Q32["heads"] * Q32["head_dim"] * pairs
    plain = h100.model_copy(update={"engine_kernels": False})
    times = []
    for hw in (h100, plain):
        cost = EngineStepCost.build(qwen32, hw, Parallelism(tp=1))
        empty = [np.zeros(1) for _ in cost.kinds]
        times.append(float(cost.attention_s(0, empty, [(start, tokens)])[0]))
    extra = pair_flops * (1 / 0.70 - 1) / h100.effective_flops
    assert times[0] - times[1] == pytest.approx(extra, rel=1e-6)


def test_causal_pairs_against_counting() -> None:
    for start, tokens, window in [(0, 7, math.inf), (5, 9, math.inf), (3, 10, 6), (10, 4, 6)]:
        brute = sum(min(i, window) for i in range(start + 1, start + tokens + 1))
        assert causal_pairs(start, tokens, window) == brute


def test_mla_prefill_attends_in_the_expanded_form(h100) -> None:
    """DeepSeek-V3 prefills with 192-wide keys and 128-wide values per head (vLLM's MLA
    prefill path), not over the 576-wide latent its decode attends."""
    ds = load_model("deepseek-v3")
    cost = EngineStepCost.build(ds, default_catalog().get("h200"), Parallelism(tp=8))
    kind = next(k for k in cost.kinds if k.prefill_flops_per_pair)
    assert kind.prefill_flops_per_pair == 128 / 8 * 2 * (192 + 128)
    assert kind.flops_per_attended == 128 / 8 * (2 * 576 + 2 * 512)


def test_a_decode_only_step_is_the_decode_estimate(qwen32, h100) -> None:
    cost = EngineStepCost.build(qwen32, h100, Parallelism(tp=2))
    est = estimate_step(qwen32, h100, tp=2, batch=48, context=3000)
    assert cost.step_s(np.full(48, 3000.0), []) == pytest.approx(est.step_latency_s, rel=1e-9)
    run = cost.decode_run_s(np.array([100.0, 200.0]), 3)
    each = [cost.step_s(np.array([100.0 + j, 200.0 + j]), []) for j in range(3)]
    assert run == pytest.approx(each, rel=1e-12)


def test_an_eager_step_with_prompt_chunks_takes_its_launches_host_time(qwen32, h100) -> None:
    """[EAGER-PREFILL]: SGLang and TensorRT-LLM run steps with prompt chunks outside CUDA graphs;
    such a step takes the longer of its GPU time and its kernels' launch time on the host."""
    eager_hw = host_profile("sglang").apply(h100)
    eager = EngineStepCost.build(qwen32, eager_hw, Parallelism(tp=4))
    graphed = EngineStepCost.build(qwen32, h100, Parallelism(tp=4))
    # Qwen3-32B launches per forward: 64 layers x (norm, QKV GEMM + q/k norms (3), rope,
    # attention (2), o_proj, norm, gate_up + SiLU-and-mul (2), down) + embed, final norm,
    # lm_head and sampling
    host_s = (64 * 12 + 4) * eager_hw.eager_launch_s
    assert eager.kernels == 64 * 12 + 4
    short, long = [(0, 16)], [(0, 8192)]
    assert graphed.step_s(np.zeros(0), short) < host_s
    assert eager.step_s(np.zeros(0), short) == pytest.approx(host_s, rel=1e-12)
    assert eager.step_s(np.full(8, 900.0), short) == pytest.approx(host_s, rel=1e-12)
    # a long chunk keeps the GPU busier than the host; decode-only steps replay graphs
    assert graphed.step_s(np.zeros(0), long) > host_s
    assert eager.step_s(np.zeros(0), long) == graphed.step_s(np.zeros(0), long)
    decodes = np.full(32, 2048.0)
    assert eager.step_s(decodes, []) == graphed.step_s(decodes, [])
    # a short prompt alone: its TTFT is the host-bound step
    w = Workload(isl=Lengths.fixed(16), osl=Lengths.fixed(8), rate_per_s=0.05)
    est = estimate_serving(qwen32, h100, tp=4, workload=w, host=host_profile("sglang"))
    assert est.ttft_s == pytest.approx(host_s, rel=0.01)


def test_an_engines_defaults(qwen32, h100) -> None:
    """[SGL-BATCH] SGLang's chunk size by GPU memory and its running-request cap, [TRT-BATCH]
    trtllm-serve's limits; an engine's step policy and host profile apply where the workload
    gives none, and what is given wins."""
    cat = default_catalog()
    assert default_batch_limits(cat.get("l4"), "sglang") == (2048, 2048)  # 24 GB
    assert default_batch_limits(cat.get("l40s"), "sglang") == (4096, 2048)  # 48 GB
    assert default_batch_limits(cat.get("h100"), "sglang") == (8192, 2048)
    assert default_batch_limits(cat.get("h200"), "sglang") == (8192, 2048)  # 141 GB
    assert default_batch_limits(cat.get("b200"), "sglang") == (16384, 2048)  # 180 GB
    assert default_batch_limits(cat.get("a100"), "tensorrt-llm") == (8192, 2048)
    lengths = {"isl": Lengths.uniform(800, 1200), "osl": Lengths.uniform(200, 300)}
    w = Workload(**lengths, concurrency=16, engine="sglang")
    assert w.step_policy == "prefill-first" and w.engine_name == "SGLang"
    assert w.model_copy(update={"scheduling": "mixed"}).step_policy == "mixed"
    assert Workload(**lengths, concurrency=16, engine="tensorrt-llm").step_policy == "mixed"
    # [SGL-DP]: SGLang's chunk is shared by its data-parallel attention ranks; vLLM's are not
    assert w.batch_limits(cat.get("h200"), dp=8) == (1024, 2048)
    vllm = Workload(**lengths, concurrency=16, max_num_batched_tokens=4096)
    assert vllm.batch_limits(cat.get("h200"), dp=8) == (4096, 1024)
    by_engine = estimate_serving(qwen32, h100, tp=4, workload=w)
    spelled = Workload(
        **lengths,
        concurrency=16,
        scheduling="prefill-first",
        max_num_batched_tokens=8192,
        max_num_seqs=2048,
    )
    by_hand = estimate_serving(qwen32, h100, tp=4, workload=spelled, host=host_profile("sglang"))
    assert (by_engine.ttft_s, by_engine.tpot_s) == (by_hand.ttft_s, by_hand.tpot_s)
    # a host profile given explicitly replaces the engine's: no eager prompt steps
    graphed = estimate_serving(qwen32, h100, tp=4, workload=w, host=host_profile("overlapped"))
    assert graphed.ttft_s < by_engine.ttft_s


# -- the scheduler simulation against a brute force written here -----------------------------
class StubCost:
    """Step time = 1 ms + 0.1 ms per token + 1 us per attended decode position; a cache of one
    byte per token."""

    kinds: ClassVar[list[object]] = []

    def step_s(self, contexts, chunks) -> float:
        tokens = len(contexts) + sum(c for _, c in chunks)
        return 1e-3 + 1e-4 * tokens + 1e-6 * float(np.sum(contexts))

    def decode_run_s(self, contexts, steps):
        return np.array([self.step_s(contexts + j, []) for j in range(steps)])

    def kv_bytes(self, contexts):
        return np.asarray(contexts, dtype=np.float64)


def brute_force(
    prompt: int,
    output: int,
    clients: int,
    n: int,
    step_budget: int,
    prefill_first: bool = False,
    recv_interval: int = 1,
):
    """One step at a time: running requests first (a decode token, or the next chunk of the
    prompt), then waiting ones while budget is left; first token when a prompt completes.
    ``prefill_first`` (SGLang): a step of prompt chunks alone while any prompt has chunks to
    run, a step decoding every running request otherwise. A client's next request waits in an
    inbox until a receive point: after ``recv_interval`` decode steps, after a step with
    prompt chunks, or when the engine has nothing to run (SGLang's recv skipper)."""
    cost = StubCost()
    t = 0.0
    waiting = deque(range(min(clients, n)))
    inbox: deque[int] = deque()
    sent = len(waiting)
    arrival = dict.fromkeys(waiting, 0.0)
    cached = dict.fromkeys(range(n), 0)
    generated = dict.fromkeys(range(n), 0)
    first, finish = {}, {}
    running: list[int] = []
    decoded, had_chunks = 0, True
    while len(finish) < n:
        if had_chunks or decoded >= recv_interval or not (running or waiting):
            waiting.extend(inbox)
            inbox.clear()
            decoded = 0
        budget, decodes, chunks = step_budget, [], []
        for r in running:
            if cached[r] < prompt:
                take = min(prompt - cached[r], budget)
                chunks.append((r, take))
            else:
                take = 0 if prefill_first else 1  # a prefill step has no decodes in it
                decodes.append(r)
            budget -= take
        while waiting and budget > 0:
            r = waiting.popleft()
            running.append(r)
            take = min(prompt, budget)
            chunks.append((r, take))
            budget -= take
        if prefill_first:
            decodes = [] if chunks else [r for r in running if cached[r] >= prompt]
        if not decodes and not chunks:
            continue  # nothing to run: the inbox is taken in at once
        had_chunks = bool(chunks)
        decoded = 0 if chunks else decoded + 1
        contexts = np.array([cached[r] + 1 for r in decodes], dtype=float)
        t += cost.step_s(contexts, [(cached[r], c) for r, c in chunks])
        for r in decodes:
            cached[r] += 1
            generated[r] += 1
        for r, c in chunks:
            cached[r] += c
            if cached[r] == prompt:
                generated[r] = 1
                first[r] = t
        for r in [r for r in running if generated[r] == output]:
            running.remove(r)
            finish[r] = t
            if sent < n:
                arrival[sent] = t
                inbox.append(sent)
                sent += 1
    return arrival, first, finish


def assert_matches_brute_force(
    prompt: int,
    output: int,
    clients: int,
    n: int,
    budget: int,
    prefill_first: bool = False,
    recv_interval: int = 1,
) -> None:
    """The simulation's arrival, first-token and finish times are the brute force's."""
    setup = EngineSetup(
        max_num_batched_tokens=budget,
        max_num_seqs=64,
        kv_capacity_bytes=1e9,
        prefill_first=prefill_first,
        recv_interval=recv_interval,
    )
    sim = simulate(
        StubCost(),  # type: ignore[arg-type]
        setup,
        np.full(n, prompt),
        np.full(n, output),
        clients=clients,
    )
    arrival, first, finish = brute_force(
        prompt, output, clients, n, budget, prefill_first, recv_interval
    )
    assert sim.arrival_s == pytest.approx([arrival[i] for i in range(n)], abs=1e-12)
    assert sim.first_token_s == pytest.approx([first[i] for i in range(n)], abs=1e-12)
    assert sim.finish_s == pytest.approx([finish[i] for i in range(n)], abs=1e-12)


@pytest.mark.parametrize(
    ("prompt", "output", "clients", "n", "budget"),
    [(4, 3, 1, 2, 2), (5, 4, 2, 5, 6), (3, 6, 3, 7, 4), (10, 2, 3, 6, 8)],
)
def test_the_simulation_matches_a_brute_force_scheduler(prompt, output, clients, n, budget) -> None:
    assert_matches_brute_force(prompt, output, clients, n, budget)


@pytest.mark.parametrize(
    ("prompt", "output", "clients", "n", "budget"),
    [(4, 3, 1, 2, 2), (5, 4, 2, 5, 6), (3, 6, 3, 7, 4), (10, 2, 3, 6, 8), (6, 5, 4, 9, 7)],
)
def test_prefill_first_matches_a_brute_force_scheduler(prompt, output, clients, n, budget) -> None:
    assert_matches_brute_force(prompt, output, clients, n, budget, prefill_first=True)


@pytest.mark.parametrize("prefill_first", [False, True])
@pytest.mark.parametrize(
    ("prompt", "output", "clients", "n", "budget", "interval"),
    [(4, 9, 2, 5, 6, 3), (3, 12, 3, 8, 4, 5), (6, 20, 4, 9, 7, 4), (5, 7, 1, 3, 5, 10)],
)
def test_a_receive_interval_matches_a_brute_force_scheduler(
    prompt, output, clients, n, budget, interval, prefill_first
) -> None:
    """[SGL-RECV]: new requests reach the queue every ``interval`` decode steps, after a step
    with prompt chunks, or at once on an idle engine."""
    assert_matches_brute_force(prompt, output, clients, n, budget, prefill_first, interval)


def test_a_longer_receive_interval_delays_the_first_token(qwen32, h100) -> None:
    """Requests arriving while the engine decodes wait for its next receive point: SGLang's
    --scheduler-recv-interval 30 (InferenceX's B200 setting at 16 clients and more) adds about
    15 decode steps to a TTFT; 1 is every step, today's behaviour."""
    w = Workload(
        isl=Lengths.range_ratio(1024, 0.8),
        osl=Lengths.range_ratio(1024, 0.8),
        concurrency=16,
        scheduling="prefill-first",
    )
    every = estimate_serving(qwen32, h100, tp=4, workload=w)
    same = estimate_serving(
        qwen32, h100, tp=4, workload=w.model_copy(update={"scheduler_recv_interval": 1})
    )
    sparse = estimate_serving(
        qwen32, h100, tp=4, workload=w.model_copy(update={"scheduler_recv_interval": 30})
    )
    assert same.ttft_s == every.ttft_s
    assert sparse.ttft_s - every.ttft_s == pytest.approx(15 * every.decode_step_s, rel=0.35)
    assert "every 30 decode steps" in " ".join(sparse.assumptions)


def test_prefill_first_trades_tpot_for_ttft(qwen32, h100) -> None:
    """SGLang's policy runs new prompts before the running decodes: less waiting for the
    first token, longer gaps between the tokens after it. (Lengths vary, as benchmarks draw
    them: with every answer of one length, prefill-first keeps the clients in lockstep.)"""
    mixed = Workload(
        isl=Lengths.range_ratio(2048, 0.8), osl=Lengths.range_ratio(256, 0.8), concurrency=32
    )
    first = mixed.model_copy(update={"scheduling": "prefill-first"})
    a = estimate_serving(qwen32, h100, tp=4, workload=mixed)
    b = estimate_serving(qwen32, h100, tp=4, workload=first)
    assert b.tpot_s > a.tpot_s
    assert b.ttft_s < a.ttft_s
    assert "a step of prompt chunks alone" in " ".join(b.assumptions)


def test_one_request_worked_by_hand() -> None:
    """Prompt 4, budget 2, 3 output tokens: chunks of 2 and 2 (the second samples the first
    token), then two decodes at contexts 5 and 6."""
    setup = EngineSetup(max_num_batched_tokens=2, max_num_seqs=8, kv_capacity_bytes=1e9)
    sim = simulate(StubCost(), setup, np.array([4]), np.array([3]), clients=1)  # type: ignore[arg-type]
    step1 = 1e-3 + 2e-4
    step2 = 1e-3 + 2e-4
    dec1 = 1e-3 + 1e-4 + 5e-6
    dec2 = 1e-3 + 1e-4 + 6e-6
    assert sim.ttft_s[0] == pytest.approx(step1 + step2)
    assert sim.tpot_s[0] == pytest.approx((dec1 + dec2) / 2)


def test_a_full_cache_preempts_and_recomputes() -> None:
    """Two requests whose answers outgrow a 24-token cache: one is preempted and finishes
    after the other, every output token still produced."""
    setup = EngineSetup(max_num_batched_tokens=64, max_num_seqs=8, kv_capacity_bytes=24.0)
    sim = simulate(StubCost(), setup, np.array([8, 8]), np.array([8, 8]), clients=2)  # type: ignore[arg-type]
    assert sim.preemptions >= 1
    assert sim.tokens_out[-1] >= 16
    assert np.all(np.isfinite(sim.finish_s))


class RecordingCost(StubCost):
    """:class:`StubCost` that keeps every step's prompt chunks."""

    def __init__(self) -> None:
        self.chunks: list[list[tuple[int, int]]] = []

    def step_s(self, contexts, chunks) -> float:
        self.chunks.append(list(chunks))
        return super().step_s(contexts, chunks)


def test_a_preempted_prompt_keeps_its_cached_chunks_with_prefix_caching() -> None:
    """[V1-PREFIX], worked by hand: a 20-token cache, an 8-token budget; A (prompt 8, answer 6)
    and B (prompt 16, answer 2) arrive together. Step 1 prefills A; step 2 decodes A and runs
    B's first chunk (7); in step 3 B's next chunk would overfill the cache, so B is preempted
    and the step decodes A alone (nothing joins in a step that preempted); B's 7 cached tokens
    plus its next chunk do not fit beside A until A finishes (steps 4-6 decode A); then B
    resumes from its 7 cached tokens: 8 more, then 1 (its first token), then one decode."""
    setup = EngineSetup(
        max_num_batched_tokens=8, max_num_seqs=8, kv_capacity_bytes=20.0, prefix_caching=True
    )
    cost = RecordingCost()
    sim = simulate(cost, setup, np.array([8, 16]), np.array([6, 2]), clients=2)  # type: ignore[arg-type]
    decode = [1e-3 + 1e-4 + c * 1e-6 for c in (10, 11, 12, 13)]  # A alone, contexts 10-13
    steps = [1e-3 + 8e-4, 1e-3 + 8e-4 + 9e-6, *decode, 1e-3 + 8e-4, 1e-3 + 1e-4]
    assert sim.preemptions == 1
    assert sim.first_token_s[1] == pytest.approx(sum(steps), abs=1e-12)
    assert sim.finish_s[1] == pytest.approx(sum(steps) + 1e-3 + 1e-4 + 17e-6, abs=1e-12)
    assert sum(c for step in cost.chunks[1:] for _, c in step) == 16  # B's prompt, once
    assert cost.chunks[2] == []  # the step that preempted B decodes A alone
    # recompute preemption (prefix caching off) prefills B's first tokens again; B's fresh
    # first chunk would fit beside A in the step that preempted it, and still does not join
    again = RecordingCost()
    off = EngineSetup(max_num_batched_tokens=8, max_num_seqs=8, kv_capacity_bytes=20.0)
    simulate(again, off, np.array([8, 16]), np.array([6, 2]), clients=2)  # type: ignore[arg-type]
    assert again.chunks[2] == []
    assert sum(c for step in again.chunks[1:] for _, c in step) > 16


def _engine_holding(running: list[int], kept: list[int], capacity: float, cost=None):
    """An engine whose running requests hold ``running`` cached tokens and whose waiting,
    preempted requests kept ``kept`` tokens (earliest preempted first)."""
    from opweave.costmodel._private.serving_sim import _Engine, _Request

    setup = EngineSetup(8, 8, capacity, prefix_caching=True)
    engine = _Engine(cost or StubCost(), setup)  # type: ignore[arg-type]
    for i, held in enumerate(running):
        r = _Request(i, held, 100, 0.0)
        r.cached = held
        engine.running.append(r)
    for j, held in enumerate(kept, start=len(running)):
        r = _Request(j, held + 5, 100, 0.0)
        r.kept = held
        engine.waiting.append(r)
        engine.evictable.append(r)
    return engine


def test_the_running_requests_growth_evicts_kept_tokens_earliest_preempted_first() -> None:
    """[V1-PREFIX]: a 20-token cache, running requests holding 12, 16 or 17 tokens beside
    requests that kept 5 and 6: the earliest-preempted loses its tail first, then the next."""
    engine = _engine_holding([12], [5, 6], 20.0)  # 11 kept in 8 free: the first keeps 2
    engine.evict()
    assert [r.kept for r in engine.waiting] == [2, 6]
    engine = _engine_holding([16], [5, 6], 20.0)  # 4 free: the first goes, the second keeps 4
    engine.evict()
    assert [r.kept for r in engine.waiting] == [0, 4]
    assert [r.kept for r in engine.evictable] == [4]
    engine = _engine_holding([3, 4], [5, 6], 20.0)  # 13 free: nothing evicted
    engine.evict()
    assert [r.kept for r in engine.waiting] == [5, 6]


class WindowedCost(StubCost):
    """A cache of 2 bytes per token up to a 4-token window (half the layers) plus 1 per
    token: concave in the tokens, as gpt-oss's and Gemma's caches are."""

    def kv_bytes(self, contexts):
        s = np.asarray(contexts, dtype=np.float64)
        return 2.0 * np.minimum(s, 4.0) + s


def test_eviction_keeps_what_fits_under_a_windowed_cache() -> None:
    """A kept request of 10 tokens holds 2 x 4 + 10 = 18 bytes; with 14 bytes free it keeps
    the most tokens that fit, 6 (8 + 6), not 10 less 4 bytes' worth at the first token's 3
    bytes (8 tokens: 16 bytes, over the cache)."""
    engine = _engine_holding([], [10], 14.0, WindowedCost())
    engine.evict()
    assert engine.waiting[0].kept == 6


def test_guaranteed_no_evict_admits_only_with_room_for_the_whole_answer() -> None:
    """[TRT-NOEVICT]: two requests of 8 + 8 tokens and a 24-token cache: the second starts only
    after the first finishes and frees its 16, and nothing is preempted (the same pair
    preempts under vLLM's policy: test_a_full_cache_preempts_and_recomputes)."""
    setup = EngineSetup(
        max_num_batched_tokens=64, max_num_seqs=8, kv_capacity_bytes=24.0, reserve_output=True
    )
    for policy in (setup, replace(setup, prefill_first=True)):  # mixed and SGLang's policy
        sim = simulate(StubCost(), policy, np.array([8, 8]), np.array([8, 8]), clients=2)  # type: ignore[arg-type]
        assert sim.preemptions == 0
        assert sim.first_token_s[1] > sim.finish_s[0]


def test_sglangs_default_memory_fraction_against_its_formula() -> None:
    """[SGL-MEM], the reserve written out for three servers: (M - R) / M with M the device's MiB
    and R = 512 + 1.5 chunk + 2 cuda_graph_max_bs + 1024 tp / 8 (+ the DP-attention terms), at
    least 10 GiB on large GPUs."""
    cat = default_catalog()
    h100, b200, h200 = (cat.get(g) for g in ("h100", "b200", "h200"))
    mib = {g.id: g.memory_bytes / 2**20 for g in (h100, b200, h200)}
    tp1 = 512 + 1.5 * 8192 + 2 * 256 + 1024 / 8  # H100, TP1: graphs up to batch 256
    tp8 = 512 + 1.5 * 16384 + 2 * 512 + 1024  # B200, TP8
    dp8 = 512 + 1.5 * 8192 + 2 * 512 + 1024 + 512 * 8 * 3 + 512 * 8 * 1.5  # H200, DP attention
    assert sglang_mem_fraction(h100, 8192, 1) == round((mib[h100.id] - tp1) / mib[h100.id], 3)
    assert sglang_mem_fraction(b200, 16384, 8) == round((mib[b200.id] - tp8) / mib[b200.id], 3)
    assert sglang_mem_fraction(h200, 8192, 8, 8, dp_attention=True) == round(
        (mib[h200.id] - dp8) / mib[h200.id], 3
    )
    assert sglang_mem_fraction(h100, 8192, 1) == pytest.approx(0.828, abs=0.01)  # sglang#29092


def test_a_layout_sglangs_default_memory_split_leaves_nothing_is_one_error(h100) -> None:
    """DP attention over many ranks reserves graph_bs x dp x 4.5 MiB: past the GPU's memory
    SGLang's default fraction is negative and the engine does not start. That is an error
    naming the flag (it was a pydantic traceback), and a given fraction still estimates."""
    from opweave.costmodel import InfeasibleError

    moe = load_model("qwen3-30b-a3b")
    w = Workload(isl=Lengths.fixed(1024), osl=Lengths.fixed(64), concurrency=4, engine="sglang")
    assert sglang_mem_fraction(h100, 8192, 64, 64, dp_attention=True) < 0
    with pytest.raises(InfeasibleError) as info:
        estimate_serving(moe, h100, tp=1, ep=64, dp=64, workload=w)
    assert str(info.value).startswith(
        "SGLang's default --mem-fraction-static on 64 x h100-sxm with data-parallel attention "
        "over 64 ranks is -"
    )
    assert "give --memory-fraction" in str(info.value)
    given = w.model_copy(update={"memory_fraction": 0.8})
    assert estimate_serving(moe, h100, tp=1, ep=64, dp=64, workload=given).tokens_per_s > 0


def test_each_engine_sizes_the_kv_cache_its_own_way(qwen32, h100) -> None:
    """The same replica's cache under each engine's memory rule, against the arithmetic: SGLang
    f x M - weights; vLLM 0.9 M - weights - a full step's activations; TensorRT-LLM 0.9 x
    (M - weights - activations); a given fraction replaces the default."""
    par = Parallelism(tp=2)
    cost = EngineStepCost.build(qwen32, h100, par)
    per_token = float(cost.kv_bytes(1.0))
    weights = qwen32.weight_bytes / 2
    vllm_free = cost.kv_capacity_bytes(8192, 1024)  # vLLM's rule, the default
    # a full step's activations at TensorRT-LLM's limits (8192 tokens, logits of 2048 requests)
    activations = 0.9 * h100.memory_bytes - weights - cost.kv_capacity_bytes(8192, 2048)
    assert 0 < activations < 0.05 * h100.memory_bytes
    w = Workload(isl=Lengths.fixed(2048), osl=Lengths.fixed(256), concurrency=8)
    expect = {
        "vllm": vllm_free,
        "sglang": sglang_mem_fraction(h100, 8192, 2) * h100.memory_bytes - weights,
        "tensorrt-llm": 0.9 * (h100.memory_bytes - weights - activations),
    }
    expect_words = {
        "vllm": "automatic prefix caching",
        "sglang": "recompute preemption",
        "tensorrt-llm": "GUARANTEED_NO_EVICT",
    }
    for engine, capacity in expect.items():
        est = estimate_serving(qwen32, h100, tp=2, workload=w.model_copy(update={"engine": engine}))
        # rel: the test splits every weight over the two GPUs; a few (norms) are replicated
        assert est.kv_capacity_tokens * per_token == pytest.approx(capacity, rel=1e-4), engine
        assert expect_words[engine] in " ".join(est.assumptions)
    given = w.model_copy(update={"engine": "sglang", "memory_fraction": 0.7})
    est = estimate_serving(qwen32, h100, tp=2, workload=given)
    assert est.kv_capacity_tokens * per_token == pytest.approx(
        0.7 * h100.memory_bytes - weights, rel=1e-4
    )
    assert "--mem-fraction-static 0.7 (given)" in " ".join(est.assumptions)


def test_sglangs_decode_graphs_end_at_cuda_graph_max_bs(qwen32, h100) -> None:
    """SGLang replays a decode batch of at most --cuda-graph-max-bs requests as a CUDA graph
    (256 on an H100 below TP4, 512 from TP4 and on larger GPUs, 32 / 160 on 40-60 GiB ones);
    a larger decode step runs eagerly: at least its kernel launches' host time."""
    cat = default_catalog()
    tiers = {("h100", 1): 256, ("h100", 4): 512, ("b200", 1): 512, ("a100-40gb", 2): 32}
    tiers[("a100-40gb", 8)] = 160
    for (gpu, tp), bs in tiers.items():
        assert sglang_graph_max_bs(cat.get(gpu), tp) == bs, (gpu, tp)
    eager_hw = host_profile("sglang").apply(h100)
    graphed = EngineStepCost.build(qwen32, eager_hw, Parallelism(tp=4))
    capped = EngineStepCost.build(qwen32, eager_hw, Parallelism(tp=4))
    capped.graphs = GraphBatches(max_batch=256)
    floor = capped.kernels * eager_hw.eager_launch_s
    small, large = np.full(200, 1024.0), np.full(300, 1024.0)
    assert capped.step_s(small, []) == graphed.step_s(small, [])
    assert capped.step_s(large, []) == max(graphed.step_s(large, []), floor)
    assert capped.step_s(large, []) > graphed.step_s(large, [])  # at TP4 launches bind
    run = capped.decode_run_s(large, 3)
    assert run == pytest.approx(np.maximum(graphed.decode_run_s(large, 3), floor))
    # the serving estimate says so, and a larger cap (given) graphs those steps again
    w = Workload(isl=Lengths.fixed(512), osl=Lengths.fixed(512), concurrency=400, engine="sglang")
    est = estimate_serving(qwen32, h100, tp=4, workload=w)
    assert "decode steps of more than 512 requests" in " ".join(est.assumptions)
    wider = estimate_serving(
        qwen32, h100, tp=4, workload=w.model_copy(update={"cuda_graph_max_bs": 1024})
    )
    assert "more than 1024 requests" in " ".join(wider.assumptions)
    assert wider.tpot_s <= est.tpot_s


def test_tensorrt_llm_graphs_only_its_default_decode_sizes(qwen32, h100) -> None:
    """[TRT-GRAPH]: trtllm-serve's default CUDA graphs, unpadded, cover decode batches 1-31,
    32, 64 and 128; a batch of 40 or 200 runs eagerly, at least its launches' host time."""
    w = Workload(isl=Lengths.fixed(512), osl=Lengths.fixed(512), concurrency=8)
    graphs = w.model_copy(update={"engine": "tensorrt-llm"}).graph_batches(h100, 4)
    assert graphs is not None
    assert [b for b in range(1, 300) if graphs.graphs(b)] == [*range(1, 33), 64, 128]
    hw = host_profile("tensorrt-llm").apply(h100)
    plain = EngineStepCost.build(qwen32, hw, Parallelism(tp=4))
    trt = EngineStepCost.build(qwen32, hw, Parallelism(tp=4))
    trt.graphs = graphs
    floor = trt.kernels * hw.eager_launch_s
    for batch in (32, 64):
        contexts = np.full(batch, 1024.0)
        assert trt.step_s(contexts, []) == plain.step_s(contexts, [])
    for batch in (40, 200):
        contexts = np.full(batch, 1024.0)
        assert trt.step_s(contexts, []) == max(plain.step_s(contexts, []), floor)
    # given a cap, every batch up to it is graphed (padded)
    given = w.model_copy(update={"engine": "tensorrt-llm", "cuda_graph_max_bs": 256})
    padded = given.graph_batches(h100, 4)
    assert padded is not None and padded.graphs(200) and not padded.graphs(257)
    est = estimate_serving(
        qwen32, h100, tp=4, workload=w.model_copy(update={"engine": "tensorrt-llm"})
    )
    assert "decode steps of sizes it has no CUDA graph for" in " ".join(est.assumptions)


# -- aggregated serving ------------------------------------------------------------------------
def test_a_very_long_answer_converges_to_the_decode_step(qwen32, h100) -> None:
    w = Workload(isl=Lengths.fixed(128), osl=Lengths.fixed(32000), concurrency=8)
    est = estimate_serving(qwen32, h100, tp=2, workload=w)
    step = estimate_step(qwen32, h100, tp=2, batch=8, context=128 + 16000)
    assert est.tpot_s == pytest.approx(step.step_latency_s, rel=0.01)
    assert est.decode_batch == pytest.approx(8, rel=0.01)


def test_prefill_mixed_in_raises_tpot_above_the_decode_step(qwen32, h100) -> None:
    short = Workload(isl=Lengths.fixed(4096), osl=Lengths.fixed(128), concurrency=64)
    long = short.model_copy(update={"osl": Lengths.fixed(1024)})
    a, b = (estimate_serving(qwen32, h100, tp=4, workload=w) for w in (short, long))
    assert a.tpot_s > b.tpot_s > b.decode_step_s
    assert a.ttft_s > a.decode_step_s
    assert b.tokens_per_s == pytest.approx(b.requests_per_s * 1024)
    assert b.usd_per_million_tokens == pytest.approx(
        h100.usd_per_hour * 4 / 3600 / b.tokens_per_s * 1e6
    )


def test_open_loop_is_seeded_and_a_light_load_waits_for_nothing(qwen32, h100) -> None:
    w = Workload(isl=Lengths.fixed(1024), osl=Lengths.fixed(64), rate_per_s=0.05)
    a = estimate_serving(qwen32, h100, tp=4, workload=w)
    b = estimate_serving(qwen32, h100, tp=4, workload=w)
    assert a == b
    alone = EngineStepCost.build(qwen32, h100, Parallelism(tp=4)).step_s(np.zeros(0), [(0, 1024)])
    assert a.ttft_s == pytest.approx(alone, rel=0.02)
    assert not a.saturated
    heavy = estimate_serving(qwen32, h100, tp=4, workload=w.model_copy(update={"rate_per_s": 500}))
    assert heavy.saturated


def test_an_overloaded_engine_serves_its_capacity_whatever_the_rate(qwen32, h100) -> None:
    """Prompts that arrive faster than the engine prefills them: the arrivals' window can pass
    without one output token (it divided by that zero: a traceback). An overloaded engine
    serves its capacity, the same at twice the overload, and costs what that capacity does."""
    w = Workload(isl=Lengths.fixed(30720), osl=Lengths.fixed(64), rate_per_s=1000)
    flood = estimate_serving(qwen32, h100, tp=1, workload=w)
    half = estimate_serving(qwen32, h100, tp=1, workload=w.model_copy(update={"rate_per_s": 500}))
    assert flood.saturated and half.saturated
    assert 0 < flood.tokens_per_s < 1000 * 64
    assert flood.tokens_per_s == pytest.approx(half.tokens_per_s, rel=0.05)
    assert flood.usd_per_million_tokens == pytest.approx(
        h100.usd_per_hour / 3600 / flood.tokens_per_s * 1e6
    )


def test_the_median_request_of_a_burst(qwen32, h100) -> None:
    """Five prompts of 1024 tokens sent at once, answers of two tokens, 1025 tokens a step:
    vLLM's scheduler fills each step's budget, so every step after the first decodes the last
    request that prefilled, finishes the next prompt (1023 tokens) and starts the one after
    (1 token). Request i (from 1) samples its first token in step i; the last prompt's step
    starts none."""
    w = Workload(
        isl=Lengths.fixed(1024),
        osl=Lengths.fixed(2),
        concurrency=5,
        num_requests=5,
        max_num_batched_tokens=1025,
    )
    est = estimate_serving(qwen32, h100, tp=4, workload=w)
    cost = EngineStepCost.build(qwen32, h100, Parallelism(tp=4))
    cost.graphs = w.graph_batches(h100, 4)  # vLLM's CUDA-graph sizes, as the engine runs them
    first = cost.step_s(np.zeros(0), [(0, 1024), (0, 1)])
    middle = cost.step_s(np.array([1025.0]), [(1, 1023), (0, 1)])
    last = cost.step_s(np.array([1025.0]), [(1, 1023)])
    ttfts = [first, first + middle, first + 2 * middle, first + 3 * middle]
    ttfts.append(first + 3 * middle + last)
    assert est.ttft_p50_s == pytest.approx(first + 2 * middle)
    assert est.ttft_s == pytest.approx(sum(ttfts) / 5)
    # each second token comes with the next step: three of the five with a middle step
    assert est.tpot_p50_s == pytest.approx(middle)


def test_vllm_batch_defaults() -> None:
    cat = default_catalog()
    assert default_batch_limits(cat.get("h200")) == (8192, 1024)
    assert default_batch_limits(cat.get("a100")) == (2048, 256)  # A100: the small defaults
    assert default_batch_limits(cat.get("l4")) == (2048, 256)


def test_workload_needs_one_arrival_process() -> None:
    with pytest.raises(ValidationError, match="either rate_per_s"):
        Workload(isl=Lengths.fixed(8), osl=Lengths.fixed(8))
    with pytest.raises(ValidationError, match="either rate_per_s"):
        Workload(isl=Lengths.fixed(8), osl=Lengths.fixed(8), rate_per_s=1, concurrency=2)
    w = Workload(isl=Lengths.range_ratio(1000, 0.8), osl=Lengths.fixed(8), concurrency=2)
    assert w.isl.mean == 900


# -- P/D building blocks -------------------------------------------------------------------------
def test_kv_transfer_against_the_cache_size(qwen32, h100) -> None:
    tokens, tp = 4096, 4
    # K and V, 8 KV heads of 128 in BF16, 64 layers; each of the 4 GPUs holds 2 heads
    per_gpu = tokens * 64 * 2 * (8 // tp) * 128 * 2
    nvlink = kv_transfer_s(qwen32, tokens, tp=tp, link="nvlink", prefill=h100)
    expected = h100.intra_node_latency_s + per_gpu / (
        h100.intra_node_bandwidth_bytes_per_s * h100.link_efficiency
    )
    assert nvlink == pytest.approx(expected)
    assert kv_transfer_s(qwen32, tokens, tp=tp, link="network", prefill=h100) > nvlink


def test_prefill_pool_capacity_is_the_budget_over_a_full_step(qwen32, h100) -> None:
    w = Workload(isl=Lengths.fixed(2048), osl=Lengths.fixed(512), rate_per_s=1.0)
    pool = prefill_pool(qwen32, h100, tp=4, workload=w)
    cost = EngineStepCost.build(qwen32, h100, Parallelism(tp=4))
    full = cost.step_s(np.zeros(0), [(0, 2048)] * 4)  # 4 prompts fill the 8192-token budget
    assert pool.capacity_tokens_per_s == pytest.approx(8192 / full, rel=0.05)
    assert pool.prefill_s == pytest.approx(cost.step_s(np.zeros(0), [(0, 2048)]))
    assert pool.prefill_s <= pool.ttft_s < 2 * pool.prefill_s


def test_decode_pool_is_littles_law() -> None:
    # a request holds its slot for the step that samples its first token and 512 more
    pool = decode_pool(32, 0.015, 513)
    assert pool.tpot_s == 0.015
    assert pool.requests_per_s == pytest.approx(32 / (513 * 0.015))
    # SGLang's first token arrives with the KV: 512 steps in the batch
    pushed = decode_pool(32, 0.015, 513, samples_first=False)
    assert pushed.requests_per_s == pytest.approx(32 / (512 * 0.015))


@pytest.mark.parametrize(
    ("transfer", "step", "engine", "expected"),
    [
        (0.0, 0.02, "vllm", 0.01 + 0.02 + 0.02),  # no bytes still cost the step that reads
        (0.005, 0.02, "vllm", 0.01 + 0.02 + 0.02),
        (0.04, 0.02, "vllm", 0.01 + 0.04 + 0.02),  # exactly two steps of read
        (0.3, 0.1, "tensorrt-llm", 0.05 + 0.3 + 0.1),  # 0.3 / 0.1 in floats is 2.9999999999999996
        (0.041, 0.02, "vllm", 0.01 + 0.06 + 0.02),  # just over two steps: three
        (0.041, 0.02, "sglang", 0.041 + 0.01),  # pushed, first token with the KV
    ],
)
def test_the_pd_handoff_by_hand(transfer, step, engine, expected) -> None:
    assert decode_handoff_s(transfer, step, engine) == pytest.approx(expected)


def test_fewer_clients_than_dp_ranks_leave_ranks_idle(h100) -> None:
    """8 clients over 16 data-parallel ranks: 8 ranks serve one client each, 8 idle, so the
    replica's output is 8 ranks' worth (not 16), the same as 8 ranks of 1 client."""
    moe = load_model("qwen3-30b-a3b")
    w8 = Workload(isl=Lengths.fixed(512), osl=Lengths.fixed(256), concurrency=8)
    wide = estimate_serving(moe, h100, tp=1, ep=16, dp=16, workload=w8)
    # one client per busy rank: the output is at most 8 clients' worth of decode steps
    assert wide.tokens_per_s <= 8 / wide.tpot_s * 1.001
    assert wide.decode_batch <= 8


def test_the_kv_cache_is_sized_after_logits_for_one_position_per_request() -> None:
    """vLLM's start-up profile runs a full step of max_num_batched_tokens through the model
    and the LM head only on the last position of each of its max_num_seqs dummy requests, so
    the memory it reserves holds 256 rows of logits, not 8192."""
    from opweave.costmodel._private.roofline import activation_bytes_per_rank

    model, hw = load_model("qwen3-32b"), default_catalog().get("h100")
    cost = EngineStepCost.build(model, hw, Parallelism(tp=1))
    tokens, seqs = 8192, 256
    body = activation_bytes_per_rank([o for o in model.operators if o.name != "lm_head"], tokens)
    logits = seqs * Q32["vocab"] * 2  # BF16 logits, one row per request
    free = hw.usable_memory_bytes - model.weight_bytes - body - logits
    assert cost.kv_capacity_bytes(tokens, seqs) == pytest.approx(free, rel=1e-12)
    # gpt-oss-120b on one H100 with a 16384-token budget (engines serve it there): logits of
    # every token of the step (16384 x 201088 x 2 bytes = 6.6 GB) would leave none of the
    # 6.8 GB its 65.2 GB of weights leave for the KV cache
    from pathlib import Path

    gpt_oss = load_model(Path(__file__).with_name("checkpoints") / "gpt-oss-120b.json")
    w = Workload(
        isl=Lengths.fixed(400),
        osl=Lengths.fixed(200),
        concurrency=4,
        num_requests=8,
        max_num_batched_tokens=16384,
    )
    gpt_cost = EngineStepCost.build(gpt_oss, hw, Parallelism(tp=1))
    assert gpt_cost.kv_capacity_bytes(16384, 1024) > 1e9
    assert estimate_serving(gpt_oss, hw, tp=1, workload=w).tpot_s > 0


def test_weights_beyond_the_gpu_are_named_as_such(qwen32, h100) -> None:
    """Qwen3-32B's 65.5 GB of BF16 weights fit one H100 (80 GiB) but leave less cache than one
    40K-token request needs; its 34 GB of FP8 weights do not fit an L4 (24 GB) at all, and that
    error says so rather than how little cache is left."""
    from opweave.costmodel import InfeasibleError

    w = Workload(isl=Lengths.fixed(2048), osl=Lengths.fixed(256), concurrency=8)
    long = w.model_copy(update={"isl": Lengths.fixed(40000), "osl": Lengths.fixed(900)})
    with pytest.raises(InfeasibleError, match="leaves .* GB per GPU for the KV cache"):
        estimate_serving(qwen32, h100, tp=1, workload=long)
    l4, fp8 = default_catalog().get("l4"), load_model("qwen3-32b", quant="fp8")
    assert fp8.weight_bytes > l4.memory_bytes
    with pytest.raises(InfeasibleError) as err:
        estimate_serving(fp8, l4, tp=1, workload=w)
    assert str(err.value).startswith(
        f"qwen3-32b's weights take {fp8.weight_bytes / 1e9:.1f} GB per GPU on 1 x l4 (tp1), "
        f"more than the GPU's {l4.memory_bytes / 1e9:.1f} GB"
    )


def test_a_vllm_token_budget_below_its_running_requests_is_refused(qwen32, h100) -> None:
    """vLLM refuses max_num_batched_tokens below a given max_num_seqs at start-up
    (SchedulerConfig; a budget of 1 beside 1024 requests was simulated, 34 s at 8K prompts);
    given the budget alone, EngineArgs lowers its default running limit to it."""
    w = Workload(
        isl=Lengths.fixed(1024),
        osl=Lengths.fixed(64),
        concurrency=4,
        max_num_batched_tokens=16,
        max_num_seqs=1024,
    )
    with pytest.raises(ConfigError, match="^max_num_batched_tokens 16 is below max_num_seqs 1024"):
        estimate_serving(qwen32, h100, tp=1, workload=w)
    alone = w.model_copy(update={"max_num_seqs": None})
    assert alone.batch_limits(h100) == (16, 16)
    assert estimate_serving(qwen32, h100, tp=1, workload=alone).max_num_seqs == 16
    # SGLang has no such rule
    sglang = w.model_copy(update={"engine": "sglang", "max_num_batched_tokens": 512})
    assert estimate_serving(qwen32, h100, tp=1, workload=sglang).ttft_s > 0
