"""The commands' options, declared once as ``Annotated`` types.

A command's signature names its options with these types (``tp: TpOpt = 1``), so every flag's
name, range check and help text lives here, in one place, and commands that take the same
option (``run`` and ``serve`` take the same serving options) take the same declaration.
Names, defaults, ranges and help texts are part of the CLI contract: scripts rely on them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

MAX_BATCH = 1 << 20  # requests per step / replica: far beyond any GPU's memory
MAX_COUNT = 1 << 16  # replicas, ranks, microbatches, repeats: far beyond any deployment
MAX_GROUP = 1024  # EP / DP degree: opweave.costmodel.MAX_GROUP_GPUS (not imported: CLI start-up)
MAX_MICROBATCHES = 64  # a plan file's: opweave.costmodel.MAX_MICROBATCHES (not imported either)
MAX_TOKENS = 1 << 31  # a token count (context, max tokens) beyond any model's positions

# opweave.runtime's Kernels, DecodeStep and Wait, spelled out so that a bad flag fails before the
# runtime (and torch with it) is imported; a test checks that they are the runtime's choices
STRATEGIES = ("colocated", "afd", "cad")
KERNELS = ("opweave", "vllm", "vllm-all")
DECODE_STEPS = ("per-request", "static", "compiled", "traced")
WAITS = ("auto", "spin", "block")
API_KEY_ENV = "OPWEAVE_API_KEY"  # the server's key, kept out of the command line (ps shows it)


def finite(value: float | None) -> float | None:
    """Option callback: ``inf`` and ``nan`` parse as floats, but are no setting's value."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def positive_price(value: float | None) -> float | None:
    """Option callback for a price in USD per hour: finite and above zero."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} is not a price; give a positive number of USD")
    return value


# -- every command ------------------------------------------------------------------------------
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document, nothing else.")]
HardwareOpt = Annotated[
    Path | None,
    typer.Option("--hardware", help="TOML/JSON file adding or overriding GPUs ([[gpus]] entries)."),
]
ModelArg = Annotated[
    str,
    typer.Argument(help="Built-in model name, or a path to a Hugging Face config.json or folder."),
]
QuantOpt = Annotated[
    str | None,
    typer.Option(
        "--quant",
        help="Weight format to serve an unquantised checkpoint in: bf16, fp8, fp8-block, nvfp4, "
        "mxfp4, int4-wo, fp16, fp32 (default: the checkpoint's own, a float32 one in bf16 as "
        "engines serve it; a quantised checkpoint keeps its format).",
    ),
]
KvCacheOpt = Annotated[
    str,
    typer.Option(
        "--kv-cache-dtype",
        help="KV-cache dtype: auto (the checkpoint's FP8 KV scales if it ships them, else the "
        "model's dtype) or fp8.",
    ),
]

# -- a serving workload (estimate, plan) --------------------------------------------------------
IslOpt = Annotated[
    str | None, typer.Option("--isl", help="Serving: prompt tokens per request, e.g. 4096 or 4K.")
]
OslOpt = Annotated[
    str | None,
    typer.Option("--osl", help="Serving: generated tokens per request, e.g. 1024 or 1K."),
]
ConcurrencyOpt = Annotated[
    int | None,
    typer.Option(
        "--concurrency",
        min=1,
        max=MAX_BATCH,
        help="Serving: closed-loop clients, each sending its next request when the last one "
        "finishes.",
    ),
]
RateOpt = Annotated[
    float | None,
    typer.Option(
        "--rate",
        callback=finite,
        help="Serving: Poisson arrivals, requests per second (instead of --concurrency).",
    ),
]
EngineOpt = Annotated[
    str | None,
    typer.Option(
        "--engine",
        help="Serving: the engine whose defaults apply (vllm, sglang, tensorrt-llm; default "
        "vllm): its per-step token budget and running-request cap for the GPU, its step policy "
        "and its host profile (SGLang and TensorRT-LLM run steps with prompt chunks eagerly).",
    ),
]
SchedulingOpt = Annotated[
    str | None,
    typer.Option(
        "--scheduling",
        help="Serving: the engine's step policy: mixed (prompt chunks share the decode steps, "
        "vLLM and TensorRT-LLM) or prefill-first (prompt chunks in steps of their own, SGLang "
        "without --enable-mixed-chunk); default: the --engine's.",
    ),
]
RecvIntervalOpt = Annotated[
    int | None,
    typer.Option(
        "--scheduler-recv-interval",
        min=1,
        max=1 << 16,
        help="Serving: decode steps between the times the engine takes in new requests, as "
        "SGLang's --scheduler-recv-interval (a prefill step takes them in at once; default 1: "
        "every step).",
    ),
]
MemoryFractionOpt = Annotated[
    float | None,
    typer.Option(
        "--memory-fraction",
        min=0.01,
        max=1.0,
        help="Serving: the engine's memory setting, which sizes its KV cache: vLLM's "
        "--gpu-memory-utilization or SGLang's --mem-fraction-static (a share of the GPU's "
        "memory, weights included), TensorRT-LLM's free_gpu_memory_fraction (a share of what "
        "the weights and activations leave); default: the --engine's. In plans it sizes the "
        "aggregated and prefill engines; decode pools keep 0.9 of each GPU.",
    ),
]
WorkloadFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--workload",
        help='Serving: a TOML/JSON workload file (isl, osl as tokens or {kind = "uniform", '
        "low_tokens, high_tokens}; rate_per_s or concurrency); --rate/--concurrency replace "
        "its arrival.",
    ),
]
MaxBatchedTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-num-batched-tokens",
        min=1,
        max=1 << 20,
        help="Serving: token budget of one engine step (default: the --engine's for the GPU).",
    ),
]
MaxSeqsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-num-seqs",
        min=1,
        max=1 << 16,
        help="Serving: requests one engine runs at once (default: the --engine's for the GPU).",
    ),
]

# -- estimate ---------------------------------------------------------------------------------
GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU id, e.g. h100.")]
TpOpt = Annotated[
    int, typer.Option("--tp", help="Tensor-parallel degree of each DP rank (1, 2, 4, 8).")
]
EpOpt = Annotated[
    int,
    typer.Option(
        "--ep",
        help="Expert-parallel degree: GPU sets the routed experts are sharded over; divides "
        "tp x dp (tp x dp: one set per GPU, tokens dispatched by all-to-all; 1: experts "
        "tensor-parallel over all tp x dp GPUs). MoE models only.",
    ),
]
DpOpt = Annotated[
    int,
    typer.Option(
        "--dp",
        help="Data-parallel attention ranks: the replica spans tp x dp GPUs; each rank of "
        "tp GPUs runs attention (with its own KV cache) on its share of --batch.",
    ),
]
DenseDpOpt = Annotated[
    bool,
    typer.Option(
        "--dense-dp",
        help="With --dp above 1: dense FFN layers whole on every GPU, each computing its "
        "own tokens (SGLang's --moe-dense-tp-size 1, TensorRT-LLM under attention DP), not "
        "split over the replica.",
    ),
]
StepBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--batch",
        min=1,
        max=MAX_BATCH,
        help="Requests per step of the replica, split over its DP ranks (ceil(B/dp) each); "
        "default 1. A single decode step (not with --isl/--osl).",
    ),
]
ContextOpt = Annotated[
    str | None,
    typer.Option(
        "--context",
        help="Context tokens, e.g. 8192 or 8K (default: 4096, or the model's context if shorter).",
    ),
]
HostOpt = Annotated[
    str | None,
    typer.Option(
        "--host",
        help="Serving engine whose host time to charge (overlapped, sglang, sglang-sync, "
        "tensorrt-llm, vllm-0.6, vllm-0.4): per decode step, and for sglang and "
        "tensorrt-llm steps with prompt chunks run eagerly (at least their kernel launches' "
        "host time); default: the --engine's in serving, else the GPU's step_overhead_s "
        "(an overlapped engine).",
    ),
]
ExpertImbalanceOpt = Annotated[
    float | None,
    typer.Option(
        "--expert-imbalance",
        callback=finite,
        help="Measured busiest-over-mean expected load of the expert GPUs (>= 1; e.g. "
        "1.3-4.0 without a load balancer); default: balanced (EPLB), an assumption the "
        "output states.",
    ),
]
ProfileFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        help="A profile of this model on --gpu (measured, or imported with opweave profile "
        "--from aiconfigurator): its operator latencies replace the roofline's.",
    ),
]

# -- analyze ----------------------------------------------------------------------------------
DEFAULT_CONTEXTS = "1K,2K,4K,8K,16K,32K,64K,128K"
GpusOpt = Annotated[str, typer.Option("--gpus", help="One GPU id, or two: G1,G2.")]
ContextsOpt = Annotated[str, typer.Option("--contexts", help="Comma-separated context lengths.")]
AnalyzeTpOpt = Annotated[
    int | None,
    typer.Option("--tp", help="TP degree of the analysed unit (default: smallest that fits)."),
]
AnalyzePlotOpt = Annotated[
    Path | None, typer.Option("--plot", help="Write a PNG of cost and gain against context.")
]

# -- deploy -----------------------------------------------------------------------------------
PlanArg = Annotated[Path, typer.Argument(metavar="PLAN", help="A plan file (opweave plan -o).")]
DeployOutputOpt = Annotated[
    Path, typer.Option("-o", "--output", help="Directory to write the deployment files to.")
]
NameOpt = Annotated[
    str | None, typer.Option("--name", help="Kubernetes name prefix (default: opweave-MODEL).")
]
ImageOpt = Annotated[
    str,
    typer.Option(
        "--image",
        help="Container image with opweave installed, for Kubernetes (required: no "
        "public image exists).",
    ),
]
ModelPvcOpt = Annotated[
    str | None,
    typer.Option(
        "--model-pvc",
        help="PersistentVolumeClaim holding the model folder (default: NAME-model).",
    ),
]
NodeSelectorKeyOpt = Annotated[
    str,
    typer.Option(
        "--node-selector-key",
        help="Node label whose value is the GPU id (kubectl label node N KEY=h100-sxm).",
    ),
]
NamespaceOpt = Annotated[
    str | None, typer.Option("--namespace", help="Kubernetes namespace of the resources.")
]
DeviceProfilesOpt = Annotated[
    list[Path] | None,
    typer.Option("--profile", help="Profile of a device the plan uses (its node size)."),
]

# -- run and serve: one declaration each, both commands take them ---------------------------------
PREFILL_HELP = (
    "With --strategy: a prefill pool of P colocated replicas at --tp that prefill every prompt "
    "and send its KV cache to the decode ranks (P/D); 0: each replica prefills its own."
)
ModelPathOpt = Annotated[
    Path, typer.Option("--model-path", help="Hugging Face model folder (config + weights).")
]
StrategyOpt = Annotated[
    str | None,
    typer.Option(
        "--strategy", help="Without a PLAN: colocated (the default), afd or cad (canonical)."
    ),
]
RunTpOpt = Annotated[
    int, typer.Option("--tp", min=1, help="With --strategy: tensor parallelism per owner.")
]
ReplicasOpt = Annotated[
    int,
    typer.Option("--replicas", min=1, max=MAX_COUNT, help="With --strategy: replicas per owner."),
]
RunEpOpt = Annotated[
    int,
    typer.Option(
        "--ep",
        min=1,
        max=MAX_COUNT,
        help="With --strategy: expert parallelism of the MoE owner over EP GPUs per "
        "replica, which are EP / TP data-parallel attention replicas of --tp GPUs each, "
        "each with its share of the batch.",
    ),
]
PrefillReplicasOpt = Annotated[
    int, typer.Option("--prefill-replicas", min=0, max=MAX_COUNT, help=PREFILL_HELP)
]
RunBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--batch", min=1, max=MAX_BATCH, help="With --strategy: resident batch per replica."
    ),
]
MicrobatchesOpt = Annotated[
    int | None,
    typer.Option(
        "--microbatches",
        min=1,
        max=MAX_MICROBATCHES,
        help="With --strategy: microbatches (default: owners).",
    ),
]
RanksOpt = Annotated[
    int | None,
    typer.Option(
        "--ranks",
        min=1,
        max=MAX_COUNT,
        help="Check: processes the plan needs (every owner's replicas x tp x dp, and the prefill "
        "pool's GPUs).",
    ),
]
PromptOpt = Annotated[
    list[str] | None,
    typer.Option("--prompt", help="Generate for this prompt and exit (repeatable)."),
]
PromptsFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts-file",
        help='Generate for a JSONL file: {"prompt": ...} or {"prompt_token_ids": [...]}, '
        'optional "max_tokens".',
    ),
]
MaxTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-tokens",
        min=1,
        max=MAX_TOKENS,
        help='Tokens per request (offline; a prompts-file line\'s own "max_tokens" wins).',
    ),
]
ListenHostOpt = Annotated[str, typer.Option("--host", help="Serving: address to listen on.")]
PortOpt = Annotated[int, typer.Option("--port", min=1, max=65535, help="Serving: port.")]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        help=f"Serving: require 'Authorization: Bearer KEY' (visible in ps: prefer "
        f"${API_KEY_ENV} or --api-key-file).",
    ),
]
ApiKeyFileOpt = Annotated[
    Path | None,
    typer.Option("--api-key-file", help="Serving: read the API key from this file."),
]
ChatTemplateOpt = Annotated[
    str | None,
    typer.Option("--chat-template", help="Serving: Jinja chat template (text or file)."),
]
RunDeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout-s",
        min=0.1,
        max=86400,
        callback=finite,
        help="Fail when a rank waits this long.",
    ),
]
KernelsOpt = Annotated[
    str, typer.Option("--kernels", help="opweave, or vLLM's kernels: vllm, vllm-all.")
]
DecodeStepOpt = Annotated[
    str,
    typer.Option(
        "--decode-step",
        help="per-request, static (fixed shapes, all requests at once), compiled "
        "(static, compiled by inductor: on CPU one program per rank and decode iteration, "
        "on CUDA one per segment) or traced.",
    ),
]
WaitOpt = Annotated[
    str,
    typer.Option(
        "--wait",
        help="How CPU ranks wait for peers: auto (busy-poll on a core of their own, "
        "block where ranks share cores), spin or block.",
    ),
]
NnodesOpt = Annotated[
    int, typer.Option("--nnodes", min=1, max=MAX_COUNT, help="Nodes the plan spans.")
]
NodeRankOpt = Annotated[
    int, typer.Option("--node-rank", min=0, max=MAX_COUNT, help="This node's index.")
]
NodesFileOpt = Annotated[
    Path | None,
    typer.Option("--nodes", help="Ranks per node (nodes.json of opweave deploy)."),
]
MasterAddrOpt = Annotated[
    str, typer.Option("--master-addr", help="Address of node 0 (rendezvous).")
]
MasterPortOpt = Annotated[
    int | None,
    typer.Option("--master-port", min=1, max=65535, help="Rendezvous port on node 0."),
]
LogDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--log-dir",
        help="Write the ranks' logs (rank<N>.log) to this folder and keep them; a failure's "
        "message names it.",
    ),
]
MaxNOpt = Annotated[
    int | None,
    typer.Option(
        "--max-n",
        min=1,
        max=MAX_BATCH,
        help="Serving: most completions one request may ask for (n; default: the plan's "
        "global batch); more gets HTTP 400.",
    ),
]
MaxRequestTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-request-tokens",
        min=1,
        max=MAX_TOKENS,
        help="Serving: most new tokens one request may ask for per completion (max_tokens; "
        "default: what --max-model-len leaves); more gets HTTP 400.",
    ),
]
# A test seam, hidden from --help: RANK:ITERATION:exit|kill|hang makes that rank fail on purpose
# (opweave.runtime.RunOptions.fault), so tests can check how a run fails through the CLI.
FaultOpt = Annotated[str | None, typer.Option("--fault", hidden=True)]

# -- profile ----------------------------------------------------------------------------------
ProfileModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Built-in model name, config.json, or model folder (its weights are used when "
        "present; otherwise random weights of the right shapes).",
    ),
]
ProfileOutputOpt = Annotated[
    Path, typer.Option("-o", "--output", help="Write the profile (Profile schema JSON) here.")
]
ProfileDeviceOpt = Annotated[
    str,
    typer.Option(
        "--device", help="cpu, cuda or cuda:N; with --from aiconfigurator a GPU id (h100)."
    ),
]
SourceOpt = Annotated[
    str | None,
    typer.Option(
        "--from",
        help="aiconfigurator: import the operator latencies from NVIDIA's silicon database "
        "(aiconfigurator-core, the profiler's aiconfigurator extra) instead of measuring.",
    ),
]
ImportEngineOpt = Annotated[
    str, typer.Option("--engine", help="--from aiconfigurator: vllm, sglang or trtllm.")
]
EngineVersionOpt = Annotated[
    str | None,
    typer.Option(
        "--engine-version",
        help="--from aiconfigurator: the engine version measured (default: the newest "
        "the database has per kernel table).",
    ),
]
DatabaseOpt = Annotated[
    Path | None,
    typer.Option(
        "--database",
        help="--from aiconfigurator: a database folder in aiconfigurator-core's layout "
        "(default: the installed package's).",
    ),
]
ProfileTpOpt = Annotated[
    str | None,
    typer.Option(
        "--tp",
        help="TP degrees, e.g. 1 (default: 1 when measuring; every degree of a node that "
        "the model shards over when importing).",
    ),
]
BatchesOpt = Annotated[
    str | None,
    typer.Option("--batches", help="Batch sizes, e.g. 1,4,16 (default: log-spaced grid)."),
]
GridContextsOpt = Annotated[
    str | None,
    typer.Option("--contexts", help="Context lengths, e.g. 1K,8K (default: log-spaced)."),
]
DtypeOpt = Annotated[
    str | None, typer.Option("--dtype", help="Compute dtype (default: the config's).")
]
OpsOpt = Annotated[
    str | None,
    typer.Option("--ops", help="Only these operators, e.g. core_attn@full,lm_head."),
]
WarmupOpt = Annotated[
    int, typer.Option("--warmup", min=0, max=MAX_COUNT, help="Untimed calls per cell.")
]
RepeatsOpt = Annotated[
    int, typer.Option("--repeats", min=1, max=MAX_COUNT, help="Minimum timed calls per cell.")
]
PassesOpt = Annotated[
    int | None,
    typer.Option(
        "--passes",
        min=1,
        max=MAX_COUNT,
        help="Grid passes; a cell is the median of its passes' medians "
        "(default: 2 on CPU, 1 on CUDA).",
    ),
]
TimingOpt = Annotated[
    str | None,
    typer.Option(
        "--timing",
        help="chain: time each operator inside the block's operator chain in decode order "
        "(default on CPU); isolated: one operator back to back (default on CUDA).",
    ),
]
WorkingSetOpt = Annotated[
    float | None,
    typer.Option(
        "--working-set-mib",
        min=0.0,
        max=float(1 << 30),
        callback=finite,
        help="chain timing: add layers until their weights reach this many MiB, so no "
        "operator finds its weights cached (default: twice the largest cache).",
    ),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads",
        min=1,
        max=4096,
        help="torch threads while timing (default: 1 on CPU, as each CPU rank runs).",
    ),
]
UsdPerHourOpt = Annotated[
    float | None,
    typer.Option(
        "--usd-per-hour",
        callback=positive_price,
        help="Device price (default: catalog, or an assumed $0.0425 per vCPU-hour on CPU).",
    ),
]
RandomWeightsOpt = Annotated[
    bool, typer.Option("--random-weights", help="Ignore weights in the model folder.")
]
ProfileKernelsOpt = Annotated[
    str,
    typer.Option(
        "--kernels",
        help="The kernels to time, as opweave run --kernels: opweave (the runtime's), or "
        "vLLM's CPU kernels where they apply: vllm (exact ones), vllm-all.",
    ),
]
ProfileDecodeStepOpt = Annotated[
    str,
    typer.Option(
        "--decode-step",
        help="How the timed operators run decode steps, as opweave run --decode-step: "
        "per-request, or each operator as the static step a rank runs: static, compiled, "
        "traced (decode-order timing only).",
    ),
]
NoTransferOpt = Annotated[
    bool, typer.Option("--no-transfer", help="Skip the two-process transfer measurement.")
]
NoOrchestrationOpt = Annotated[
    bool,
    typer.Option(
        "--no-orchestration",
        help="CPU: skip measuring the serving loop's host time (two short colocated runs).",
    ),
]
NoIdleOpt = Annotated[
    bool,
    typer.Option(
        "--no-idle",
        help="CPU: skip timing reads of a buffer after idle gaps (a few s).",
    ),
]
SeedOpt = Annotated[
    int,
    typer.Option("--seed", min=0, max=2**32 - 1, help="Seed of random weights and inputs."),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")]


# -- plan ------------------------------------------------------------------------------------
FleetOpt = Annotated[
    str,
    typer.Option(
        "--gpus",
        help="GPU types of the cluster: G1 or G1,G2; G:N bounds a type to N GPUs "
        "(h100:16,a100:8), without a count it is unbounded.",
    ),
]
TpotSlosOpt = Annotated[
    str,
    typer.Option(
        "--tpot-slo-ms",
        help="Time-per-output-token SLO in ms; several (20,30,50,100) sweep them and print "
        "the cost vs TPOT frontier.",
    ),
]
DecodeContextOpt = Annotated[
    str | None,
    typer.Option("--context", help="Decode only: every request at this context, e.g. 32K."),
]
TtftSloOpt = Annotated[
    float | None,
    typer.Option(
        "--ttft-slo-ms",
        callback=finite,
        help="Serving: time-to-first-token SLO in ms (default: none).",
    ),
]
SloStatisticOpt = Annotated[
    str,
    typer.Option(
        "--slo-statistic",
        help="Serving: what the SLOs bound of the simulated requests: mean, p90 or p99.",
    ),
]
PlanProfileOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--profile",
        help="Measured profile file: its device's latencies (and, in plan, its device becomes "
        "usable in --gpus).",
    ),
]
PlanOutputOpt = Annotated[
    Path | None,
    typer.Option(
        "-o",
        "--output",
        help="Write the best plan (Plan schema) to this file; with several SLOs, one file "
        "per SLO (plan-50ms.json, ...).",
    ),
]
FrontierPlotOpt = Annotated[
    Path | None,
    typer.Option("--plot", help="Draw the cost vs TPOT frontier of the SLOs to this PNG."),
]
PlanBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--batch",
        min=1,
        max=MAX_BATCH,
        help="Resident batch of every owner replica (requests); with one --microbatches "
        "count M every owner holds B requests in M microbatches of B/M, one replica each.",
    ),
]
MicrobatchCountsOpt = Annotated[
    str | None,
    typer.Option("--microbatches", help="Microbatch counts to search, e.g. 2 or 1,2,4."),
]
MaxOwnersOpt = Annotated[
    int,
    typer.Option("--max-owners", help="Most owners (device groups) a plan may map to: 1-3."),
]
NoFrontierPruningOpt = Annotated[bool, typer.Option("--no-frontier-pruning")]
NoBranchAndBoundOpt = Annotated[bool, typer.Option("--no-branch-and-bound")]
