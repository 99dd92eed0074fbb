"""Config settings a real checkpoint may carry that the family-wide tests' tiny models do not:
each runs token-exact against transformers' greedy ``generate``, or is refused by name.

- YaRN's ``attention_factor`` (transformers scales cos and sin by it as given), on a full
  attention model and on DeepSeek-V3's MLA;
- a MiniMax-M2 config without ``use_routing_bias`` (transformers' own ``MiniMaxM2Config`` has
  no such key and always applies the router's correction bias);
- a ``generation_config.json`` listing more end tokens than ``config.json`` (instruct
  checkpoints): transformers stops at any of them;
- ``partial_rotary_factor`` on a family whose transformers model rotates the whole head, and
  MiniMax-M2's ``use_routing_bias: false``: refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from opweave.costmodel import ConfigError, canonical_plan, load_model
from opweave.runtime import Request, RunOptions, run_plan, write_tiny_model

PROMPTS = ((5, 6, 7, 8, 9, 10, 11, 12), (20, 21, 22))
MAX_NEW_TOKENS = 12


def _tokens(model_dir: Path, prompts=PROMPTS) -> list[list[int]]:
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", batch=4)
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=30.0))
    assert result is not None
    return [list(out.token_ids) for out in result.outputs]


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "attention_factor": 1.5,
}


@pytest.mark.parametrize(
    ("family", "rope"),
    [
        ("llama", YARN),
        (
            "deepseek_v3",
            YARN
            | {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "attention_factor": 1.3,
            },
        ),
    ],
)
def test_yarn_attention_factor_scales_cos_and_sin_as_given(
    family, rope, tmp_path, hf_greedy
) -> None:
    # the legacy key too: transformers folds a family's rope_scaling over rope_parameters
    model_dir = write_tiny_model(family, tmp_path / family, rope_parameters=rope, rope_scaling=rope)
    assert (
        load_model(model_dir).arch.rope["full_attention"].attention_factor
        == (rope["attention_factor"])
    )
    assert _tokens(model_dir) == hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS)


def test_minimax_without_use_routing_bias_applies_the_correction_bias(tmp_path, hf_greedy):
    model_dir = write_tiny_model("minimax_m2", tmp_path / "minimax")
    _edit_config(model_dir, use_routing_bias=None)
    assert load_model(model_dir).arch.moe.score_correction_bias
    assert _tokens(model_dir) == hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS)
    _edit_config(model_dir, use_routing_bias=False)
    with pytest.raises(ConfigError, match="use_routing_bias: false is not supported"):
        load_model(model_dir)


def test_generation_config_end_tokens_stop_a_request(tmp_path, hf_greedy) -> None:
    plain = write_tiny_model("llama", tmp_path / "plain")
    first = hf_greedy(plain, PROMPTS[:1], MAX_NEW_TOKENS)[0]
    stop = first[3]  # a token the model emits fourth, not the config's EOS
    assert stop not in first[:3] and stop != 2
    listed = tmp_path / "listed"
    shutil.copytree(plain, listed)
    generation = json.loads((listed / "generation_config.json").read_text())
    (listed / "generation_config.json").write_text(
        json.dumps(generation | {"eos_token_id": [2, stop]})
    )
    expected = hf_greedy(listed, PROMPTS[:1], MAX_NEW_TOKENS)
    assert expected == [first[:4]]  # transformers stops at the listed token
    assert _tokens(listed, PROMPTS[:1]) == expected


@pytest.mark.parametrize(
    "where",
    [
        {"partial_rotary_factor": 0.5},
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.5,
            }
        },
    ],
)
def test_partial_rotary_factor_is_refused_where_the_family_rotates_whole_heads(
    where, tmp_path
) -> None:
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    config = json.loads((write_tiny_model("llama", tmp_path / "w") / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | where))
    with pytest.raises(ConfigError, match="llama models rotate the whole head"):
        load_model(model_dir)
