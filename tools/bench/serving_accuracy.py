"""``costmodel_accuracy.py --set serving``: TTFT and TPOT against published serving benchmarks.

The reference is ``serving_accuracy_data.toml`` beside this file (see its header). Each row is
replayed as its benchmark ran it:

- **aggregated** rows: :func:`opweave.costmodel.estimate_serving` (a simulation of the engine's
  scheduler with chunked prefill) with the row's client: InferenceX's closed loop of 10 x
  concurrency prompts with lengths uniform in [0.8 L, L]; ``sglang.bench_serving``'s
  ``--num-prompts`` where the row's note names it; ``vllm bench serve`` sending every prompt at
  once (rate "inf": a population of ``concurrency`` requests that all arrive at time 0); a
  steady closed loop otherwise. The engine's limits are those its serve command sets
  (``--chunked-prefill-size``, ``--max-num-batched-tokens``, ``--max-running-requests``,
  ``--max-num-seqs``), else the row's engine's defaults for the GPU
  (:func:`~opweave.costmodel.default_batch_limits`; said in the output). Rows measured with
  ``sglang.bench_serving``'s random
  dataset draw their lengths as that client does (:func:`sglang_random_lengths`). SGLang rows
  schedule prompt chunks in steps of their own (its default, unless the serve command has
  ``--enable-mixed-chunk``); the other engines mix them into the decode steps. Each engine's
  host profile (:func:`engine_host`) says how its steps with prompt chunks run: eagerly in
  SGLang and TensorRT-LLM (at least their kernel launches' host time), graphed in vLLM V1.
- **P/D** rows: the decode workers hold the clients up to their batch cap (the row's
  ``decode_max_batch``, the recipe's); the decode pool's step at that per-worker batch and the
  mean context is the TPOT (:func:`~opweave.costmodel.decode_pool`). The TTFT is the prefill
  pool's (:func:`~opweave.costmodel.prefill_pool`, Poisson arrivals at the closed loop's request
  rate split over the prefill workers) plus the hand-off to the decode worker, which takes the
  request in, sees its KV arrive and emits the first token at its step boundaries
  (:func:`~opweave.costmodel.decode_handoff_s`, with the KV transfer between the pools of
  :func:`~opweave.costmodel.kv_transfer_s`: NVLink inside a GB200/GB300 NVL72 rack, the network
  otherwise; [DYNAMO-FIRST] in the data file), or, where more clients run than the caps admit,
  their wait for a decode slot by Little's law (the clients beyond the slots over the decode
  pool's request rate), whichever is longer. A
  decode pool with attention DP holds the dense FFN layers whole on every GPU (``dense_dp``,
  :mod:`opweave.costmodel`'s parallelism) where the engine runs them so: TensorRT-LLM whenever
  attention DP is on, and Dynamo's SGLang recipes on GB200/GB300 (``--moe-dense-tp-size 1``);
  ``production_decode_data.toml``'s header cites both.

The signed error is ``(estimate - measured) / measured``; the medians of the absolute errors are
printed per engine, GPU and deployment. Goal: median <= 8% for TPOT and <= 15% for TTFT.
"""

from __future__ import annotations

import re
import statistics
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opweave.costmodel import (
    Engine,
    HostProfile,
    Lengths,
    ModelSpec,
    Workload,
    decode_handoff_s,
    default_catalog,
    estimate_serving,
    estimate_step,
    host_profile,
    kv_transfer_s,
    parse_engine,
    prefill_pool,
)
from opweave.costmodel import engine_host as costmodel_engine_host
from opweave.costmodel.errors import ConfigError, OpWeaveError

SERVING = Path(__file__).with_name("serving_accuracy_data.toml")
GOAL_TPOT, GOAL_TTFT = 0.08, 0.15
# InferenceX: lengths uniform in [0.8 L, L], 10 x concurrency prompts (the data file's header)
INFERENCEX_RATIO, INFERENCEX_PROMPTS_PER_CLIENT = 0.8, 10
RACK_SCALE = ("gb200", "gb300")
SGL_RANDOM_FLAGS = ("input-len", "output-len", "range-ratio")
FLAGS = {
    "max_num_batched_tokens": (
        r"--chunked-prefill-size[ =](\d+)",
        r"--max-num-batched-tokens[ =](\d+)",
    ),
    "max_num_seqs": (r"--max-running-requests[ =](\d+)", r"--max-num-seqs[ =](\d+)"),
    "scheduler_recv_interval": (r"--scheduler-recv-interval[ =](\d+)",),
    "cuda_graph_max_bs": (r"--cuda-graph-max-bs[ =](\d+)",),
}
# the engine's memory setting ([SGL-MEM], vLLM's utilisation), where the serve command gives it
MEMORY_FLAGS = (r"--mem-fraction-static[ =]([\d.]+)", r"--gpu-memory-utilization[ =]([\d.]+)")


@dataclass(frozen=True)
class Figures:
    """An estimate's mean TTFT and TPOT, and their medians over the requests, in ms."""

    ttft_ms: float
    tpot_ms: float
    ttft_median_ms: float
    tpot_median_ms: float


@dataclass(frozen=True)
class ServingResult:
    row: dict[str, Any]
    ttft_ms: float | None
    tpot_ms: float | None
    why: str = ""
    limits: str = ""
    medians: tuple[float, float] | None = None  # the estimate's median TTFT and TPOT, ms

    def error(self, which: str) -> float:
        est = self.ttft_ms if which == "ttft" else self.tpot_ms
        assert est is not None
        meas = float(self.row[f"{which}_ms"])
        return (est - meas) / meas

    def median_error(self, which: str) -> float | None:
        """The estimate's median against the row's, where the row prints one."""
        meas = self.row.get(f"{which}_median_ms")
        if meas is None or self.medians is None:
            return None
        est = self.medians[0 if which == "ttft" else 1]
        return (est - float(meas)) / float(meas)


def row_engine(row: dict[str, Any]) -> Engine:
    """The engine whose defaults the row ran with (Dynamo's workers are the engine they wrap;
    NIM's LLM profiles are TensorRT-LLM engines)."""
    engine = row["engine"].removeprefix("dynamo+")
    return parse_engine("tensorrt-llm" if engine == "nim" else engine)


def engine_limits(row: dict[str, Any]) -> tuple[dict[str, int], str]:
    """The batch limits the row's serve command sets, and where they come from (else the
    engine's defaults for the GPU, :func:`opweave.costmodel.default_batch_limits`)."""
    command = row.get("serve_command", "")
    limits: dict[str, int] = {}
    for field, patterns in FLAGS.items():
        for pattern in patterns:
            match = re.search(pattern, command)
            if match:
                limits[field] = int(match.group(1))
    if "max_num_batched_tokens" in row:
        limits["max_num_batched_tokens"] = int(row["max_num_batched_tokens"])
    return limits, "serve command" if limits else f"{row_engine(row)} defaults"


def memory_fraction(row: dict[str, Any]) -> float | None:
    """The memory share the row's serve command gives the engine (else its default)."""
    command = row.get("serve_command", "")
    for pattern in MEMORY_FLAGS:
        match = re.search(pattern, command)
        if match:
            return float(match.group(1))
    return None


def engine_host(row: dict[str, Any]) -> HostProfile | None:
    """The host profile of the row's engine (:func:`opweave.costmodel.engine_host`): SGLang
    and TensorRT-LLM's PyTorch flow (every row's ``trtllm-serve``, Dynamo's workers included)
    run steps with prompt chunks eagerly, vLLM V1 graphs them; NIM's TensorRT engines run
    whole compiled engines, so their rows keep the overlapped profile."""
    if row["engine"] == "nim":
        return host_profile("overlapped")
    return costmodel_engine_host(row_engine(row))


def sglang_random_lengths(row: dict[str, Any]) -> tuple[Lengths, Lengths] | None:
    """The lengths ``sglang.bench_serving --dataset-name random`` draws, where the row's note
    names that client: prompts uniform in ``[max(int(I r), 1), I]`` and answers in
    ``[int(O r), O]`` tokens for ``--random-input-len I --random-output-len O
    --random-range-ratio r`` (default 0: ``sample_random_requests`` in
    python/sglang/bench_serving.py; the answer's floor is kept at one token here)."""
    note = row.get("note", "")
    if "sglang.bench_serving --dataset-name random" not in note:
        return None
    found = [re.search(rf"--random-{name}[ =]([\d.]+)", note) for name in SGL_RANDOM_FLAGS]
    if found[0] is None or found[1] is None:
        raise ConfigError(
            f"note names sglang.bench_serving's random dataset without lengths: {note}"
        )
    isl, osl = int(found[0].group(1)), int(found[1].group(1))
    ratio = float(found[2].group(1)) if found[2] else 0.0
    return (
        Lengths.uniform(max(int(isl * ratio), 1), isl),
        Lengths.uniform(max(int(osl * ratio), 1), osl),
    )


def workload_for(row: dict[str, Any], replicas: int) -> Workload:
    limits, _ = engine_limits(row)
    isl, osl = round(float(row["isl"])), max(2, round(float(row["osl"])))
    conc = int(row["concurrency"])
    prompts: int | None = None
    if row["source"].startswith("InferenceX"):
        isl_l = Lengths.range_ratio(isl, INFERENCEX_RATIO)
        osl_l = Lengths.range_ratio(osl, INFERENCEX_RATIO)
        prompts = INFERENCEX_PROMPTS_PER_CLIENT * conc
    else:
        isl_l, osl_l = sglang_random_lengths(row) or (Lengths.fixed(isl), Lengths.fixed(osl))
        match = re.search(r"--num-prompts?\s+(\d+)", row.get("note", ""))
        if match:
            prompts = int(match.group(1))
        if str(row.get("rate_rps", "")).startswith("inf"):
            prompts = conc
    # SGLang runs a waiting prompt's chunks in a step of their own (the engine's step policy)
    # unless --enable-mixed-chunk ([SGL-SCHED] in opweave.costmodel's serving_sim)
    mixed = "--enable-mixed-chunk" in row.get("serve_command", "")
    w = Workload(
        isl=isl_l,
        osl=osl_l,
        concurrency=conc,
        num_requests=prompts,
        engine=row_engine(row),
        scheduling="mixed" if mixed else None,
        memory_fraction=memory_fraction(row),
        **limits,
    )
    return w.per_replica(replicas)


def _aggregated(row: dict[str, Any], model: ModelSpec) -> Figures:
    hw = default_catalog().get(row["gpu"])
    tp, dp = int(row["tp"]), int(row["dp"])
    if tp % dp:
        raise ConfigError(f"dp {dp} does not divide tp {tp}")
    w = workload_for(row, int(row.get("replicas", 1)))
    est = estimate_serving(
        model,
        hw,
        tp=tp // dp,
        ep=int(row["ep"]),
        dp=dp,
        workload=w,
        host=engine_host(row),
    )
    return Figures(est.ttft_s * 1e3, est.tpot_s * 1e3, est.ttft_p50_s * 1e3, est.tpot_p50_s * 1e3)


def dense_dp(row: dict[str, Any], pool: dict[str, Any]) -> bool:
    """Whether ``pool`` (with attention DP) runs the dense FFN layers data-parallel, as the
    production rows' ``dense_dp`` says for the same engines: TensorRT-LLM's
    ``DeepseekV3DecoderLayer._compute_mlp_tp_size`` ("If using attention DP, the MLP also uses
    DP instead of TP"), and the Dynamo SGLang recipes InferenceX runs on GB200/GB300
    (``--moe-dense-tp-size 1``)."""
    if not pool.get("dp_attention"):
        return False
    engine = row["engine"]
    return "tensorrt-llm" in engine or (engine == "dynamo+sglang" and row["gpu"] in RACK_SCALE)


def _layout(pool: dict[str, Any]) -> tuple[int, int, int]:
    """(TP inside attention, EP, attention DP ranks) of a P/D pool."""
    tp, ep = int(pool["tp"]), int(pool.get("ep", 1))
    return (1, ep, tp) if pool.get("dp_attention") else (tp, ep, 1)


@dataclass(frozen=True)
class DecodePoint:
    """Where a P/D row's decode workers run: requests decoding in all and per worker, and the
    mean context (InferenceX's mean lengths: 0.9 of the nominal ones)."""

    isl: int
    osl: int
    decoding: int
    per_worker: int

    @property
    def context(self) -> int:
        return self.isl + self.osl // 2


def decode_point(row: dict[str, Any]) -> DecodePoint:
    dec = row["decode_pool"]
    conc = int(row["concurrency"])
    isl, osl = round(float(row["isl"]) * 0.9), round(float(row["osl"]) * 0.9)  # InferenceX means
    workers = int(dec["workers"])
    # the decode workers admit at most their batch cap (per DP rank with DP attention): the
    # recipe's, where the row names it ([DYNAMO-FIRST] in the data file: the client's first
    # token comes from the decode worker, so clients beyond the slots wait inside their TTFT)
    slots = workers * _layout(dec)[2] * int(row.get("decode_max_batch", conc))
    decoding = min(conc, slots)
    return DecodePoint(isl, osl, decoding, max(1, round(decoding / workers)))


def _pd(row: dict[str, Any], model: ModelSpec) -> Figures:
    hw = default_catalog().get(row["gpu"])
    pre, dec = row["prefill_pool"], row["decode_pool"]
    conc = int(row["concurrency"])
    point = decode_point(row)
    isl, osl, decoding, per_worker = point.isl, point.osl, point.decoding, point.per_worker
    dtp, dep, ddp = _layout(dec)
    step = estimate_step(
        model,
        hw,
        tp=dtp,
        ep=dep,
        dp=ddp,
        batch=per_worker,
        context=point.context,
        host=engine_host(row),
        dense_dp=dense_dp(row, dec),
    ).step_latency_s
    rate = decoding / (osl * step)  # closed loop: a decoding request lasts about osl steps
    ptp, pep, pdp = _layout(pre)
    budget = engine_limits(row)[0].get("max_num_batched_tokens")
    w = Workload(
        isl=Lengths.fixed(isl),
        osl=Lengths.fixed(osl),
        rate_per_s=rate,
        engine=row_engine(row),
        max_num_batched_tokens=budget,
    )
    pool = prefill_pool(
        model,
        hw,
        tp=ptp,
        ep=pep,
        dp=pdp,
        workload=w,
        rate_per_s=rate / int(pre["workers"]),
        host=engine_host(row),
    )
    link = "nvlink" if row["gpu"] in RACK_SCALE else "network"
    move = kv_transfer_s(model, isl, tp=ptp, link=link, prefill=hw)
    # Little's law over the clients not decoding: they leave the queue at the decode rate
    waiting = (conc - decoding) / rate
    # [PD-FIRST]: the decode worker takes the request in, sees its KV arrive and emits its first
    # token at its step boundaries; a client waiting for a slot waits through all of that
    handoff = decode_handoff_s(move, step, row_engine(row))
    return Figures(
        max(pool.ttft_s + handoff, waiting) * 1e3,
        step * 1e3,
        max(pool.ttft_p50_s + handoff, waiting) * 1e3,
        step * 1e3,  # every step of a decode-only worker is the same
    )


def evaluate(
    rows: Sequence[dict[str, Any]], model_of: Callable[[dict[str, Any]], ModelSpec]
) -> list[ServingResult]:
    out = []
    for row in rows:
        try:
            model = model_of(row)
            run = _pd if row["deployment"] == "pd" else _aggregated
            f = run(row, model)
            out.append(
                ServingResult(
                    row,
                    f.ttft_ms,
                    f.tpot_ms,
                    limits=engine_limits(row)[1],
                    medians=(f.ttft_median_ms, f.tpot_median_ms),
                )
            )
        except (OpWeaveError, KeyError, ValueError) as exc:
            out.append(ServingResult(row, None, None, str(exc).strip("'\"")))
    return out


def _median(results: Sequence[ServingResult], which: str) -> str:
    errs = [abs(r.error(which)) for r in results]
    if not errs:
        return "     -"
    return f"{100 * statistics.median(errs):5.1f}%"


def source_name(row: dict[str, Any]) -> str:
    """The publisher a row comes from: "InferenceX", or the repository or site its source
    names first ("gpustack/gpustack", "sgl-project/sgl-cookbook", "docs.nvidia.com")."""
    first = row["source"].split()[0]
    if first.startswith("InferenceX"):
        return "InferenceX"
    parts = first.split("/")
    return "/".join(parts[:2]) if "." not in parts[0] else parts[0]


def summary(results: Sequence[ServingResult]) -> str:
    if not results:
        return "n=0"
    signed = [r.error("tpot") for r in results]
    return (
        f"n={len(results):<4} TPOT median |err| {_median(results, 'tpot')} (signed mean "
        f"{100 * statistics.mean(signed):+6.1f}%)   TTFT median |err| {_median(results, 'ttft')}"
    )


def print_rows(results: Sequence[ServingResult]) -> None:
    head = (
        f"{'model':<15}{'quant':<10}{'gpu':<9}{'tp':>3}{'ep':>4}{'dp':>4}{'conc':>6}{'isl':>7}"
        f"{'osl':>7}{'TTFT ms':>10}{'est':>10}{'err':>8}{'TPOT ms':>9}{'est':>8}{'err':>8}  "
        f"{'deploy':<11}{'engine':<22}limits"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        row = r.row
        assert r.ttft_ms is not None and r.tpot_ms is not None
        print(
            f"{row['model']:<15}{row['quant']:<10}{row['gpu']:<9}{row['tp']:>3}{row['ep']:>4}"
            f"{row['dp']:>4}{row['concurrency']:>6}{float(row['isl']):>7.0f}{float(row['osl']):>7.0f}"
            f"{row['ttft_ms']:>10.1f}{r.ttft_ms:>10.1f}{100 * r.error('ttft'):>+7.0f}%"
            f"{row['tpot_ms']:>9.2f}{r.tpot_ms:>8.2f}{100 * r.error('tpot'):>+7.0f}%  "
            f"{row['deployment']:<11}{row['engine']:<22}{r.limits}"
        )


def print_medians(results: Sequence[ServingResult]) -> None:
    """The same comparison on the median request, for the rows that print medians: a mean
    over a benchmark's requests also holds its outliers (a first request that compiles
    kernels, a client's start-up), which the median does not."""
    print(
        "\nMedians: the estimate's median request against the row's, where the row prints one "
        "(a P/D row's wait for a decode slot is Little's law's mean in both)"
    )
    by_source: dict[str, list[ServingResult]] = {"all": list(results)}
    for r in results:
        by_source.setdefault(f"source {source_name(r.row)}", []).append(r)
    for name, part in by_source.items():
        cells = []
        for which in ("tpot", "ttft"):
            errs = [abs(e) for r in part if (e := r.median_error(which)) is not None]
            median = f"{100 * statistics.median(errs):5.1f}%" if errs else "     -"
            cells.append(f"{which.upper()} n={len(errs):<4} median |err| {median}")
        print(f"{name:<32}{'   '.join(cells)}")


def run_serving(model_of: Callable[[dict[str, Any]], ModelSpec]) -> None:
    rows = tomllib.loads(SERVING.read_text())["rows"]
    scoped = [r for r in rows if r.get("in_scope", True)]
    results = evaluate(scoped, model_of)
    described = [r for r in results if r.ttft_ms is not None]
    missing = [r for r in results if r.ttft_ms is None]
    print(
        f"\nCost model vs published serving benchmarks ({SERVING.name}): {len(scoped)} rows in "
        f"scope ({len(rows) - len(scoped)} out of scope), {len(described)} described "
        f"({100 * len(described) / max(1, len(scoped)):.0f}%). Statistic: the mean TTFT and TPOT "
        "over the benchmark's requests, as the rows print them (medians further down)."
    )
    print_rows(described)
    print("\nErrors, signed = (estimate - measured) / measured")
    groups: list[tuple[str, Callable[[ServingResult], bool]]] = [("all", lambda r: True)]
    for key in ("deployment", "engine", "gpu"):
        for value in sorted({str(r.row[key]) for r in described}):
            groups.append((f"{key} {value}", lambda r, k=key, v=value: str(r.row[k]) == v))
    for value in sorted({source_name(r.row) for r in described}):
        groups.append((f"source {value}", lambda r, v=value: source_name(r.row) == v))
    for name, keep in groups:
        print(f"{name:<32}{summary([r for r in described if keep(r)])}")
    if described:
        tpot = statistics.median(abs(r.error("tpot")) for r in described)
        ttft = statistics.median(abs(r.error("ttft")) for r in described)
        print(
            f"goal median <= {100 * GOAL_TPOT:.0f}% TPOT and <= {100 * GOAL_TTFT:.0f}% TTFT: "
            f"TPOT {'met' if tpot <= GOAL_TPOT else 'not met'} ({100 * tpot:.1f}%), "
            f"TTFT {'met' if ttft <= GOAL_TTFT else 'not met'} ({100 * ttft:.1f}%)"
        )
        print_medians(described)
    if missing:
        print("\nNot described (not in the statistics):")
        reasons: dict[str, int] = {}
        for r in missing:
            row = r.row
            why = f"{row['model']} on {row['gpu']} ({row['deployment']}): {r.why}"
            reasons[why] = reasons.get(why, 0) + 1
        for why, n in sorted(reasons.items()):
            print(f"  {n} x {why}")


def other_estimate(row: dict[str, Any], estimator: Any) -> tuple[float | None, float]:
    """(TTFT, TPOT) in ms of another estimator (``aic_estimator.AicEstimator``) for a row,
    given the deployment and the point OpWeave's estimate uses: an aggregated row's
    requests in flight per instance (at most the engine's ``max_num_seqs``), mean lengths and
    prefill token budget; a P/D row's decode step at the requests per attention rank and the
    mean context (its TTFT is not compared: None)."""
    from aic_estimator import Deployment

    if row["deployment"] == "pd":
        dec = row["decode_pool"]
        tp, ep, dp = _layout(dec)
        d = Deployment(
            row["model"], row["quant"], row["gpu"], row["engine"], tp * dp, ep, dp,
            row.get("kv_cache_dtype", "auto"),
        )  # fmt: skip
        point = decode_point(row)
        batch = max(1, round(point.per_worker / dp))
        return None, estimator.decode_step_ms(d, batch, point.context)
    tp, ep, dp = int(row["tp"]), int(row["ep"]), int(row["dp"])
    d = Deployment(
        row["model"], row["quant"], row["gpu"], row["engine"], tp, ep, dp,
        row.get("kv_cache_dtype", "auto"),
    )  # fmt: skip
    w = workload_for(row, int(row.get("replicas", 1)))
    budget, seqs = w.batch_limits(default_catalog().get(row["gpu"]))
    # its batch is per attention rank, as the P/D branch's
    batch = max(1, round(min(int(w.concurrency or 1), seqs) / dp))
    isl, osl = max(1, round(w.isl.mean)), max(2, round(w.osl.mean))
    return estimator.serving_ms(d, batch, isl, osl, budget)


def run_other(model_of: Callable[[dict[str, Any]], ModelSpec], estimator: Any) -> None:
    """OpWeave's errors beside another estimator's on the rows both describe."""
    from aic_estimator import NotCovered, version

    rows = tomllib.loads(SERVING.read_text())["rows"]
    ours = [r for r in evaluate([r for r in rows if r.get("in_scope", True)], model_of)]
    pairs: list[tuple[ServingResult, float | None, float]] = []
    skipped: dict[str, int] = {}
    for r in ours:
        if r.ttft_ms is None:
            continue
        try:
            ttft, tpot = other_estimate(r.row, estimator)
        except NotCovered as exc:
            why = f"{r.row['model']} on {r.row['gpu']} ({r.row['engine']}): {exc}"
            skipped[why] = skipped.get(why, 0) + 1
            continue
        pairs.append((r, ttft, tpot))
    print(
        f"\nServing rows ({SERVING.name}): OpWeave beside aiconfigurator-core {version()}'s own "
        f"estimate ({', '.join(sorted(estimator.versions))}); {len(pairs)} rows both describe. "
        "Aggregated rows: its aggregated-serving TTFT and TPOT at the same requests in flight; "
        "P/D rows: its decode step (TPOT only)."
    )
    head = (
        f"{'model':<15}{'gpu':<9}{'tp':>3}{'ep':>4}{'dp':>4}{'conc':>6}{'TTFT ms':>10}"
        f"{'opweave':>9}{'aic':>9}{'TPOT ms':>9}{'opweave':>9}{'aic':>9}  {'deploy':<11}engine"
    )
    print(head)
    print("-" * len(head))
    for r, ttft, tpot in pairs:
        row = r.row
        aic_ttft = "-" if ttft is None else f"{ttft:.1f}"
        print(
            f"{row['model']:<15}{row['gpu']:<9}{row['tp']:>3}{row['ep']:>4}{row['dp']:>4}"
            f"{row['concurrency']:>6}{row['ttft_ms']:>10.1f}{r.ttft_ms:>9.1f}{aic_ttft:>9}"
            f"{row['tpot_ms']:>9.2f}{r.tpot_ms:>9.2f}{tpot:>9.2f}  {row['deployment']:<11}"
            f"{row['engine']}"
        )

    def medians(part: list[tuple[ServingResult, float | None, float]]) -> str:
        def med(values: list[float]) -> str:
            return f"{100 * statistics.median(values):5.1f}%" if values else "     -"

        out = []
        for name, pick in (("opweave", 0), ("aiconfigurator", 1)):
            tpot = [
                abs((r.tpot_ms if pick == 0 else t) - r.row["tpot_ms"]) / r.row["tpot_ms"]
                for r, _, t in part
                if r.tpot_ms is not None
            ]
            ttft = [
                abs((r.ttft_ms if pick == 0 else f) - r.row["ttft_ms"]) / r.row["ttft_ms"]
                for r, f, _ in part
                if f is not None and r.ttft_ms is not None
            ]
            out.append(f"{name} TPOT {med(tpot)} TTFT {med(ttft)}")
        return f"n={len(part):<4}" + "   ".join(out)

    print("\nMedian |error| per group, OpWeave and aiconfigurator on the same rows")
    groups: list[tuple[str, Callable[[ServingResult], bool]]] = [("all", lambda r: True)]
    for key in ("deployment", "engine", "gpu"):
        for value in sorted({str(r.row[key]) for r, _, _ in pairs}):
            groups.append((f"{key} {value}", lambda r, k=key, v=value: str(r.row[k]) == v))
    for name, keep in groups:
        part = [p for p in pairs if keep(p[0])]
        if part:
            print(f"{name:<32}{medians(part)}")
    if skipped:
        print("\nNot estimated by aiconfigurator:")
        for why, n in sorted(skipped.items()):
            print(f"  {n} x {why}")


def production_tpot_ms(row: dict[str, Any], model: ModelSpec) -> float:
    """TPOT of an aggregated row of ``production_decode_data.toml`` (fields: tp, ep, dp,
    batch per DP rank or instance, isl, osl, source, note) with prefill mixed in."""
    as_serving = dict(row) | {
        "concurrency": max(1, round(float(row["batch"]) * int(row["dp"]))),
        "replicas": 1,
    }
    return _aggregated(as_serving, model).tpot_ms
