"""A serving workload: prompt and answer lengths, how requests arrive, the engine's batch limits.

Sources:
  [VLLM-BATCH] vLLM ``EngineArgs.get_batch_defaults`` (``vllm/engine/arg_utils.py``, V1 engine):
  on GPUs with at least 70 GiB that are not A100s, ``max_num_batched_tokens`` defaults to 8192
  for the OpenAI API server (16384 for the offline ``LLM`` class) and ``max_num_seqs`` to 1024;
  on other GPUs 2048 (8192 offline) and 256 ("Setting large max_num_batched_tokens for A100
  reduces throughput, see PR #17885").
  [SGL-BATCH] SGLang (``python/sglang/srt/server_args.py``, by the GPU's memory):
  ``--chunked-prefill-size`` defaults to 2048 tokens below 35 GiB, 4096 below 60 GiB (A100
  40GB, L40S; 8192 in releases before the 60 GiB tier was added), 8192 below 160 GiB (A100
  80GB, H100, H200) and 16384 above (B200, B300, MI300X). Its running-request cap
  (``model_runner``) is ``min(clamp(KV tokens / context x 512, 2048, 4096), KV tokens / 2)``:
  2048 unless the KV cache holds eight full contexts, which is the value taken here.
  [SGL-DP] With data-parallel attention SGLang divides ``--chunked-prefill-size`` (given or
  default) by ``dp_size``: each attention rank's scheduler gets that share ("DP attention is
  enabled. The chunked prefill size is adjusted to ...", ``server_args.py``); a vLLM
  data-parallel rank is an engine core with its own ``max_num_batched_tokens``.
  [TRT-BATCH] TensorRT-LLM's ``trtllm-serve`` takes ``BuildConfig``'s ``max_batch_size`` 2048 and
  ``max_num_tokens`` 8192 (``tensorrt_llm/builder.py``) unless given.
  [SGL-MEM] SGLang's ``--mem-fraction-static`` is the share of the device's memory for the
  weights and the KV cache pool; the pool is that share less the weights
  (``model_runner.profile_max_num_token``). Left unset (since sgl-project/sglang#10975, v0.5.3)
  it is ``(M - R) / M`` for a device of ``M`` MiB, reserving ``R = 512 + 1.5 max(chunk, 2048) +
  2 cuda_graph_max_bs + 1024 tp / 8`` MiB for activations and CUDA-graph buffers (with data-
  parallel attention also ``3 cuda_graph_max_bs dp``, and ``1.5 cuda_graph_max_bs dp`` more above
  300), at least 10 GiB on devices above 60 GiB; ``cuda_graph_max_bs`` is 8 below 20 GiB, 24 / 80
  (TP below 4 / from 4) below 35 GiB, 32 / 160 below 60 GiB, 256 / 512 below 160 GiB and 512
  above (``ServerArgs._handle_gpu_memory_settings``). On an H100 serving Qwen3-32B at TP1 that
  is 0.835; sgl-project/sglang#29092 reports 0.828 from a later release.
  [TRT-GRAPH] TensorRT-LLM's PyTorch flow captures CUDA graphs of decode-only batches by default
  (``TorchLlmArgs.cuda_graph_config`` defaults to ``CudaGraphConfig()``): without
  ``enable_padding`` (its default) only the batch sizes 1-31, 32, 64 and 128
  (``CudaGraphConfig._generate_cuda_graph_batch_sizes`` at its default ``max_batch_size`` 128);
  a decode batch of another size runs eagerly.
  [TRT-KV] TensorRT-LLM sizes its KV cache as ``KvCacheConfig.free_gpu_memory_fraction`` (0.9)
  of the memory left free after the model is loaded ("TensorRT LLM will try to allocate 90% of
  free GPU memory for KV cache": docs, examples/kvcacheconfig), where vLLM and SGLang take a
  fraction of the whole device and subtract the weights from it.
  [RANGE] vLLM's and SGLang's ``random`` benchmark datasets (``--random-range-ratio``) draw each
  length uniformly from ``[L (1 - r), L (1 + r)]`` (vLLM) or ``[L r, L]`` (SGLang, InferenceX's
  ``--random-range-ratio 0.8``); ``Lengths.uniform`` takes the bounds either way.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, TypeGuard

import numpy as np
from pydantic import Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError, InfeasibleError, validation_message
from .base import Frozen, read_data_file, schema_version_problem
from .hardware import HardwareSpec

GIB = float(1 << 30)
# [VLLM-BATCH]: the API server's defaults, by GPU memory
LARGE_GPU_BYTES = 70 * GIB
LARGE_GPU_BATCHED_TOKENS, LARGE_GPU_MAX_SEQS = 8192, 1024
SMALL_GPU_BATCHED_TOKENS, SMALL_GPU_MAX_SEQS = 2048, 256
# [SGL-BATCH]: chunk size by GPU memory, and the running-request cap taken
SGLANG_CHUNK_TIERS = ((35 * GIB, 2048), (60 * GIB, 4096), (160 * GIB, 8192))
SGLANG_LARGE_CHUNK, SGLANG_MAX_RUNNING = 16384, 2048
# [TRT-BATCH]
TRTLLM_MAX_NUM_TOKENS, TRTLLM_MAX_BATCH_SIZE = 8192, 2048
TRTLLM_FREE_GPU_MEMORY_FRACTION = 0.9  # [TRT-KV]
# [SGL-MEM]: cuda_graph_max_bs by GPU memory (below, TP < 4, TP >= 4), then the reserve's terms
SGLANG_GRAPH_BS_TIERS = (
    (20 * GIB, 8, 8),
    (35 * GIB, 24, 80),
    (60 * GIB, 32, 160),
    (160 * GIB, 256, 512),
)
SGLANG_LARGE_GRAPH_BS = 512
MIB = float(1 << 20)
# [TRT-GRAPH]: the decode batches trtllm-serve graphs by default (no padding)
TRTLLM_GRAPH_BATCHES = frozenset([*range(1, 32), 32, 64, 128])
Engine = Literal["vllm", "sglang", "tensorrt-llm"]
ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "tensorrt-llm")
ENGINE_ALIASES = {"trtllm": "tensorrt-llm", "trt-llm": "tensorrt-llm"}
ENGINE_NAMES: dict[str, str] = {
    "vllm": "vLLM V1",
    "sglang": "SGLang",
    "tensorrt-llm": "TensorRT-LLM",
}
# Beyond any engine's step (vLLM validates its budget against max_model_len; 1M tokens is past
# every built-in context) and beyond any benchmark's population.
MAX_BATCHED_TOKENS = 1 << 20
MAX_SEQS = 1 << 16
MAX_RECV_INTERVAL = 1 << 16
MAX_REQUESTS = 1 << 20
MIN_RATE_PER_S, MAX_RATE_PER_S = 1e-6, 1e6


def parse_engine(name: str) -> Engine:
    """An engine's name in any case; ``trtllm`` as aiconfigurator and ``opweave profile`` spell
    TensorRT-LLM.

    >>> parse_engine("SGLang"), parse_engine("trtllm")
    ('sglang', 'tensorrt-llm')
    """
    key = name.strip().lower()
    key = ENGINE_ALIASES.get(key, key)
    for engine in ENGINES:
        if engine == key:
            return engine
    raise ConfigError(f"unknown engine {name!r}; known: {', '.join(ENGINES)} (or trtllm)")


def default_batch_limits(hardware: HardwareSpec, engine: Engine = "vllm") -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` ``engine``'s server uses on ``hardware`` by
    default: vLLM's OpenAI API server ([VLLM-BATCH]), SGLang's chunk size and running-request
    cap ([SGL-BATCH]), ``trtllm-serve``'s ([TRT-BATCH]).

    >>> from opweave.costmodel import default_catalog
    >>> cat = default_catalog()
    >>> default_batch_limits(cat.get("h100")), default_batch_limits(cat.get("a100"))
    ((8192, 1024), (2048, 256))
    >>> [default_batch_limits(cat.get(gpu), "sglang") for gpu in ("b200", "h200")]
    [(16384, 2048), (8192, 2048)]
    """
    if engine == "sglang":
        chunk = next(
            (size for below, size in SGLANG_CHUNK_TIERS if hardware.memory_bytes < below),
            SGLANG_LARGE_CHUNK,
        )
        return chunk, SGLANG_MAX_RUNNING
    if engine == "tensorrt-llm":
        return TRTLLM_MAX_NUM_TOKENS, TRTLLM_MAX_BATCH_SIZE
    large = hardware.memory_bytes >= LARGE_GPU_BYTES and not hardware.id.startswith("a100")
    if large:
        return LARGE_GPU_BATCHED_TOKENS, LARGE_GPU_MAX_SEQS
    return SMALL_GPU_BATCHED_TOKENS, SMALL_GPU_MAX_SEQS


class GraphBatches(Frozen):
    """The decode batches an engine replays as CUDA graphs: every batch up to ``max_batch``
    (padded to the next captured size, as SGLang does), or only the sizes in ``exact``
    (TensorRT-LLM without padding, [TRT-GRAPH]); other decode steps run eagerly."""

    max_batch: int = Field(ge=1)
    exact: frozenset[int] | None = None

    def graphs(self, batch: int) -> bool:
        if self.exact is not None:
            return batch in self.exact
        return batch <= self.max_batch

    @property
    def text(self) -> str:
        """The decode steps that run eagerly, in words.

        >>> GraphBatches(max_batch=128, exact=TRTLLM_GRAPH_BATCHES).text
        'sizes it has no CUDA graph for (it graphs 1-32, 64 and 128)'
        """
        if self.exact is None:
            return f"more than {self.max_batch} requests"
        runs: list[list[int]] = []
        for size in sorted(self.exact):
            if runs and size == runs[-1][1] + 1:
                runs[-1][1] = size
            else:
                runs.append([size, size])
        parts = [f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in runs]
        listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + f" and {parts[-1]}"
        return f"sizes it has no CUDA graph for (it graphs {listed})"


class CacheBudget(Frozen):
    """How an engine sizes its KV cache on one GPU: ``fraction`` of the device's memory less the
    weights ([SGL-MEM]) and, where the engine profiles them (vLLM's start-up run), the
    activations of a full step; or, ``of_free``, that fraction of what the weights and the
    activations leave ([TRT-KV])."""

    fraction: float = Field(gt=0, le=1)
    of_free: bool = False
    less_activations: bool = True
    source: str = Field(description="Where the fraction comes from, in words.")

    def kv_bytes(self, memory_bytes: float, weights: float, activations: float) -> float:
        """Bytes for the KV cache on a device of ``memory_bytes``."""
        if self.of_free:
            return max(0.0, self.fraction * (memory_bytes - weights - activations))
        held = weights + (activations if self.less_activations else 0.0)
        return max(0.0, self.fraction * memory_bytes - held)


def sglang_graph_max_bs(hardware: HardwareSpec, tp: int) -> int:
    """SGLang's default ``--cuda-graph-max-bs`` for an engine of ``tp`` GPUs ([SGL-MEM]): the
    largest decode batch it captures in a CUDA graph; larger ones run eagerly
    (``CudaGraphRunner.can_run``).

    >>> from opweave.costmodel import default_catalog
    >>> cat = default_catalog()
    >>> sglang_graph_max_bs(cat.get("h100"), 1), sglang_graph_max_bs(cat.get("h100"), 8)
    (256, 512)
    """
    low, high = next(
        ((lo, hi) for below, lo, hi in SGLANG_GRAPH_BS_TIERS if hardware.memory_bytes < below),
        (SGLANG_LARGE_GRAPH_BS, SGLANG_LARGE_GRAPH_BS),
    )
    return low if tp < 4 else high


def sglang_mem_fraction(
    hardware: HardwareSpec,
    chunk: int,
    tp: int,
    dp: int = 1,
    dp_attention: bool = False,
    graph_bs: int | None = None,
) -> float:
    """SGLang's default ``--mem-fraction-static`` for an engine of ``tp`` GPUs ([SGL-MEM]),
    capturing decode graphs up to ``graph_bs`` requests (default: its own for the GPU).

    >>> from opweave.costmodel import default_catalog
    >>> sglang_mem_fraction(default_catalog().get("h100"), 8192, 1)
    0.835
    """
    mib = hardware.memory_bytes / MIB
    graph_bs = graph_bs or sglang_graph_max_bs(hardware, tp)
    reserved = 512 + max(chunk, 2048) * 1.5 + graph_bs * 2 + tp / 8 * 1024
    if dp_attention:
        reserved += graph_bs * dp * 3 + (graph_bs * dp * 1.5 if graph_bs > 300 else 0.0)
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)


class Lengths(Frozen):
    """A token length: fixed, or drawn uniformly from ``[low, high]`` per request."""

    kind: Literal["fixed", "uniform"] = "fixed"
    tokens: int = Field(ge=1, le=MAX_BATCHED_TOKENS * 16, description="Fixed length (tokens).")
    low_tokens: int | None = Field(default=None, ge=1, description="Uniform: lowest length.")
    high_tokens: int | None = Field(default=None, ge=1, description="Uniform: highest length.")

    @model_validator(mode="after")
    def _bounds(self) -> Lengths:
        if self.kind == "uniform":
            if self.low_tokens is None or self.high_tokens is None:
                raise ValueError("a uniform length needs low_tokens and high_tokens")
            if self.low_tokens > self.high_tokens:
                raise ValueError(
                    f"low_tokens {self.low_tokens} is above high_tokens {self.high_tokens}"
                )
            mean = round((self.low_tokens + self.high_tokens) / 2)
            if self.tokens != mean:  # a uniform length's tokens is its mean, never a setting
                raise ValueError(
                    f"tokens {self.tokens} is not the mean of low_tokens and high_tokens "
                    f"({mean}); a uniform length takes only those two"
                )
        elif self.low_tokens is not None or self.high_tokens is not None:
            raise ValueError("low_tokens and high_tokens belong to a uniform length")
        return self

    @classmethod
    def fixed(cls, tokens: int) -> Lengths:
        return cls(kind="fixed", tokens=tokens)

    @classmethod
    def uniform(cls, low: int, high: int) -> Lengths:
        """Uniform on ``[low, high]``; ``tokens`` is its mean (rounded)."""
        return cls(kind="uniform", tokens=round((low + high) / 2), low_tokens=low, high_tokens=high)

    @classmethod
    def range_ratio(cls, tokens: int, ratio: float) -> Lengths:
        """SGLang's / InferenceX's ``--random-range-ratio r``: uniform on ``[r L, L]`` ([RANGE]).

        >>> Lengths.range_ratio(1024, 0.8).model_dump(exclude_none=True)
        {'kind': 'uniform', 'tokens': 922, 'low_tokens': 819, 'high_tokens': 1024}
        """
        return cls.uniform(max(1, int(tokens * ratio)), tokens)

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return float(self.tokens)
        assert self.low_tokens is not None and self.high_tokens is not None
        return (self.low_tokens + self.high_tokens) / 2

    @property
    def max(self) -> int:
        return self.tokens if self.high_tokens is None else self.high_tokens

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` lengths (integers) drawn from this distribution."""
        if self.kind == "fixed":
            return np.full(count, self.tokens, dtype=np.int64)
        assert self.low_tokens is not None and self.high_tokens is not None
        return rng.integers(self.low_tokens, self.high_tokens + 1, size=count)


class Workload(Frozen):
    """What a deployment serves: lengths, arrivals and the engine's per-step limits.

    Arrivals are either open loop (``rate_per_s``: Poisson arrivals at that mean rate, seeded)
    or closed loop (``concurrency`` clients, each sending its next request when its previous
    one completes). ``num_requests`` bounds the population as benchmark clients do (InferenceX
    sends 10 x concurrency prompts; ``vllm bench serve`` without a rate sends every prompt at
    once: ``concurrency = num_requests``); ``None`` measures the steady state.

    >>> w = Workload(isl=Lengths.fixed(4096), osl=Lengths.fixed(1024), concurrency=64)
    >>> w.arrival
    'closed loop, 64 concurrent requests (steady state)'
    """

    isl: Lengths = Field(description="Prompt (input) tokens per request.")
    osl: Lengths = Field(description="Generated (output) tokens per request.")
    # one request in 11 days to a million a second: beyond either end, a simulated clock of
    # seconds loses the steps' milliseconds (or no engine comes near)
    rate_per_s: float | None = Field(
        default=None,
        ge=MIN_RATE_PER_S,
        le=MAX_RATE_PER_S,
        allow_inf_nan=False,
        description="Poisson arrival rate.",
    )
    concurrency: int | None = Field(
        default=None, ge=1, le=MAX_SEQS * 16, description="Closed-loop clients."
    )
    num_requests: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REQUESTS,
        description="Requests the benchmark sends in all; None: the steady state.",
    )
    engine: Engine = Field(
        default="vllm",
        description="The serving engine whose defaults apply where a field below is not given: "
        "its batch limits, its step policy, its host profile (vllm: V1, prompt chunks "
        "graphed; sglang and tensorrt-llm: steps with prompt chunks run eagerly), the decode "
        "batches it graphs, how it sizes its KV cache and how it makes room when the cache is "
        "full (vllm: preemption resuming from the prefix cache; sglang: recompute; "
        "tensorrt-llm: no admission without room for the whole answer).",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        le=MAX_BATCHED_TOKENS,
        description="Token budget of one engine step (prefill chunks + decodes); None: the "
        "engine's default for the GPU (default_batch_limits).",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SEQS,
        description="Requests one engine runs at once; None: the engine's default for the GPU.",
    )
    scheduling: Literal["mixed", "prefill-first"] | None = Field(
        default=None,
        description="mixed: decodes and prompt chunks share each step, decodes first (vLLM V1, "
        "TensorRT-LLM's in-flight batching); prefill-first: a step of prompt chunks alone "
        "whenever prompts wait, decode steps otherwise (SGLang without --enable-mixed-chunk); "
        "None: the engine's.",
    )
    scheduler_recv_interval: int = Field(
        default=1,
        ge=1,
        le=MAX_RECV_INTERVAL,
        description="Decode steps between the times the engine takes in new requests; a step "
        "with prompt chunks takes them in at once (SGLang's --scheduler-recv-interval). 1: at "
        "every step (vLLM, TensorRT-LLM, SGLang's default).",
    )
    memory_fraction: float | None = Field(
        default=None,
        ge=0.01,
        le=1,
        allow_inf_nan=False,
        description="The engine's memory setting: vLLM's --gpu-memory-utilization and SGLang's "
        "--mem-fraction-static (a share of the device's memory, weights included), "
        "TensorRT-LLM's free_gpu_memory_fraction (a share of what the weights and a full "
        "step's activations leave); None: the engine's default (vLLM 0.9, SGLang's from the "
        "GPU's memory, TensorRT-LLM 0.9).",
    )
    cuda_graph_max_bs: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SEQS,
        description="Largest decode batch the engine replays as a CUDA graph, every batch up "
        "to it padded to a captured size (SGLang's --cuda-graph-max-bs, TensorRT-LLM's "
        "cuda_graph_config max_batch_size with enable_padding); a larger decode step runs "
        "eagerly, at least its kernel launches' host time where the engine's host profile "
        "charges one. None: SGLang's default for the GPU and TP; TensorRT-LLM's default sizes "
        "(1-31, 32, 64, 128, unpadded); no limit for vLLM.",
    )
    seed: int = Field(default=0, ge=0, description="Seed of Poisson arrivals and drawn lengths.")

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_name(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        try:
            return parse_engine(value)
        except ConfigError as exc:  # a validation error, named with its field and file
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _one_arrival(self) -> Workload:
        if (self.rate_per_s is None) == (self.concurrency is None):
            raise ValueError("give either rate_per_s (open loop) or concurrency (closed loop)")
        return self

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    @property
    def arrival(self) -> str:
        """The arrival process in words."""
        tail = (
            " (steady state)"
            if self.num_requests is None
            else f", {self.num_requests} requests in all"
        )
        if self.concurrency is not None:
            return f"closed loop, {self.concurrency} concurrent requests{tail}"
        return f"open loop, Poisson arrivals at {self.rate_per_s:g} requests/s{tail}"

    @property
    def step_policy(self) -> Literal["mixed", "prefill-first"]:
        """The scheduling as given, else the engine's (SGLang's is prefill-first)."""
        if self.scheduling is not None:
            return self.scheduling
        return "prefill-first" if self.engine == "sglang" else "mixed"

    @property
    def cache_rule_text(self) -> str:
        """How the engine sizes its KV cache, in words, for any GPU ([SGL-MEM], [TRT-KV])."""
        if self.memory_fraction is not None:
            return self._cache_rule(f"{self.memory_fraction:g} (given)")
        if self.engine == "sglang":
            return self._cache_rule("as SGLang derives it from the GPU's memory")
        default = TRTLLM_FREE_GPU_MEMORY_FRACTION if self.engine == "tensorrt-llm" else 0.9
        return self._cache_rule(f"{default:g}")

    def _cache_rule(self, fraction: str) -> str:
        """The engine's KV-cache rule in words, at ``fraction`` (a number or how it is set)."""
        if self.engine == "tensorrt-llm":
            return (
                f"free_gpu_memory_fraction {fraction} of the memory the weights and a full "
                "step's activations leave"
            )
        if self.engine == "sglang":
            return f"--mem-fraction-static {fraction} of the GPU, less the weights"
        return (
            f"--gpu-memory-utilization {fraction} of the GPU, less the weights and a full "
            "step's activations"
        )

    @property
    def preemption_text(self) -> str:
        """How the engine makes room in a full KV cache, in words ([V1-PREFIX], [TRT-NOEVICT]
        in :mod:`.serving_sim`)."""
        if self.engine == "tensorrt-llm":
            return (
                "a request admitted only when the KV cache can hold its prompt and whole answer "
                "(GUARANTEED_NO_EVICT), never preempted"
            )
        if self.engine == "vllm":
            return (
                "preemption when the KV cache is full, the preempted request reusing its cached "
                "blocks when it resumes (automatic prefix caching)"
            )
        return "recompute preemption when the KV cache is full"

    @property
    def engine_name(self) -> str:
        """The engine as people write it ("vLLM V1", "SGLang", "TensorRT-LLM")."""
        return ENGINE_NAMES[self.engine]

    @property
    def policy_text(self) -> str:
        """The step policy in words."""
        if self.step_policy == "prefill-first":
            return "a step of prompt chunks alone whenever prompts wait, decode steps otherwise"
        return "decodes scheduled first, then prompt chunks in the same step"

    @property
    def receive_note(self) -> tuple[str, ...]:
        """The receive interval in words, where it is not every step."""
        if self.scheduler_recv_interval == 1:
            return ()
        return (
            f"new requests taken in every {self.scheduler_recv_interval} decode steps and "
            "after each step with prompt chunks (SGLang's --scheduler-recv-interval)",
        )

    def batch_limits(self, hardware: HardwareSpec, dp: int = 1) -> tuple[int, int]:
        """``(max_num_batched_tokens, max_num_seqs)`` of one engine rank on ``hardware``: as
        given, else the engine's defaults; SGLang divides its token budget among ``dp``
        data-parallel attention ranks ([SGL-DP]), vLLM's DP ranks each have their own."""
        tokens, seqs = default_batch_limits(hardware, self.engine)
        tokens = self.max_num_batched_tokens or tokens
        if self.engine == "vllm" and self.max_num_seqs is None:
            # EngineArgs lowers its default running limit to a smaller token budget
            seqs = min(seqs, tokens)
        seqs = self.max_num_seqs or seqs
        if self.engine == "vllm" and tokens < seqs:
            # SchedulerConfig._verify_args (vllm/config/scheduler.py): every running request
            # takes at least one token of a step
            raise ConfigError(
                f"max_num_batched_tokens {tokens} is below max_num_seqs {seqs}, which vLLM "
                "refuses to start with (a step must hold one token of every running request); "
                "give --max-num-batched-tokens of at least --max-num-seqs"
            )
        if self.engine == "sglang":
            tokens = max(1, tokens // dp)
        return tokens, seqs

    @property
    def eager_decode_text(self) -> str | None:
        """Which decode steps run outside the engine's CUDA graphs, in words, for any GPU."""
        if self.engine == "sglang" and self.cuda_graph_max_bs is None:
            return "decode steps of more requests than its largest CUDA graph (--cuda-graph-max-bs)"
        graphs = self._fixed_graphs()
        return None if graphs is None else f"decode steps of {graphs.text}"

    def graph_batches(self, hardware: HardwareSpec, gpus: int) -> GraphBatches | None:
        """The decode batches the engine (over ``gpus`` GPUs) replays as CUDA graphs: up to the
        given ``cuda_graph_max_bs`` (padded), SGLang's default cap for the GPU, TensorRT-LLM's
        default sizes ([TRT-GRAPH]), or None (vLLM: every decode step graphed)."""
        if self.engine == "sglang" and self.cuda_graph_max_bs is None:
            return GraphBatches(max_batch=sglang_graph_max_bs(hardware, gpus))
        return self._fixed_graphs()

    def _fixed_graphs(self) -> GraphBatches | None:
        """The graphed decode batches where they do not depend on the GPU."""
        if self.cuda_graph_max_bs is not None:
            return GraphBatches(max_batch=self.cuda_graph_max_bs)
        if self.engine == "tensorrt-llm":
            return GraphBatches(max_batch=max(TRTLLM_GRAPH_BATCHES), exact=TRTLLM_GRAPH_BATCHES)
        return None

    def cache_budget(self, hardware: HardwareSpec, gpus: int, dp: int = 1) -> CacheBudget:
        """How the engine, spread over ``gpus`` GPUs with ``dp`` data-parallel attention ranks,
        sizes its KV cache on ``hardware``: the given ``memory_fraction`` or its default."""
        given = self.memory_fraction
        if given is not None:
            fraction, note = given, " (given)"
        elif self.engine == "tensorrt-llm":
            fraction, note = TRTLLM_FREE_GPU_MEMORY_FRACTION, ""
        elif self.engine == "sglang":
            chunk = self.max_num_batched_tokens or default_batch_limits(hardware, "sglang")[0]
            graphs = self.graph_batches(hardware, gpus)
            assert graphs is not None  # SGLang always caps its decode graphs
            fraction = sglang_mem_fraction(hardware, chunk, gpus, dp, dp > 1, graphs.max_batch)
            note = " (SGLang's default for the GPU)"
            if fraction <= 0:
                layout = f" with data-parallel attention over {dp} ranks" if dp > 1 else ""
                raise InfeasibleError(
                    f"SGLang's default --mem-fraction-static on {gpus} x {hardware.id}{layout} "
                    f"is {fraction:g}: what it reserves for activations and CUDA graphs exceeds "
                    "the GPU's memory, so the engine does not start; give --memory-fraction "
                    "(SGLang's --mem-fraction-static), fewer DP ranks, or a workload file's "
                    "smaller cuda_graph_max_bs"
                )
        else:  # vLLM's gpu_memory_utilization (0.9 by default: the catalog's usable fraction)
            fraction, note = hardware.usable_memory_fraction, ""
        return CacheBudget(
            fraction=fraction,
            of_free=self.engine == "tensorrt-llm",
            less_activations=self.engine != "sglang",
            source=self._cache_rule(f"{fraction:g}{note}"),
        )

    @property
    def max_context_tokens(self) -> int:
        """Longest prompt plus answer the workload holds."""
        return self.isl.max + self.osl.max

    @property
    def mean_decode_context(self) -> float:
        """Mean context of a decode step: the prompt plus half the answer."""
        return self.isl.mean + self.osl.mean / 2

    def per_replica(self, replicas: int) -> Workload:
        """This workload's share of one of ``replicas`` engines (arrivals split evenly)."""
        if replicas == 1:
            return self
        update: dict[str, object] = {}
        if self.rate_per_s is not None:
            update["rate_per_s"] = self.rate_per_s / replicas
        if self.concurrency is not None:
            update["concurrency"] = max(1, math.ceil(self.concurrency / replicas))
        if self.num_requests is not None:
            update["num_requests"] = max(1, math.ceil(self.num_requests / replicas))
        return self.model_copy(update=update)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def load_workload_file(path: str | Path, **overrides: Any) -> Workload:
    """A workload from a TOML or JSON file of :class:`Workload`'s fields (and, optionally,
    ``schema_version`` 1); a length may be a number of tokens (fixed) or a table
    (``{kind = "uniform", low_tokens = 1000, high_tokens = 3000}``). ``overrides`` (not
    ``None``) replace the file's fields: an arrival given beside the file replaces the file's
    arrival.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "chat.toml"
    >>> _ = f.write_text('isl = {kind = "uniform", low_tokens = 512, high_tokens = 1536}\\n'
    ...                  'osl = 256\\n')
    >>> w = load_workload_file(f, rate_per_s=2.0)
    >>> w.isl.mean, w.osl.tokens, w.arrival
    (1024.0, 256, 'open loop, Poisson arrivals at 2 requests/s (steady state)')
    """
    path = Path(path)
    data = read_data_file(path, "workload file")
    if not isinstance(data, dict):
        raise ConfigError(f"workload file {path} must hold a table of the workload's fields")
    if "schema_version" in data:  # optional: the format has had one version
        data = dict(data)
        version = data.pop("schema_version")
        problem = schema_version_problem(version, 1, toml=path.suffix.lower() == ".toml")
        if problem is not None:
            raise ConfigError(f"workload file {path}: schema_version {problem}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if {"rate_per_s", "concurrency"} & set(given):
        data = {k: v for k, v in data.items() if k not in ("rate_per_s", "concurrency")}
    data = {**data, **given}
    for key in ("isl", "osl"):
        value = data.get(key)
        if _is_int(value):
            data[key] = {"kind": "fixed", "tokens": value}
        elif isinstance(value, dict) and value.get("kind") == "uniform" and "tokens" not in value:
            low, high = value.get("low_tokens"), value.get("high_tokens")
            if not (_is_int(low) and _is_int(high)):
                raise ConfigError(
                    f"workload file {path}: {key}: a uniform length needs integer low_tokens "
                    "and high_tokens"
                )
            data[key] = {**value, "tokens": round((low + high) / 2)}
    try:
        # strict: a file's true is not a concurrency of 1, nor "2" a rate
        return Workload.model_validate(data, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "file"
        raise ConfigError(
            f"workload file {path}: {where}: {validation_message(err)} "
            "(fields: isl, osl, rate_per_s or "
            "concurrency, engine, max_num_batched_tokens, max_num_seqs, scheduling, "
            "scheduler_recv_interval, memory_fraction, cuda_graph_max_bs, seed)"
        ) from None
