"""Whole-deployment serving estimates: an aggregated engine (prefill and decode in one engine, as
vLLM serves by default), and the building blocks of prefill/decode disaggregation (a prefill
pool, the KV transfer between the pools, a decode pool).

Sources:
  [NIXL] P/D engines move a request's KV cache from the prefill to the decode GPUs with NIXL
  (vLLM's ``NixlConnector``, NVIDIA Dynamo, llm-d): each tensor-parallel worker reads its own
  shard of the blocks GPU to GPU, over NVLink within a node or NVLink domain (UCX ``cuda_ipc``)
  and over the NICs with GPUDirect RDMA across nodes (Dynamo's disaggregated-serving docs; vLLM
  ``docs/features/nixl_connector_usage.md``).
  [PD-FIRST] In P/D serving the client's first token leaves through the decode engine, which
  takes requests in, sees KV transfers done and emits tokens at its step boundaries.
  - vLLM pulls: its decode instance takes a new request at its next ``schedule()``
    (``RequestStatus.WAITING_FOR_REMOTE_KVS``), its workers start the KV read in that step and
    report the reads done at the step's end (``KVConnectorModelRunnerMixin``: ``start_load_kv``,
    then the connector's finished receives with the step's output), and the next step computes
    the last prompt token "so the next one can be sampled" (``vllm/v1/core/sched/scheduler.py``):
    half a step to be taken in, the read in whole steps (at least one) and one step that samples.
    TensorRT-LLM's generation-only requests (Dynamo's decode workers, which stream every token
    of the answer, the first included: ai-dynamo/dynamo ``docs/design_docs/disagg_serving.md``,
    "Router Orchestration") carry the token the context phase sampled
    (``DisaggregatedParams.first_gen_tokens``), are taken in and have their transfers checked at
    the executor's iterations; the first token is taken to leave with the request's first
    generation step, as vLLM's does (when the executor first responds was not checked).
  - SGLang pushes: its decode worker receives the request before the prefill, allocates the
    KV slots the prefill writes into, polls the transfers once per scheduler iteration, and reads
    the first token the prefill sampled from the transfer's metadata buffer; the request then
    joins through a "prebuilt" extend that skips the forward (``python/sglang/srt/disaggregation/
    decode.py``: ``DecodeTransferQueue.pop_transferred``, ``prepare_for_prebuilt_extend``; the
    flow as ai-dynamo/dynamo ``components/backends/sglang/docs/sglang-kv-transfer-explainer.md``
    walks it): the transfer, then half a step until the next poll.
  vllm-project/vllm#51919 measures vLLM's hand-off at ~197 ms p50 on a 3-prefill / 1-decode node
  with ~29 ms of it the transfer, the recomputed first token with its step alignment ~58 ms; the
  rest there (serial router dispatch, side-channel latency) is not modelled here. The waits are
  taken at their means, also beside a TTFT percentile.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field

from ..errors import ConfigError, InfeasibleError
from .base import Frozen
from .engine_step import EngineStepCost
from .hardware import HardwareSpec
from .host import HostProfile, engine_host
from .model import ModelSpec
from .parallelism import Parallelism, parallelism_problem, weight_bytes_per_gpu
from .precision import check_runs
from .roofline import NETWORK_EFFICIENCY, state_shard_fraction
from .serving_sim import EngineSetup, SimResult, simulate
from .workload import CacheBudget, Engine, Lengths, Workload

# Closed loop, steady state: the clients' first requests all arrive at once and the last ones
# leave a draining engine; the figures are taken over the requests sent in between.
STEADY_ROUNDS = 8  # requests per client
STEADY_MIN_REQUESTS = 32
OPEN_LOOP_REQUESTS = 400
OPEN_LOOP_WARMUP = 0.2  # share of the requests left out as warm-up
SATURATED = 0.95  # served / offered rate below which an open loop is overloaded


class ServingEstimate(Frozen):
    """Aggregated serving of one replica (``tp x dp`` GPUs) under a workload."""

    model: str
    gpu: str
    tp: int
    ep: int
    dp: int
    dense_dp: bool = Field(default=False, description="Dense FFN layers data-parallel.")
    gpus: int
    ttft_s: float = Field(description="Time to first token: queueing plus prefill (mean).")
    tpot_s: float = Field(
        description="Time per output token after the first, (finish - first token) / "
        "(output - 1) per request, mean over requests; it includes the prefill chunks "
        "mixed into the decode steps."
    )
    ttft_p50_s: float = Field(description="Median time to first token.")
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float = Field(description="Median time per output token.")
    tpot_p90_s: float
    tpot_p99_s: float
    statistic: str = Field(description="What the figures are: which requests, which statistic.")
    tokens_per_s: float = Field(description="Output tokens per second of the replica.")
    requests_per_s: float
    usd_per_hour: float | None
    usd_per_million_tokens: float | None = Field(description="Per million output tokens.")
    decode_batch: float = Field(description="Mean requests decoding per step (time-weighted).")
    decode_step_s: float = Field(
        description="A decode-only step at decode_batch and the mean decode context, for "
        "comparison with tpot_s (the difference is the prefill mixed in)."
    )
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_capacity_tokens: float = Field(description="Full-attention tokens the cache holds.")
    preemptions: int
    saturated: bool = Field(description="Open loop: the engine serves less than the offered rate.")
    assumptions: tuple[str, ...]


class PrefillPoolEstimate(Frozen):
    """One replica of a prefill-only engine (P/D): its TTFT and how many prompts it serves."""

    gpu: str
    tp: int
    ep: int
    dp: int
    gpus: int
    prefill_s: float = Field(description="One prompt alone: its chunks' steps.")
    ttft_s: float = Field(description="Mean queueing plus prefill at the given rate.")
    ttft_p50_s: float = Field(description="Median queueing plus prefill.")
    ttft_p90_s: float
    ttft_p99_s: float
    capacity_requests_per_s: float = Field(description="Prompts per second at saturation.")
    capacity_tokens_per_s: float = Field(description="Prompt tokens per second at saturation.")
    rate_per_s: float | None = Field(description="Arrivals per replica the TTFT is taken at.")
    saturated: bool
    statistic: str


class DecodePoolEstimate(Frozen):
    """A decode-only pool replica running ``batch`` requests at ``step_s`` per step."""

    batch: float
    step_s: float
    tpot_s: float = Field(description="Every step gives each running request one token.")
    tokens_per_s: float
    requests_per_s: float = Field(description="Little's law: batch / (decode tokens x TPOT).")


def _check(model: ModelSpec, hardware: HardwareSpec, par: Parallelism, workload: Workload) -> None:
    check_runs(model.precision, hardware)
    problem = parallelism_problem(model, par, hardware, engine_splits=True)
    if problem is not None:
        raise ConfigError(problem)
    if workload.max_context_tokens > model.max_context_tokens:
        raise ConfigError(
            f"isl + osl reaches {workload.max_context_tokens} tokens, beyond {model.name}'s "
            f"context of {model.max_context_tokens}; shorten the prompts or the answers"
        )


def _engine(
    model: ModelSpec,
    hardware: HardwareSpec,
    par: Parallelism,
    workload: Workload,
    host: HostProfile | None,
) -> tuple[EngineStepCost, EngineSetup, HostProfile | None, CacheBudget]:
    """The step costs and limits of one engine rank, the host profile they charge (``host``,
    else the workload's engine's) and the rule that sized its KV cache."""
    _check(model, hardware, par, workload)
    host = host if host is not None else engine_host(workload.engine)
    hw = hardware if host is None else host.apply(hardware)
    cost = EngineStepCost.build(model, hw, par)
    cost.graphs = workload.graph_batches(hardware, par.gpus)
    tokens, seqs = workload.batch_limits(hardware, par.dp)
    budget = workload.cache_budget(hardware, par.gpus, par.dp)
    capacity = cost.kv_capacity_bytes(tokens, seqs, budget)
    longest = float(cost.kv_bytes(float(workload.max_context_tokens)))
    weights = weight_bytes_per_gpu(model.operators, par)
    if weights >= hardware.memory_bytes:
        raise InfeasibleError(
            f"{model.name}'s weights take {weights / 1e9:.1f} GB per GPU on {par.gpus} x "
            f"{hardware.id} ({par}), more than the GPU's {hardware.memory_bytes / 1e9:.1f} GB; use "
            "more GPUs (a larger --tp, --ep or --dp) or a smaller weight format (--quant)"
        )
    if capacity < longest:
        raise InfeasibleError(
            f"{model.name} on {par.gpus} x {hardware.id} ({par}) leaves "
            f"{capacity / 1e9:.1f} GB per GPU for the KV cache ({budget.source}), less than "
            f"one request of {workload.max_context_tokens} tokens needs; use more GPUs, shorter "
            "requests or a larger memory fraction"
        )
    setup = EngineSetup(
        tokens,
        seqs,
        capacity,
        workload.step_policy == "prefill-first",
        workload.scheduler_recv_interval,
        prefix_caching=workload.engine == "vllm",
        reserve_output=workload.engine == "tensorrt-llm",
    )
    return cost, setup, host, budget


def _population(workload: Workload, rank: Workload) -> tuple[int, int, int]:
    """Requests to simulate for one engine, and the measured window ``[first, last)``."""
    if rank.num_requests is not None:
        return rank.num_requests, 0, rank.num_requests
    if rank.concurrency is not None:
        c = rank.concurrency
        n = max(STEADY_ROUNDS * c, STEADY_MIN_REQUESTS + 2 * c)
        return n, c, n - c
    del workload
    return OPEN_LOOP_REQUESTS, int(OPEN_LOOP_REQUESTS * OPEN_LOOP_WARMUP), OPEN_LOOP_REQUESTS


def _run(
    cost: EngineStepCost, setup: EngineSetup, rank: Workload, n: int, *, prefill_only: bool
) -> SimResult:
    rng = np.random.default_rng(rank.seed)
    prompts = rank.isl.sample(n, rng)
    outputs = np.ones(n, dtype=np.int64) if prefill_only else rank.osl.sample(n, rng)
    if rank.concurrency is not None:
        return simulate(cost, setup, prompts, outputs, clients=rank.concurrency)
    assert rank.rate_per_s is not None
    arrivals = np.cumsum(rng.exponential(1.0 / rank.rate_per_s, size=n))
    return simulate(cost, setup, prompts, outputs, arrivals_s=arrivals)


def _window_throughput(
    sim: SimResult, first: int, last: int, benchmark: bool
) -> tuple[float, float]:
    """Output tokens/s and mean decode batch: over the whole run for a benchmark's population
    (as its client reports them: tokens over the run's duration), else between the arrivals of
    the first and last measured requests."""
    if benchmark:
        return sim.throughput(0.0, float(np.max(sim.finish_s)))
    start = float(sim.arrival_s[first])
    end = float(sim.arrival_s[last - 1]) if last - 1 > first else float(np.max(sim.finish_s))
    return sim.throughput(start, end)


def estimate_serving(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    tp: int,
    ep: int = 1,
    dp: int = 1,
    dense_dp: bool = False,
    workload: Workload,
    host: HostProfile | None = None,
) -> ServingEstimate:
    """Aggregated serving (prefill and decode in one engine, chunked prefill) of one replica of
    ``tp x dp`` GPUs under ``workload``, by a simulation of the engine's scheduler
    (:mod:`.serving_sim`) over the step costs of :mod:`.engine_step`.

    >>> from opweave.costmodel import default_catalog, load_model, Lengths, Workload
    >>> w = Workload(isl=Lengths.fixed(4096), osl=Lengths.fixed(1024), concurrency=64)
    >>> est = estimate_serving(load_model("qwen3-32b"), default_catalog().get("h100"), tp=4,
    ...                        workload=w)
    >>> round(est.tpot_s * 1e3), est.tpot_s > est.decode_step_s
    (23, True)
    """
    par = Parallelism(tp=tp, ep=ep, dp=dp, dense_dp=dense_dp)
    cost, setup, host, budget = _engine(model, hardware, par, workload, host)
    rank = workload.per_replica(dp)
    # the replica's output is its ranks' together: dp ranks at a rate share, or (closed loop)
    # as many rank shares as the clients fill (fewer clients than ranks leave ranks idle)
    ranks = float(dp)
    if workload.concurrency is not None and rank.concurrency is not None:
        ranks = workload.concurrency / rank.concurrency
    # Clients beyond the running limit only wait in the queue: simulate a quarter more than
    # the limit (the queue never empties) and add the rest's wait by Little's law
    queued = 0
    limit = setup.max_num_seqs + max(1, setup.max_num_seqs // 4)
    if rank.num_requests is None and rank.concurrency is not None and rank.concurrency > limit:
        queued = rank.concurrency - limit
        rank = rank.model_copy(update={"concurrency": limit})
    n, first, last = _population(workload, rank)
    sim = _run(cost, setup, rank, n, prefill_only=False)
    per_rank_tokens, batch = _window_throughput(sim, first, last, rank.num_requests is not None)
    wait = queued / (per_rank_tokens / float(np.mean(sim.output_tokens))) if queued else 0.0
    ttft, tpot = sim.ttft_s[first:last] + wait, _tpot(sim, first, last)
    mean_osl = float(np.mean(sim.output_tokens))
    # overloaded: over the measured window the engine generates less than the requests that
    # arrived in it ask for (the realised arrivals, not the nominal rate: Poisson noise)
    saturated = False
    if rank.rate_per_s is not None and last - 1 > first:
        span = float(sim.arrival_s[last - 1] - sim.arrival_s[first])
        offered = (last - 1 - first) / span * mean_osl
        saturated = per_rank_tokens < SATURATED * offered
        if saturated:
            # the queue only grows: what the engine serves is its capacity, over the whole run
            # (prompts that arrive faster than it prefills can leave the arrivals' window
            # without a single output token)
            per_rank_tokens, batch = sim.throughput(0.0, float(np.max(sim.finish_s)))
        else:
            # a stable engine serves what arrives: the nominal rate's tokens, not those of the
            # sample's realised arrivals (Poisson noise of a few hundred requests)
            per_rank_tokens = rank.rate_per_s * rank.osl.mean
    tokens_per_s = per_rank_tokens * ranks
    price = hardware.usd_per_hour
    usd_hour = None if price is None else price * par.gpus
    usd = None if usd_hour is None else usd_hour / 3600 / tokens_per_s * 1e6
    context = workload.mean_decode_context
    decode_step = float(cost.decode_run_s(np.full(max(1, round(batch)), context), 1)[0])
    tokens, seqs = setup.max_num_batched_tokens, setup.max_num_seqs
    return ServingEstimate(
        model=model.name,
        gpu=hardware.id,
        tp=tp,
        ep=ep,
        dp=dp,
        dense_dp=dense_dp,
        gpus=par.gpus,
        ttft_s=float(np.mean(ttft)),
        tpot_s=float(np.mean(tpot)),
        ttft_p50_s=float(np.median(ttft)),
        ttft_p90_s=float(np.percentile(ttft, 90)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        tpot_p50_s=float(np.median(tpot)),
        tpot_p90_s=float(np.percentile(tpot, 90)),
        tpot_p99_s=float(np.percentile(tpot, 99)),
        statistic=_statistic(rank, n, first, last)
        + (f"; {queued} more clients' queueing added by Little's law" if queued else ""),
        tokens_per_s=tokens_per_s,
        requests_per_s=tokens_per_s / mean_osl,
        usd_per_hour=usd_hour,
        usd_per_million_tokens=usd,
        decode_batch=batch * ranks,
        decode_step_s=decode_step,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        kv_capacity_tokens=setup.kv_capacity_bytes / max(float(cost.kv_bytes(1.0)), 1e-30),
        preemptions=sim.preemptions,
        saturated=bool(saturated),
        assumptions=_assumptions(workload, tokens, seqs, dp, budget)
        + _eager(cost, host)
        + model.notes,
    )


def _tpot(sim: SimResult, first: int, last: int) -> np.ndarray:
    keep = np.zeros(len(sim.output_tokens), dtype=bool)
    keep[first:last] = True
    keep &= sim.output_tokens > 1
    if not keep.any():
        return np.zeros(1)
    return (sim.finish_s[keep] - sim.first_token_s[keep]) / (sim.output_tokens[keep] - 1)


def _statistic(rank: Workload, n: int, first: int, last: int) -> str:
    if rank.num_requests is not None:
        return (
            f"mean (and median, p90, p99) over all {n} requests of the benchmark, as its client "
            "reports"
        )
    return (
        f"mean (and median, p90, p99) over {last - first} simulated requests in steady state "
        f"(of {n}; the warm-up and the drain left out)"
    )


def _assumptions(
    workload: Workload, tokens: int, seqs: int, dp: int, budget: CacheBudget
) -> tuple[str, ...]:
    given = workload.max_num_batched_tokens is not None
    out = [
        f"arrivals: {workload.arrival}",
        f"lengths: isl {_lengths(workload.isl)}, osl {_lengths(workload.osl)}",
        f"engine: {workload.engine_name}, continuous batching with chunked prefill: "
        f"{workload.policy_text}; prompt chunks up to {tokens} tokens per step "
        f"({'given' if given else 'its default on the GPU'}), at most {seqs} running "
        f"requests, {workload.preemption_text}; KV cache: {budget.source}",
        "prefill: GEMMs over the chunk's tokens at the weight format's tensor-core rate, causal "
        "attention over the prompt so far, weights read once per step",
    ]
    out.extend(workload.receive_note)
    if dp > 1:
        out.append(f"data-parallel attention: {dp} engines with equal shares of the arrivals")
    return tuple(out)


def _eager(cost: EngineStepCost, host: HostProfile | None) -> tuple[str, ...]:
    launch_s = cost.hardware.eager_launch_s
    if launch_s <= 0:
        return ()
    named = f" (host profile {host.name})" if host is not None else ""
    which = "steps with prompt chunks"
    if cost.graphs is not None:
        which += f" and decode steps of {cost.graphs.text}"
    return (
        f"{which} run outside CUDA graphs{named}: each takes at least its "
        f"{cost.kernels} kernel launches x {launch_s * 1e6:.0f} us of host time",
    )


def _lengths(lengths: Lengths) -> str:
    if lengths.kind == "fixed":
        return f"{lengths.tokens} tokens"
    return f"uniform {lengths.low_tokens}-{lengths.high_tokens} tokens"


# -- P/D building blocks -------------------------------------------------------------------------
class PrefillEngine:
    """One prefill-only replica (P/D): prompts batched up to the token budget per step, each
    request leaving once its first token is sampled. Built once (a prompt alone and the
    saturation throughput are simulated here), then asked at any arrival rate with :meth:`at`.
    """

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        *,
        tp: int,
        ep: int = 1,
        dp: int = 1,
        dense_dp: bool = False,
        workload: Workload,
        host: HostProfile | None = None,
    ) -> None:
        self.hardware = hardware
        self.par = Parallelism(tp=tp, ep=ep, dp=dp, dense_dp=dense_dp)
        self.workload = workload
        self.cost, self.setup, _, _ = _engine(model, hardware, self.par, workload, host)
        budget = self.setup.max_num_batched_tokens
        per_step = max(1, math.ceil(budget / max(1.0, workload.isl.mean)))
        alone = workload.model_copy(
            update={"concurrency": 1, "rate_per_s": None, "num_requests": 4}
        )
        self.prefill_s = float(np.mean(self._run(alone, 4).ttft_s))
        # saturation: enough clients to fill every step's budget twice over
        full = workload.model_copy(
            update={"concurrency": 2 * per_step, "rate_per_s": None, "num_requests": None}
        )
        n = max(STEADY_ROUNDS * 2 * per_step, STEADY_MIN_REQUESTS)
        span = float(np.max(self._run(full, n).finish_s))
        self.capacity_requests_per_s = n / span * self.par.dp

    def _run(self, rank: Workload, n: int) -> SimResult:
        return _run(self.cost, self.setup, rank, n, prefill_only=True)

    def at(self, rate_per_s: float | None) -> PrefillPoolEstimate:
        """The replica at ``rate_per_s`` Poisson arrivals (``None``: a prompt alone)."""
        if rate_per_s is None:
            ttft = np.full(1, self.prefill_s)
            statistic = "a prompt alone (no arrival rate given: no queueing)"
        else:
            rank = self.workload.model_copy(
                update={
                    "rate_per_s": rate_per_s / self.par.dp,
                    "concurrency": None,
                    "num_requests": None,
                }
            )
            first = int(OPEN_LOOP_REQUESTS * OPEN_LOOP_WARMUP)
            ttft = self._run(rank, OPEN_LOOP_REQUESTS).ttft_s[first:]
            statistic = (
                f"mean (and median, p90, p99) over {OPEN_LOOP_REQUESTS - first} simulated Poisson "
                "arrivals"
            )
        par, capacity = self.par, self.capacity_requests_per_s
        return PrefillPoolEstimate(
            gpu=self.hardware.id,
            tp=par.tp,
            ep=par.ep,
            dp=par.dp,
            gpus=par.gpus,
            prefill_s=self.prefill_s,
            ttft_s=float(np.mean(ttft)),
            ttft_p50_s=float(np.median(ttft)),
            ttft_p90_s=float(np.percentile(ttft, 90)),
            ttft_p99_s=float(np.percentile(ttft, 99)),
            capacity_requests_per_s=capacity,
            capacity_tokens_per_s=capacity * self.workload.isl.mean,
            rate_per_s=rate_per_s,
            saturated=rate_per_s is not None and rate_per_s > SATURATED * capacity,
            statistic=statistic,
        )


def prefill_pool(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    tp: int,
    ep: int = 1,
    dp: int = 1,
    workload: Workload,
    rate_per_s: float | None = None,
    host: HostProfile | None = None,
) -> PrefillPoolEstimate:
    """One prefill-only replica (:class:`PrefillEngine`) at ``rate_per_s`` Poisson arrivals
    (default: the workload's rate); without a rate the TTFT is a prompt alone.

    >>> from opweave.costmodel import default_catalog, load_model, Lengths, Workload
    >>> w = Workload(isl=Lengths.fixed(4096), osl=Lengths.fixed(1024), rate_per_s=2.0)
    >>> pool = prefill_pool(load_model("qwen3-32b"), default_catalog().get("h100"), tp=4,
    ...                     workload=w)
    >>> pool.capacity_requests_per_s > 2, pool.ttft_s >= pool.prefill_s
    (True, True)
    """
    engine = PrefillEngine(model, hardware, tp=tp, ep=ep, dp=dp, workload=workload, host=host)
    return engine.at(rate_per_s if rate_per_s is not None else workload.rate_per_s)


def kv_bytes_per_gpu(model: ModelSpec, tokens: float, tp: int) -> float:
    """KV cache (and recurrent state) of a ``tokens``-token prompt one of ``tp`` prefill GPUs
    holds, and so sends: its shard of the heads (the whole latent for MLA)."""
    return float(
        sum(
            float(op.state_bytes(tokens)) * state_shard_fraction(op, tp)
            for op in model.operators
            if op.holds_state
        )
    )


def kv_transfer_s(
    model: ModelSpec,
    tokens: float,
    *,
    tp: int,
    link: Literal["nvlink", "network"],
    prefill: HardwareSpec,
    decode: HardwareSpec | None = None,
) -> float:
    """Seconds to move one request's KV cache of ``tokens`` prompt tokens from a prefill
    replica of ``tp`` GPUs to the decode pool ([NIXL]): every prefill GPU sends its shard in
    parallel over ``link`` (``nvlink`` within one NVLink domain, else the ``network``), at the
    slower endpoint's per-GPU bandwidth, after the link's latency.

    >>> from opweave.costmodel import default_catalog, load_model
    >>> h100 = default_catalog().get("h100")
    >>> s = kv_transfer_s(load_model("qwen3-32b"), 4096, tp=4, link="network", prefill=h100)
    >>> round(s * 1e3, 2)  # 4096 x 64 KiB per GPU at 95% of 50 GB/s
    5.66
    """
    per_gpu = kv_bytes_per_gpu(model, tokens, tp)
    ends = (prefill,) if decode is None else (prefill, decode)
    if link == "nvlink":
        bw = min(h.intra_node_bandwidth_bytes_per_s * h.link_efficiency for h in ends)
        latency = max(h.intra_node_latency_s for h in ends)
    else:
        bw = min(h.network_bandwidth_bytes_per_s * NETWORK_EFFICIENCY for h in ends)
        latency = max(h.network_latency_s for h in ends)
    return latency + per_gpu / bw


def decode_samples_first(engine: Engine) -> bool:
    """Whether a P/D decode engine computes a request's first token in a step of its own (vLLM,
    TensorRT-LLM) or receives it with the KV (SGLang) ([PD-FIRST])."""
    return engine != "sglang"


def decode_handoff_s(transfer_s: float, step_s: float, engine: Engine = "vllm") -> float:
    """Mean seconds from a prompt's prefill to its first token at a P/D decode pool of
    ``engine`` with steps of ``step_s`` ([PD-FIRST]): vLLM and TensorRT-LLM take the request in
    at the next step (half a step on average), read its KV of ``transfer_s`` over whole steps (at
    least one) and sample its first token in one more step; SGLang receives it with the KV and
    sees the transfer done at its next step boundary.

    >>> round(decode_handoff_s(0.005, 0.02) * 1e3, 3)  # 10 + 20 + 20 ms
    50.0
    >>> round(decode_handoff_s(0.05, 0.02) * 1e3, 3)  # 10 + 3 x 20 + 20 ms
    90.0
    >>> round(decode_handoff_s(0.05, 0.02, "sglang") * 1e3, 3)  # 50 + 10 ms
    60.0
    """
    if step_s <= 0:
        return transfer_s
    if not decode_samples_first(engine):
        return transfer_s + step_s / 2
    steps = max(1, math.ceil(transfer_s / step_s - 1e-9))
    return step_s * (0.5 + steps + 1)


def decode_slot_steps(osl: float, samples_first: bool = True) -> float:
    """Decode steps a P/D request holds a slot of the decode pool, answers of ``osl`` tokens:
    ``osl`` where the pool computes the first token in a step of its own, ``osl - 1`` (at least
    one) where the first token arrives with the KV (:func:`decode_samples_first`).

    >>> decode_slot_steps(1025), decode_slot_steps(1025, samples_first=False)
    (1025, 1024)
    """
    return osl if samples_first else max(1.0, osl - 1)


def decode_pool(
    batch: float, step_s: float, osl: float, *, samples_first: bool = True
) -> DecodePoolEstimate:
    """A decode-only replica holding ``batch`` requests at ``step_s`` per step, answers of
    ``osl`` tokens: each step gives every request one token, so TPOT is the step, and Little's
    law gives the requests it completes, each holding its slot for :func:`decode_slot_steps`.

    >>> round(decode_pool(64, 0.02, 1025).requests_per_s, 4)
    3.122
    >>> decode_pool(64, 0.02, 1025, samples_first=False).requests_per_s
    3.125
    """
    if batch <= 0 or step_s <= 0 or osl < 1:
        raise ConfigError(
            f"a decode pool needs a positive batch, step and osl, got {batch}, {step_s}, {osl}"
        )
    decode_tokens = decode_slot_steps(osl, samples_first)
    return DecodePoolEstimate(
        batch=batch,
        step_s=step_s,
        tpot_s=step_s,
        tokens_per_s=batch / step_s,
        requests_per_s=batch / (decode_tokens * step_s),
    )
