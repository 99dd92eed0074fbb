"""What a vLLM request may ask of the plan's ranks (``opweave.runtime.vllm.unapplied``); the
refusals themselves, through vLLM, are in tests/vllm."""

from __future__ import annotations

from types import SimpleNamespace

from opweave.runtime.vllm import unapplied

# vLLM's SamplingParams defaults, for the fields the check reads
NEUTRAL = {
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.9,
    "min_p": 0.05,
    "seed": 3,
    "n": 2,
    "max_tokens": 16,
    "stop": ["\n"],
    "ignore_eos": True,
    "logprobs": None,
    "prompt_logprobs": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "structured_outputs": None,
    "thinking_token_budget": None,
}


def test_what_the_ranks_apply_passes() -> None:
    assert unapplied(SimpleNamespace(**NEUTRAL)) == []
    assert unapplied(SimpleNamespace(logit_bias={}, bad_words=[])) == []


def test_each_setting_the_ranks_would_not_apply_is_named() -> None:
    cases = {
        "logprobs": (0, "logprobs=0"),
        "prompt_logprobs": (1, "prompt_logprobs=1"),
        "presence_penalty": (0.5, "presence_penalty=0.5"),
        "frequency_penalty": (-0.2, "frequency_penalty=-0.2"),
        "repetition_penalty": (1.05, "repetition_penalty=1.05"),
        "min_tokens": (4, "min_tokens=4"),
        "logit_bias": ({7: 2.0}, "logit_bias"),
        "allowed_token_ids": ([1, 2], "allowed_token_ids"),
        "bad_words": (["no"], "bad_words"),
        "structured_outputs": (object(), "structured output"),
        "thinking_token_budget": (0, "thinking_token_budget"),
    }
    for field, (value, named) in cases.items():
        assert unapplied(SimpleNamespace(**{**NEUTRAL, field: value})) == [named], field
    both = SimpleNamespace(**{**NEUTRAL, "logprobs": 1, "repetition_penalty": 1.1})
    assert unapplied(both) == ["logprobs=1", "repetition_penalty=1.1"]
    # a generation config's defaults: only the keys it sets
    assert unapplied(type("Defaults", (), {"temperature": 0.6, "repetition_penalty": 1.05})) == [
        "repetition_penalty=1.05"
    ]
