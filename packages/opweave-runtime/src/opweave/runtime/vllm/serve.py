# pyright: reportMissingImports=false
# (vLLM is an optional extra: imported lazily, absent from the locked dev environment)
"""vLLM's OpenAI-compatible server (``/v1/completions``, ``/v1/chat/completions``, streaming,
``/v1/models``, ``/health``, ``/metrics``) with the OpWeave executor underneath. vLLM is imported
inside :func:`serve` only."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ._config import (
    APPLIED,
    PLAN_KEY,
    REQUEST_CHECK,
    failure_left,
    quiet_explained_failures,
)

EXECUTOR_NAME = "opweave.runtime.vllm.OpWeaveExecutor"

# Used when the model folder's tokenizer has no chat template of its own (tiny test models):
# one "role: content" line per message, then "assistant:" for the reply.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def has_chat_template(model_dir: str | Path) -> bool:
    folder = Path(model_dir)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (ValueError, UnicodeDecodeError):
        return False


SHUTDOWN_TIMEOUT_S = 10  # on SIGTERM/Ctrl-C: in-flight requests' time to finish, then abort


def is_quantised(model_dir: str | Path) -> bool:
    """Whether a model folder's config.json declares a ``quantization_config``."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # vLLM reports an unreadable config itself
    if not isinstance(config, dict):
        return False
    text = config.get("text_config")
    return "quantization_config" in config or (
        isinstance(text, dict) and "quantization_config" in text
    )


def server_args(
    model_dir: str | Path,
    plan: str | Path | dict[str, Any] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    chat_template: str | None = None,
    vllm_args: Sequence[str] = (),
    additional_config: dict[str, Any] | None = None,
) -> Any:
    """vLLM's parsed server arguments, with the OpWeave executor and the plan (a file or its
    JSON dict) filled in; ``additional_config`` adds the executor's other keys."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", str(model_dir), "--host", host, "--port", str(port)]
    # vLLM's default (0) kills the engine the moment SIGTERM arrives, so a plan's ranks could
    # not stop in order (the other nodes' would see node 0 vanish); a later option overrides it
    argv += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), *vllm_args]
    if api_key:
        argv += ["--api-key", api_key]
    if chat_template is None and not has_chat_template(model_dir):
        chat_template = FALLBACK_CHAT_TEMPLATE
    if chat_template is not None:
        argv += ["--chat-template", chat_template]

    class OneLineParser(FlexibleArgumentParser):
        """vLLM's parser, whose errors are one line (argparse prints its whole usage first)."""

        def error(self, message: str) -> NoReturn:
            from opweave.costmodel import ConfigError

            raise ConfigError(f"vLLM's server options: {' '.join(message.split())}")

    parser = make_arg_parser(OneLineParser(prog="opweave serve"))
    args = parser.parse_args(argv)
    if isinstance(args.max_model_len, int):
        from opweave.costmodel import ConfigError, load_model

        limit = load_model(model_dir).max_context_tokens
        if args.max_model_len > limit:
            raise ConfigError(
                f"--max-model-len {args.max_model_len} is beyond the model's context of "
                f"{limit} tokens (max_position_embeddings); give at most {limit}"
            )
    if args.logits_processors:
        from opweave.costmodel import ConfigError

        raise ConfigError(
            f"--logits-processors {' '.join(map(str, args.logits_processors))}: OpWeave's ranks "
            f"run no custom logits processors (they sample with {APPLIED}); leave the option out"
        )
    if is_quantised(model_dir):
        # The plan's ranks read and dequantise the weights (opweave.runtime's weight kernels);
        # vLLM's engine only tokenises and schedules here, so its own checks of the format
        # (vLLM's fp8 method refuses float32, the CPU runtime's exact dtype) do not apply.
        overrides = args.hf_overrides if isinstance(args.hf_overrides, dict) else {}
        args.hf_overrides = {**overrides, "quantization_config": None}
    # vLLM's front end refuses, with HTTP 400, requests for what the ranks do not compute
    args.logits_processors = [REQUEST_CHECK]
    # Set after parsing: vLLM's parser lists only its built-in executors as choices.
    args.distributed_executor_backend = EXECUTOR_NAME
    extra = {**(args.additional_config or {}), **(additional_config or {})}
    if isinstance(plan, dict):
        extra[PLAN_KEY] = plan
    elif plan is not None:
        extra[PLAN_KEY] = str(Path(plan).resolve())
    args.additional_config = extra
    validate_parsed_serve_args(args)
    return args


@dataclass(frozen=True)
class Stopped:
    """How :func:`serve` ended: the signal that stopped it (``None``: it stopped on its own,
    its engine having failed), how many requests the drain deadline cut, and the reason the
    server stopped itself, if it did."""

    signal: int | None
    cut: int = 0
    failure: str | None = None  # why the server stopped itself (its port was taken)


def serve(
    model_dir: str | Path,
    plan: str | Path | None = None,
    *,
    max_n: int | None = None,
    max_request_tokens: int | None = None,
    **kwargs: Any,
) -> Stopped:
    """Run the server until a signal stops it, or its engine fails (blocks); ``kwargs`` as
    :func:`server_args`. A request for more than ``max_n`` completions or ``max_request_tokens``
    new tokens each gets HTTP 400.

    Every route but ``/health`` needs the API key when one is given (vLLM's own check covers
    only some). A first SIGINT or SIGTERM drains (:class:`~._guard.Drain`): 503 for new
    requests and ``/health``, in-flight requests get until ``--shutdown-timeout`` and are then
    cut (an error event and ``[DONE]``), then vLLM's engine and the plan's ranks stop; a second
    signal exits the process at once (status 128 + the signal). Until the server is ready, a
    signal goes to the caller's handler (the CLI's unwinds the start-up).
    """
    import uvloop
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.system_utils import decorate_logs
    from vllm.v1.engine import utils as engine_utils

    from ._guard import Drain, Guard
    from ._loop import NotingLoop

    cli_env_setup()
    args = server_args(model_dir, plan, **kwargs)
    from ._request_check import RequestCheck

    # vLLM's front end, in this process, runs the check on every request
    RequestCheck.max_n, RequestCheck.max_tokens = max_n, max_request_tokens
    stopped_by: list[int] = []
    drain = Drain(float(args.shutdown_timeout), stopped_by)
    front_end, quiet = logging.getLogger("vllm.v1.engine.async_llm"), _QuietEngineStop(stopped_by)
    front_end.addFilter(quiet)
    build_app = entry.build_app

    started, failures = asyncio.Event(), []

    def guarded_app(*given: Any, **named: Any) -> Any:
        app = build_app(*given, **named)
        quiet_explained_failures()  # vLLM's logging is configured by now (the engine is up)
        guard = {"key": args.api_key, "drain": drain, "started": started}
        if app.middleware_stack is None:
            app.add_middleware(Guard, **guard)
        else:  # vLLM built its stack already: the guard goes in front of it
            app.middleware_stack = Guard(app.middleware_stack, **guard)
        return app

    def loop() -> NotingLoop:
        made = NotingLoop()
        made.drain = drain
        return made

    async def run() -> None:
        # entry.run_server's steps, less its SIGTERM handler for the start-up: that raises
        # KeyboardInterrupt, which vLLM's engine handshake catches and drops, so a server
        # stopped there waited for an engine that never came. The caller's handlers stay.
        decorate_logs("APIServer", skip_if_decorated=True)
        address, sock = entry.setup_server(args, reuse_port=False)
        where = f"{args.host or '0.0.0.0'}:{args.port}"
        check = asyncio.get_running_loop().create_task(
            _stop_unless_listening(sock.dup(), started, failures, where)
        )
        try:
            # connections still open once the drain has ended every response: closed after
            await entry.run_server_worker(address, sock, args, timeout_graceful_shutdown=_CLOSE_S)
        finally:
            check.cancel()

    engines = engine_utils.CoreEngineProcManager
    entry.build_app = guarded_app
    engine_utils.CoreEngineProcManager = _engine_processes(engines)
    try:
        uvloop.run(run(), loop_factory=loop)
    finally:
        entry.build_app, engine_utils.CoreEngineProcManager = build_app, engines
        front_end.removeFilter(quiet)
    return Stopped(
        stopped_by[0] if stopped_by else None, drain.cut, failures[0] if failures else None
    )


_CLOSE_S = 2  # seconds uvicorn waits for connections to close once every response has ended


async def _stop_unless_listening(
    sock: socket.socket, started: asyncio.Event, failures: list[str], where: str
) -> None:
    """Once the application has started, check that the server's socket listens, and stop
    the server (as SIGTERM does, noting why in ``failures``) if it does not.

    The socket is bound before vLLM's engine starts and listens once the engine is ready.
    Two servers started on one port at the same moment both bind it (SO_REUSEADDR, so a
    stopped server's port in TIME_WAIT stays usable), and the second one's listen fails
    without a word: it ran on, serving nothing.
    """
    with sock:  # a duplicate: the server's own is closed when its listen fails
        await started.wait()
        await asyncio.sleep(_LISTEN_CHECK_S)  # the server listens right after the start
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return
    failures.append(
        f"{where} is in use by another process (a server started at the same time?); stop "
        "it or choose another --port"
    )
    os.kill(os.getpid(), signal.SIGTERM)


_LISTEN_CHECK_S = 0.5


def _engine_processes(manager: type) -> type:
    """vLLM's engine process manager (``CoreEngineProcManager``), starting the engine's
    process with SIGINT ignored and with :func:`_run_engine_core` as its body.

    Ctrl-C reaches every process of the terminal's group. An engine process still importing
    vLLM (seconds) printed a KeyboardInterrupt traceback for it, under the server's one line.
    Started with SIGINT ignored, it takes Ctrl-C once vLLM's engine installs its own handler;
    before that the server, which Ctrl-C stops, ends it. A Ctrl-C in the milliseconds the
    process takes to start is lost (press it again).
    """
    from vllm.v1.engine.core import EngineCoreProc

    class QuietStart(manager):
        def __init__(self, *given: Any, **named: Any) -> None:
            global _ENGINE_CORE
            if EngineCoreProc.run_engine_core is not _run_engine_core:
                _ENGINE_CORE = EngineCoreProc.run_engine_core  # the body a forked one calls
            EngineCoreProc.run_engine_core = staticmethod(_run_engine_core)
            ignoring = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignoring else None
            try:
                super().__init__(*given, **named)
            finally:
                EngineCoreProc.run_engine_core = staticmethod(_ENGINE_CORE)
                if ignoring:
                    signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)

    return QuietStart


_ENGINE_CORE: Any = None  # vLLM's engine body, while a forked engine process may need it


def _run_engine_core(*given: Any, **named: Any) -> None:
    """vLLM's engine process body, quiet about a failure the ranks explained.

    The ranks' failures (a rank that died, a plan vLLM's engine cannot serve) are left in one
    line for ``opweave serve`` to print last (:func:`._config.leave_failure`). vLLM logged
    them first as a fatal error, with the step's whole input, its traceback, and the same
    traceback again from ``multiprocessing`` as the process ended: about 100 lines above the
    one that says what happened. The executor drops those records
    (:func:`._config.quiet_explained_failures`); here the process exits with status 1 as it
    did, without the traceback.
    """
    import sys

    from vllm.v1.engine.core import EngineCoreProc

    from opweave.costmodel import OpWeaveError

    body = _ENGINE_CORE or EngineCoreProc.run_engine_core  # spawned: vLLM's, unpatched
    try:
        body(*given, **named)
    except OpWeaveError:
        if not failure_left():
            raise
        sys.exit(1)


class _QuietEngineStop(logging.Filter):
    """Drops the traceback vLLM's front end logs when a signal, not a fault, stopped the engine.

    On SIGTERM/SIGINT vLLM's server stops its engine client from a worker thread: the client
    marks the engine dead and cancels its output task, and only afterwards is the front end's
    output handler cancelled. When the event loop runs in between (a busy host), the handler
    reads the "engine dead" error meant for nobody and logs it as ``AsyncLLM output_handler
    failed`` with a traceback, after a clean stop. Only that record, and only once a stopping
    signal arrived, is dropped; an engine that really fails logs its own cause first, and any
    failure before a signal is logged as is.
    """

    def __init__(self, stopped_by: list[int]) -> None:
        super().__init__()
        self.stopped_by = stopped_by

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.stopped_by or not record.exc_info:
            return True
        dead = type(record.exc_info[1]).__name__ == "EngineDeadError"
        return not (dead and "output_handler" in record.getMessage())
