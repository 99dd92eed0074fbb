"""What ``opweave run`` and ``opweave serve`` do once their flags are parsed: check them,
build or read the plan, check it against the model, then generate (``--prompt``), join node 0
(a node other than 0) or serve the OpenAI API.

Torch and vLLM are imported late: the plan is checked against the model before any of them
loads and before any process starts.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import typer

from ._common import emit_json, human_bytes
from ._console import print_table
from ._options import API_KEY_ENV, DECODE_STEPS, KERNELS, STRATEGIES, WAITS
from ._prompts import check_lengths, read_prompts, tokenizer

_SERVE_BATCH = 8  # --strategy's resident batch per replica when serving


@dataclass(frozen=True)
class RunFlags:
    """``opweave run``'s options, as parsed (``serve`` gives no prompts and no --json)."""

    model_path: Path
    strategy: str | None = None
    tp: int = 1
    replicas: int = 1
    ep: int = 1
    prefill_replicas: int = 0
    batch: int | None = None
    microbatches: int | None = None
    ranks: int | None = None
    prompt: list[str] | None = None
    prompts_file: Path | None = None
    max_tokens: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_key_file: Path | None = None
    chat_template: str | None = None
    device: str = "auto"
    timeout_s: float = 60.0
    kernels: str = "opweave"
    decode_step: str = "per-request"
    wait: str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    nodes_file: Path | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    log_dir: Path | None = None
    max_n: int | None = None
    max_request_tokens: int | None = None
    fault: str | None = None
    json_out: bool = False

    @classmethod
    def of(cls, values: dict[str, Any]) -> RunFlags:
        """The flags among a command's ``values`` (its parameters); ``serve``'s leave out the
        prompts and --json, which keep their defaults."""
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    @property
    def offline(self) -> bool:
        """Prompts given: generate and exit (else serve)."""
        return self.prompt is not None or self.prompts_file is not None


def execute(args: list[str], flags: RunFlags) -> None:
    """Run ``flags`` with the words the options left (a PLAN file first, then vLLM's server
    arguments)."""
    from opweave.costmodel import ConfigError, load_model

    plan_file, vllm_args = _split_plan(args)
    flags = _checked(flags, plan_file, vllm_args)
    if not (flags.model_path / "config.json").is_file():
        raise ConfigError(f"--model-path {flags.model_path} is not a model folder (no config.json)")
    model = load_model(flags.model_path)
    plan = _plan(flags, model, plan_file)
    if plan.model.kv_cache_dtype != model.precision.kv_cache_dtype:
        from opweave.runtime import plan_model

        model = plan_model(plan, flags.model_path)  # the plan's FP8 KV cache
    _check(plan, model, flags)
    nodes = None
    if flags.nodes_file is not None:
        from opweave.runtime import layout_from_file

        nodes = layout_from_file(flags.nodes_file)
    if flags.offline:
        _offline(flags, model, plan, nodes)
    elif flags.node_rank > 0:
        _join(flags, model, plan, nodes)
    else:
        from ._serve import serve

        serve(flags, plan, nodes, vllm_args)


def _checked(flags: RunFlags, plan_file: Path | None, vllm_args: list[str]) -> RunFlags:
    """The flags checked against each other, with the strategy, log folder and API key they
    come to; a one-line error for the first problem."""
    from opweave.costmodel import TP_DEGREES

    offline = flags.offline
    strategy = flags.strategy
    if plan_file is not None and strategy is not None:
        raise typer.BadParameter("give either a PLAN file or --strategy colocated|afd|cad")
    if plan_file is None and strategy is None:
        strategy = "colocated"  # the whole model on one owner
    if strategy is not None and strategy not in STRATEGIES:
        raise typer.BadParameter(f"--strategy must be one of {', '.join(STRATEGIES)}")
    strategy_only = (flags.tp, flags.ep, flags.replicas, flags.batch, flags.microbatches)
    if plan_file is not None and any(v not in (None, 1) for v in strategy_only):
        raise typer.BadParameter(
            "--tp, --ep, --replicas, --batch and --microbatches apply to --strategy"
        )
    if plan_file is not None and flags.prefill_replicas:
        raise typer.BadParameter(
            "--prefill-replicas applies to --strategy; a plan file names its own prefill pool"
        )
    if flags.tp not in TP_DEGREES:
        raise typer.BadParameter(f"--tp must be one of {', '.join(map(str, TP_DEGREES))}")
    if flags.ep > 1 and flags.ep % flags.tp:
        raise typer.BadParameter(
            f"--ep {flags.ep} is not a multiple of --tp {flags.tp}: the --ep GPUs of a replica "
            "are data-parallel attention replicas of --tp GPUs each"
        )
    if flags.kernels not in KERNELS:
        raise typer.BadParameter(f"--kernels must be one of {', '.join(KERNELS)}")
    if flags.decode_step not in DECODE_STEPS:
        raise typer.BadParameter(f"--decode-step must be one of {', '.join(DECODE_STEPS)}")
    if flags.wait not in WAITS:
        raise typer.BadParameter(f"--wait must be one of {', '.join(WAITS)}")
    if flags.device not in ("auto", "cpu", "cuda"):
        raise typer.BadParameter("--device must be auto, cpu or cuda")
    if flags.prompt is not None and flags.prompts_file is not None:
        raise typer.BadParameter("give --prompt TEXT (repeatable) or --prompts-file, not both")
    if flags.prompt is not None and flags.max_tokens is None:
        raise typer.BadParameter("offline generation with --prompt needs --max-tokens")
    if not offline and flags.max_tokens is not None:
        raise typer.BadParameter(
            "--max-tokens applies to --prompt/--prompts-file (serving: per request)"
        )
    if offline and vllm_args:
        raise typer.BadParameter(f"unknown option(s) for offline generation: {' '.join(vllm_args)}")
    if offline and (flags.api_key is not None or flags.api_key_file is not None):
        raise typer.BadParameter("--api-key and --api-key-file apply to serving (no prompts)")
    if offline and (flags.max_n is not None or flags.max_request_tokens is not None):
        raise typer.BadParameter("--max-n and --max-request-tokens apply to serving (no prompts)")
    log_dir = None if flags.log_dir is None else _log_dir(flags.log_dir)
    api_key = None if offline else _api_key(flags.api_key, flags.api_key_file)
    if flags.node_rank >= flags.nnodes:
        raise typer.BadParameter(
            f"--node-rank {flags.node_rank} is not below --nnodes {flags.nnodes}"
        )
    return dataclasses.replace(flags, strategy=strategy, log_dir=log_dir, api_key=api_key)


def _split_plan(args: list[str]) -> tuple[Path | None, list[str]]:
    """PLAN is the first argument when it is not an option; the rest goes to vLLM's server."""
    if args and not args[0].startswith("-"):
        return Path(args[0]), args[1:]
    return None, args


def _plan(flags: RunFlags, model: Any, plan_file: Path | None) -> Any:
    """The PLAN file's plan, or the canonical plan of ``--strategy`` on CPU ranks."""
    if plan_file is not None:
        from .planning import load_servable_plan

        return load_servable_plan(plan_file, "run")
    from pydantic import ValidationError

    from opweave.costmodel import PrefillPool, canonical_plan
    from opweave.costmodel.errors import validation_message

    ep = flags.ep
    dp = ep // flags.tp if ep > 1 else 1  # attention replicas of --tp GPUs over the --ep GPUs
    if ep > 1:
        _check_ep(model, ep)
    owners = 1 if flags.strategy == "colocated" else 2
    # every microbatch must reach each data-parallel rank alike: one, under data-parallel attention
    m = flags.microbatches or (1 if dp > 1 else owners)
    if flags.batch is not None and flags.batch < m:
        raise typer.BadParameter(
            f"--batch {flags.batch} is below the {m} microbatches of this plan: each needs a "
            f"slot; give --batch {m} or more, or --microbatches {flags.batch}"
        )
    per_replica = flags.batch or (_offline_batch(flags) if flags.offline else _SERVE_BATCH)
    b = max(per_replica, m)
    if flags.batch is None:
        b = -(-b // dp) * dp  # a share for each data-parallel rank
    try:
        plan = canonical_plan(
            model,
            cast(Any, flags.strategy),  # one of STRATEGIES (checked)
            gpu="cpu",
            batch=b,
            microbatches=m,
            tp=flags.tp,
            ep=ep,
            dp=dp,
            replicas=flags.replicas,
        )
        if flags.prefill_replicas:
            pool = PrefillPool(gpu="cpu", tp=flags.tp, replicas=flags.prefill_replicas)
            plan = plan.model_copy(update={"prefill": pool})
        return plan
    except ValidationError as exc:  # a bound of the Plan schema (replicas x tp, batches)
        raise typer.BadParameter(f"no such plan: {validation_message(exc.errors()[0])}") from None


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


def _offline_batch(flags: RunFlags) -> int:
    if flags.prompt is not None:
        return min(len(flags.prompt), 64)
    return 4


def _check(plan: Any, model: Any, flags: RunFlags) -> None:
    """Refuse a plan for another model (or that cannot shard), or weights that do not match
    the config, before any process starts."""
    from opweave.runtime import check_plan, check_runtime_support, check_weights

    check_runtime_support(model)
    check_plan(plan, model, flags.ranks)
    check_weights(flags.model_path, model)


def _offline(flags: RunFlags, model: Any, plan: Any, nodes: Any) -> None:
    from opweave.runtime import Request, run_plan

    coder = tokenizer(flags.model_path)
    entries = read_prompts(flags.prompt, flags.prompts_file, coder, model.vocab_size)
    budgets = check_lengths(entries, flags.max_tokens, model)
    requests = [
        Request(tuple(ids), budget, request_id=f"req-{i}")
        for i, ((ids, _), budget) in enumerate(zip(entries, budgets, strict=True))
    ]
    if flags.strategy is not None and flags.batch is None:
        plan = _resize(plan, len(requests))
    options, topology = run_options(flags), _topology(flags, nodes)
    result = run_plan(plan, flags.model_path, requests, options, topology=topology)
    if result is None:  # a node (or torchrun rank) that does not talk to the caller
        from opweave.runtime import torchrun_env

        if flags.json_out and torchrun_env() is None:
            emit_json({"node_rank": flags.node_rank, "outputs": None})
        return
    outputs = [
        out.model_copy(
            update={"text": None if coder is None else coder.decode(list(out.token_ids))}
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
    if flags.json_out:
        emit_json(doc)
        return
    _print_human(doc)


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


def _resize(plan: Any, requests: int) -> Any:
    """A --strategy plan for a prompts file: every request gets a slot (up to 64 per replica)."""
    per = max(min(-(-requests // plan.owners[0].replicas), 64), plan.microbatches)
    dp = plan.owners[0].dp
    per = -(-per // dp) * dp  # a share for each data-parallel rank
    owners = [ow.model_copy(update={"resident_batch": per}) for ow in plan.owners]
    return plan.model_copy(update={"owners": tuple(owners)})


def _join(flags: RunFlags, model: Any, plan: Any, nodes: Any) -> None:
    """A node other than 0 while node 0 serves: its ranks join, this waits for them."""
    from opweave.runtime import run_node

    if flags.master_port is None:
        raise typer.BadParameter("nodes other than 0 need --master-port of node 0")
    run_node(plan, model, flags.model_path, run_options(flags), _topology(flags, nodes))


def run_options(flags: RunFlags) -> Any:
    """The run's options (flags checked already), built once here and carried to every rank."""
    from opweave.runtime import DecodeStep, Kernels, RunOptions, Wait

    return RunOptions(
        device=flags.device,
        timeout_s=flags.timeout_s,
        kernels=Kernels(flags.kernels),
        decode_step=DecodeStep(flags.decode_step),
        wait=Wait(flags.wait),
        log_dir=None if flags.log_dir is None else str(flags.log_dir),
        fault=fault_injection(flags.fault),
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


def fault_injection(text: str | None) -> Any:
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


def _topology(flags: RunFlags, nodes: Any) -> Any:
    from opweave.runtime import Topology

    return Topology(
        nnodes=flags.nnodes,
        node_rank=flags.node_rank,
        nodes=nodes,
        master_addr=flags.master_addr,
        master_port=flags.master_port,
    )


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
    print_table(
        rows,
        ["rank", "o/rep/tp", "stages", "weights read", "busy ms", "comm ms", "overhead"],
        text=(1, 2),
    )
    sys.stdout.flush()
