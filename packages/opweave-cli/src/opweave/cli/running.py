"""``opweave run``: install a plan (or a canonical baseline) on local processes and generate.

Torch is imported inside the command only: ``opweave --help`` and the other commands must stay
fast and must work without the runtime's heavy dependencies loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from ._common import JsonOpt, emit_json, human_bytes, table

STRATEGIES = ("colocated", "afd", "cad")


def register(app: typer.Typer) -> None:
    app.command("run")(run)


def run(
    plan_file: Annotated[
        Path | None,
        typer.Argument(metavar="PLAN", help="A plan file (opweave plan -o); or use --strategy."),
    ] = None,
    model_path: Annotated[
        Path, typer.Option("--model-path", help="Hugging Face model folder (config + weights).")
    ] = ...,  # type: ignore[assignment]
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Tokens to generate per request.")
    ] = ...,  # type: ignore[assignment]
    strategy: Annotated[
        str | None,
        typer.Option("--strategy", help="Without a plan: colocated, afd or cad (canonical)."),
    ] = None,
    ranks: Annotated[
        int | None,
        typer.Option("--ranks", min=1, help="Processes (GPUs); a plan needs sum(replicas x tp)."),
    ] = None,
    prompt: Annotated[
        list[str] | None,
        typer.Option(
            "--prompt", help="A prompt (repeatable); tokenised with the model's tokenizer."
        ),
    ] = None,
    prompts_file: Annotated[
        Path | None,
        typer.Option(
            "--prompts-file",
            help='JSONL: {"prompt": ...} or {"prompt_token_ids": [...]}, optional "max_tokens".',
        ),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option("--batch", min=1, help="With --strategy: resident batch (default: requests)."),
    ] = None,
    microbatches: Annotated[
        int | None,
        typer.Option(
            "--microbatches", min=1, help="With --strategy: microbatches (default: owners)."
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    timeout_s: Annotated[
        float, typer.Option("--timeout-s", min=0.1, help="Fail if a rank waits this long.")
    ] = 60.0,
    tp_mode: Annotated[
        str, typer.Option("--tp-mode", help="auto (shard operators) or replicated.")
    ] = "auto",
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Nodes the plan spans.")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="This node's index.")] = 0,
    master_addr: Annotated[
        str, typer.Option("--master-addr", help="Address of node 0 (rendezvous).")
    ] = "127.0.0.1",
    master_port: Annotated[
        int | None, typer.Option("--master-port", help="Rendezvous port on node 0.")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Generate with a plan on one process per rank (gloo on CPU, NCCL on CUDA); report the
    outputs, measured TPOT, and per rank its stages, weight bytes read and busy time."""
    if (plan_file is None) == (strategy is None):
        raise typer.BadParameter("give either a PLAN file or --strategy colocated|afd|cad")
    if strategy is not None and strategy not in STRATEGIES:
        raise typer.BadParameter(f"--strategy must be one of {', '.join(STRATEGIES)}")
    if (prompt is None) == (prompts_file is None):
        raise typer.BadParameter("give --prompt TEXT (repeatable) or --prompts-file FILE.jsonl")
    if tp_mode not in ("auto", "replicated"):
        raise typer.BadParameter("--tp-mode must be auto or replicated")
    if plan_file is not None and (batch is not None or microbatches is not None):
        raise typer.BadParameter("--batch and --microbatches apply to --strategy only")

    from opweave.costmodel import ConfigError, load_model
    from opweave.runtime import Request, run_from_env, run_plan
    from opweave.runtime._private.launch import resolve_backend, torchrun_env

    if not (model_path / "config.json").is_file():
        raise ConfigError(f"--model-path {model_path} is not a model folder (no config.json)")
    spec = load_model(model_path)
    tokenizer = _tokenizer(model_path)
    entries = _read_prompts(prompt, prompts_file, tokenizer)
    requests = [
        Request(tuple(ids), limit or max_tokens, request_id=f"req-{i}")
        for i, (ids, limit) in enumerate(entries)
    ]
    device, _ = resolve_backend(device)
    if plan_file is not None:
        from .planning import load_plan_file

        plan = load_plan_file(plan_file)
    else:
        plan = _canonical(spec, strategy, ranks, batch, microbatches, len(requests), device)
    env = torchrun_env()
    if env is not None:
        result = run_from_env(
            plan, model_path, requests, device=device, timeout_s=timeout_s, tp_mode=tp_mode
        )
    else:
        result = run_plan(
            plan,
            model_path,
            requests,
            ranks=ranks,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            device=device,
            timeout_s=timeout_s,
            tp_mode=tp_mode,
        )
    if result is None:  # a node (or torchrun rank) that does not talk to the caller
        if json_out and env is None:
            emit_json({"node_rank": node_rank, "outputs": None})
        return
    for out in result["outputs"]:
        out["text"] = None if tokenizer is None else tokenizer.decode(out["token_ids"])
    doc = {
        "model": spec.name,
        "strategy": plan.strategy,
        "plan": {
            "template_cuts": list(plan.template.cuts),
            "owners": [o.model_dump() for o in plan.owners],
            "microbatches": plan.microbatches,
        },
        **result,
    }
    if json_out:
        emit_json(doc)
        return
    _print_human(doc)


def _canonical(
    spec: Any,
    strategy: Any,
    ranks: int | None,
    batch: int | None,
    microbatches: int | None,
    num_requests: int,
    device: str,
) -> Any:
    """The canonical template of ``strategy`` over ``ranks`` local ranks (TP = ranks / owners)."""
    from opweave.costmodel import TP_DEGREES, canonical_plan

    owners = 1 if strategy == "colocated" else 2
    ranks = owners if ranks is None else ranks
    tp = ranks // owners
    if ranks % owners or tp not in TP_DEGREES:
        choices = ", ".join(str(owners * t) for t in TP_DEGREES)
        raise typer.BadParameter(
            f"--strategy {strategy} has {owners} owner(s): --ranks must be one of {choices}"
        )
    m = microbatches or owners
    b = max(batch or min(num_requests, 64), m)
    return canonical_plan(spec, strategy, gpu=device, batch=b, microbatches=m, tp=tp)


def _tokenizer(model_path: Path) -> Any:
    path = model_path / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _read_prompts(
    prompts: list[str] | None, path: Path | None, tokenizer: Any
) -> list[tuple[list[int], int | None]]:
    """``(prompt ids, max tokens or None)`` per request; bad input is a one-line error."""
    from opweave.costmodel import ConfigError

    def encode(text: str, where: str) -> list[int]:
        if tokenizer is None:
            raise ConfigError(
                f"{where}: the model folder has no tokenizer.json to encode text; "
                'give "prompt_token_ids" in a --prompts-file instead'
            )
        ids = tokenizer.encode(text).ids
        if not ids:
            raise ConfigError(f"{where}: the prompt encodes to no tokens")
        return list(ids)

    if prompts is not None:
        return [(encode(p, f"--prompt {p!r}"), None) for p in prompts]
    assert path is not None
    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist")
    out: list[tuple[list[int], int | None]] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(entry, dict) or ("prompt" in entry) == ("prompt_token_ids" in entry):
            raise ConfigError(f'{where}: expected an object with "prompt" or "prompt_token_ids"')
        limit = entry.get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ConfigError(f'{where}: "max_tokens" must be a positive integer')
        if "prompt" in entry:
            if not isinstance(entry["prompt"], str):
                raise ConfigError(f'{where}: "prompt" must be a string')
            out.append((encode(entry["prompt"], where), limit))
            continue
        ids = entry["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise ConfigError(f'{where}: "prompt_token_ids" must be a non-empty list of integers')
        out.append((ids, limit))
    if not out:
        raise ConfigError(f"prompts file {path} holds no prompts")
    return out


def _print_human(doc: dict[str, Any]) -> None:
    for out in doc["outputs"]:
        text = out["text"] if out["text"] is not None else " ".join(map(str, out["token_ids"]))
        typer.echo(f"[{out['request_id']}] {text}")
    tpot = doc["tpot_s"]
    typer.echo(
        f"\n{doc['strategy']} on {len(doc['ranks'])} rank(s), {doc['iterations']} iterations; "
        + ("TPOT n/a (one token per request)" if tpot is None else f"TPOT {tpot * 1e3:.3f} ms")
    )
    rows = []
    for r in doc["ranks"]:
        loop = r["loop_s"] or 1.0
        stages = ", ".join(r["stages"])
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
