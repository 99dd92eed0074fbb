"""Greedy tokens of the runtime's operators equal transformers' on the same weights, per family."""

from __future__ import annotations

import pytest
import torch

from opweave.runtime import (
    TINY_CONFIGS,
    BatchMeta,
    LocalModel,
    StageModule,
    TokenBatch,
    operator_sequence,
    write_tiny_model,
)
from tests.helpers import hf_causal_lm

FAMILIES = tuple(TINY_CONFIGS)
MAX_NEW_TOKENS = 16


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_tokens_match_transformers(family, tiny_model, hf_greedy, prompts):
    model_dir = tiny_model(family)
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)

    ours = LocalModel(model_dir).generate(prompts, MAX_NEW_TOKENS)

    assert ours == expected
    # The comparison is only meaningful if the model does not emit one token forever.
    assert len({t for out in expected for t in out}) >= 10


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_close_to_transformers(family, tiny_model, prompts):
    """Catches numerical slips that happen not to flip a greedy token (e.g. a misplaced cast)."""
    model_dir = tiny_model(family)
    hf = hf_causal_lm(model_dir, dtype=torch.float32)
    seq = operator_sequence(model_dir)
    stage = StageModule(model_dir, seq[:-1])  # stop before `sample`
    meta = BatchMeta(
        tuple(f"r{i}" for i in range(len(prompts))), tuple(map(len, prompts)), (0,) * len(prompts)
    )
    stage.admit(meta.request_ids)
    ids = torch.tensor([t for p in prompts for t in p])

    logits = stage(TokenBatch(meta, {"token_ids": ids}))["logits"]

    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([list(p)])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_softcapped_attention_path_matches_with_a_loose_cap(tmp_path, hf_greedy, prompts):
    """The explicit-softmax path (used when ``attn_logit_softcapping`` is set) masks and groups
    heads like the fused one: with a cap far above the scores, capping is the identity to float
    precision.

    transformers' Gemma 3 ignores the setting, so only a loose cap can be compared against it.
    """
    model_dir = write_tiny_model("gemma3_text", tmp_path / "softcap", attn_logit_softcapping=1e4)
    model = LocalModel(model_dir)
    assert model.arch.attn_softcap == 1e4
    assert model.generate(prompts, MAX_NEW_TOKENS) == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)


def test_sliding_window_cache_growing_then_wrapping(tmp_path, hf_greedy, prompts):
    """A window (24) above the initial cache capacity: the ring grows to the window, then wraps."""
    model_dir = write_tiny_model("mistral", tmp_path / "window24", sliding_window=24)
    assert LocalModel(model_dir).generate(prompts, MAX_NEW_TOKENS) == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
