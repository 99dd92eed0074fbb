"""The tiny model writer: loadable offline, features present, nothing left at identity init."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from opweave.runtime import TINY_CONFIGS, LocalModel, model_spec, write_tiny_model


def parse_config(folder):
    return model_spec(folder).arch


def test_tokenizer_loads_offline(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
    assert tok("t5 t6 t300").input_ids == [5, 6, 300]
    assert tok.decode([5, 6]) == "t5 t6"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_tiny_models_are_small_and_load(family, tiny_model):
    model_dir = tiny_model(family)
    spec = parse_config(model_dir)
    assert (
        64 <= spec.hidden_size <= 128
        and 2 <= spec.num_layers <= 4
        and 512 <= spec.vocab_size <= 1024
    )
    assert (model_dir / "model.safetensors").stat().st_size < 8 * 2**20


def test_feature_mix_of_tiny_configs(tiny_model):
    gemma = parse_config(tiny_model("gemma3_text"))
    assert (
        set(gemma.layer_types) == {"sliding_attention", "full_attention"}
        and gemma.sliding_window == 8
    )
    nxt = parse_config(tiny_model("qwen3_next"))
    assert nxt.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert nxt.linear_attn.k_head_dim in (64, 128) and nxt.linear_attn.v_head_dim in (64, 128)
    moe = parse_config(tiny_model("qwen3_moe"))
    assert sorted(moe.moe_layers) == [1, 2]


@pytest.mark.parametrize(
    ("family", "identity"), [("llama", 1.0), ("gemma3_text", 0.0), ("qwen3_next", 0.0)]
)
def test_norm_weights_are_randomised(family, identity, tiny_model):
    with safe_open(tiny_model(family) / "model.safetensors", framework="pt") as f:
        names = f.keys()
        norms = [f.get_tensor(k) for k in names if "norm" in k]
    assert norms and all((w - identity).abs().mean() > 0.05 for w in norms)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_bfloat16_model_computes_in_bfloat16_and_stays_exact(family, tmp_path, hf_greedy, prompts):
    model_dir = write_tiny_model(family, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    model = LocalModel(model_dir)
    assert all(op.dtype == torch.bfloat16 for op in model.module.operators)
    assert model.generate(prompts, 12) == hf_greedy(model_dir, prompts, 12)


def test_tool_writes_a_loadable_model(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from opweave.runtime import LocalModel

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "tiny"
    subprocess.run(
        [
            sys.executable,
            str(root / "tools/write_tiny_model.py"),
            "llama",
            str(out),
            "--set",
            "num_hidden_layers=3",
        ],
        check=True,
        capture_output=True,
    )
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    assert len(LocalModel(out).generate([[1, 2, 3]], 4)[0]) == 4
