"""``opweave run`` (and its alias ``opweave serve``): install a plan on rank processes and serve.

With no prompts it serves the OpenAI API through vLLM's server (vLLM's engine on top, the plan's
ranks underneath) until SIGINT/SIGTERM; with ``--prompt``/``--prompts-file`` it generates and
exits. Arguments it does not know are handed to vLLM's server (``--max-model-len 512``, ...).
Both commands take the same option declarations (:mod:`._options`); what they do is
:func:`._run.execute`.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer

from ._options import (
    ApiKeyFileOpt,
    ApiKeyOpt,
    ChatTemplateOpt,
    DecodeStepOpt,
    FaultOpt,
    JsonOpt,
    KernelsOpt,
    ListenHostOpt,
    LogDirOpt,
    MasterAddrOpt,
    MasterPortOpt,
    MaxNOpt,
    MaxRequestTokensOpt,
    MaxTokensOpt,
    MicrobatchesOpt,
    ModelPathOpt,
    NnodesOpt,
    NodeRankOpt,
    NodesFileOpt,
    PortOpt,
    PrefillReplicasOpt,
    PromptOpt,
    PromptsFileOpt,
    RanksOpt,
    ReplicasOpt,
    RunBatchOpt,
    RunDeviceOpt,
    RunEpOpt,
    RunTpOpt,
    StrategyOpt,
    TimeoutOpt,
    WaitOpt,
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
    model_path: ModelPathOpt = ...,  # type: ignore[assignment]
    strategy: StrategyOpt = None,
    tp: RunTpOpt = 1,
    replicas: ReplicasOpt = 1,
    ep: RunEpOpt = 1,
    prefill_replicas: PrefillReplicasOpt = 0,
    batch: RunBatchOpt = None,
    microbatches: MicrobatchesOpt = None,
    ranks: RanksOpt = None,
    prompt: PromptOpt = None,
    prompts_file: PromptsFileOpt = None,
    max_tokens: MaxTokensOpt = None,
    host: ListenHostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ApiKeyOpt = None,
    api_key_file: ApiKeyFileOpt = None,
    chat_template: ChatTemplateOpt = None,
    device: RunDeviceOpt = "auto",
    timeout_s: TimeoutOpt = 60.0,
    kernels: KernelsOpt = "opweave",
    decode_step: DecodeStepOpt = "per-request",
    wait: WaitOpt = "auto",
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    nodes_file: NodesFileOpt = None,
    master_addr: MasterAddrOpt = "127.0.0.1",
    master_port: MasterPortOpt = None,
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
    flags = dict(locals())  # the options, as typer converted them
    from ._run import RunFlags, execute

    execute(list(ctx.args), RunFlags.of(flags))


# `serve` is `run` without the options that make it generate and exit.
OFFLINE_ONLY = ("prompt", "prompts_file", "max_tokens", "json_out")


def serve(ctx: typer.Context, **options: Any) -> None:
    """Serve the OpenAI API with a plan (alias of `opweave run` without prompts)."""
    from ._run import RunFlags, execute

    execute(list(ctx.args), RunFlags.of(options))


# typer reads the options from the signature: run's, less the offline ones
_run_signature = inspect.signature(run, eval_str=True)
serve.__signature__ = _run_signature.replace(  # type: ignore[attr-defined]
    parameters=[p for n, p in _run_signature.parameters.items() if n not in OFFLINE_ONLY]
)
