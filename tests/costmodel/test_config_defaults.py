"""Sizes a config leaves out take its family's transformers defaults, as transformers and vLLM
load it, and the figures say so: a config cut short is costed, never silently."""

from __future__ import annotations

import json

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from opweave.costmodel import load_model, model_spec_from_config
from opweave.costmodel._private.config_fields import _SIZE, field_names
from opweave.costmodel._private.registry import FAMILIES
from tests.helpers import TINY_LLAMA, run_cli


def _transformers_text_config(model_type: str) -> dict:
    """transformers' own defaults for the family (a multimodal family's text config)."""
    cls = CONFIG_MAPPING[model_type]
    text = getattr(cls, "sub_configs", {}).get("text_config")
    return (text or cls)().to_dict()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_size_default_is_transformers_own(model_type: str) -> None:
    """The defaults a note names are transformers': each size a family's schema declares with
    a default equals that of transformers' config class, where transformers has the key (the
    others are keys only vLLM reads, or that transformers derives: moe_layer_freq, ...)."""
    theirs = _transformers_text_config(model_type)
    compared = 0
    for name, field in FAMILIES[model_type].schema.model_fields.items():
        ours = field.get_default(call_default_factory=True)
        if _SIZE not in field.metadata or not ours:
            continue
        keys = [k for k in field_names(name, field.validation_alias) if k in theirs]
        if keys:
            assert theirs[keys[0]] == ours, (name, theirs[keys[0]], ours)
            compared += 1
    assert compared >= 5


def test_a_size_left_out_is_costed_at_the_default_and_named() -> None:
    config = {k: v for k, v in TINY_LLAMA.items() if k != "num_hidden_layers"}
    spec = model_spec_from_config(config)
    layers = _transformers_text_config("llama")["num_hidden_layers"]
    assert spec.num_layers == layers == 32
    assert spec.config_defaults == ("num_hidden_layers=32",)
    assert spec.notes == (
        "model: config.json does not set num_hidden_layers; costed at transformers' llama "
        "defaults (32), as vLLM loads it; set them if the checkpoint differs",
    )


def test_a_complete_config_has_no_note_and_a_default_of_none_is_no_size() -> None:
    assert model_spec_from_config(TINY_LLAMA).config_defaults == ()
    assert load_model("qwen3-8b").notes == ()
    # Qwen3.5-MoE has no dense FFN: its intermediate_size defaults to 0, which is no assumption
    qwen35 = load_model("qwen3.5-397b-a17b")
    assert not any(d.startswith("intermediate_size") for d in qwen35.config_defaults)
    # Gemma 3's released text config relies on transformers for its vocabulary; its layer
    # pattern is no size (layer_types, where given, decides it)
    gemma = load_model("gemma-3-27b").config_defaults
    assert gemma == ("vocab_size=262208", "max_position_embeddings=131072")
    # an expert count is named by both its spellings, either of which a config may use
    mixtral = dict(TINY_LLAMA, model_type="mixtral", num_key_value_heads=4)
    assert "num_experts/num_local_experts=8" in model_spec_from_config(mixtral).config_defaults


def test_estimate_says_which_sizes_it_assumed(tmp_path) -> None:
    config = {k: v for k, v in TINY_LLAMA.items() if k not in ("vocab_size", "hidden_size")}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = ["estimate", str(path), "--gpu", "h100", "--batch", "8", "--context", "256"]
    text = run_cli(*args).stdout
    note = "model: config.json does not set hidden_size, vocab_size; costed at transformers' "
    assert note + "llama defaults (4096, 32000)" in text
    doc = json.loads(run_cli(*args, "--json").stdout)
    assert doc["config_defaults"] == ["hidden_size=4096", "vocab_size=32000"]
    serving = ["estimate", str(path), "--gpu", "h100", "--isl", "64", "--osl", "8"]
    doc = json.loads(run_cli(*serving, "--concurrency", "2", "--json").stdout)
    assert doc["config_defaults"] == ["hidden_size=4096", "vocab_size=32000"]
    assert any(a.startswith(note) for a in doc["assumptions"])
