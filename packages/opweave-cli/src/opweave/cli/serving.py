"""``opweave serve``: vLLM's OpenAI-compatible server with OpWeave executing the model.

Registered only when vLLM is installed; vLLM and torch are imported inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command(
        "serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
    )(serve)


def serve(
    ctx: typer.Context,
    plan_file: Annotated[
        Path | None,
        typer.Argument(metavar="PLAN", help="A plan file (opweave plan -o); none: colocated."),
    ] = None,
    model_path: Annotated[
        Path, typer.Option("--model-path", help="Hugging Face model folder (config + weights).")
    ] = ...,  # type: ignore[assignment]
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port.")] = 8000,
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="Require 'Authorization: Bearer KEY'.")
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template",
            help="Jinja chat template (text or file); default: the model's, else role: content.",
        ),
    ] = None,
) -> None:
    """Serve /v1/completions and /v1/chat/completions (streaming too) through vLLM's
    OpenAI-compatible server, with each engine step run by OpWeave's stages under PLAN.
    Arguments after the options are passed to vLLM's server (e.g. --max-model-len 512)."""
    from opweave.costmodel import ConfigError, load_model

    if not (model_path / "config.json").is_file():
        raise ConfigError(f"--model-path {model_path} is not a model folder (no config.json)")
    if plan_file is not None:  # refuse a wrong plan before vLLM starts (which takes a while)
        from opweave.runtime._private.placement import check_plan

        from .planning import load_plan_file

        check_plan(load_plan_file(plan_file), load_model(model_path))

    from opweave.runtime.vllm.serve import serve as run_server

    run_server(
        model_path,
        plan_file,
        host=host,
        port=port,
        api_key=api_key,
        chat_template=chat_template,
        vllm_args=list(ctx.args),
    )
