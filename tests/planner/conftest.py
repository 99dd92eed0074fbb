"""Synthetic devices and profiles for planner tests."""

from __future__ import annotations

import numpy as np
import pytest

from opweave.costmodel import (
    HardwareSpec,
    ModelSpec,
    OpLatencyTable,
    Profile,
    Provenance,
    model_spec_from_config,
    profile_key,
)
from tests.helpers import TINY_LLAMA

TINY_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


def toy_gpu(gpu_id: str, **fields: object) -> HardwareSpec:
    base: dict[str, object] = dict(
        id=gpu_id,
        name=gpu_id,
        memory_bytes=1e9,
        mem_bandwidth_bytes_per_s=1e12,
        dense_flops_per_s=1e14,
        intra_node_bandwidth_bytes_per_s=1e11,
        network_bandwidth_bytes_per_s=1e10,
        usd_per_hour=2.0,
        gpus_per_node=2,
        kernel_overhead_s=1e-6,
        usable_memory_fraction=1.0,
    )
    if gpu_id == "cpu":  # as the profiler records a CPU device: its loop is orchestration's
        base["step_overhead_s"] = 0.0
    base.update(fields)
    return HardwareSpec(**base)  # type: ignore[arg-type]


def random_profile(
    rng: np.random.Generator,
    model: ModelSpec,
    device: HardwareSpec,
    *,
    tps: tuple[int, ...] = (1, 2),
    batches: tuple[int, ...] = (1, 2, 4, 8),
    contexts: tuple[int, ...] = (8, 256),
) -> Profile:
    """Latencies that grow with batch on average but are noisy (not monotone)."""
    keys = sorted(
        {profile_key(op, None) for op in (*model.pre_ops, *model.post_ops)}
        | {profile_key(op, layer) for layer in model.layers for op in layer.ops}
    )
    tables = []
    for key in keys:
        base = float(rng.uniform(2e-6, 4e-5))
        for tp in tps:
            lat = [
                [
                    base
                    / tp**0.7
                    * (1 + 0.4 * b**0.5)
                    * (1 + c / 512)
                    * float(rng.uniform(0.6, 1.4))
                    for c in contexts
                ]
                for b in batches
            ]
            tables.append(
                OpLatencyTable(
                    op=key,
                    tp=tp,
                    batches=batches,
                    contexts=contexts,
                    latency_s=tuple(tuple(r) for r in lat),
                )
            )
    return Profile(
        device=device,
        model=model.name,
        config_sha256=model.config_sha256,
        dtype=model.dtype,
        ops=tuple(tables),
        provenance=Provenance(source="measured", device_name=device.name, date="2026-01-01"),
    )


@pytest.fixture(scope="session")
def tiny_llama() -> ModelSpec:
    return model_spec_from_config(TINY_LLAMA, name="tiny-llama")


@pytest.fixture(scope="session")
def tiny_moe() -> ModelSpec:
    return model_spec_from_config(TINY_MOE, name="tiny-moe")


# A DeepSeek-V3-shaped model small enough to enumerate: MLA, one dense layer before the MoE
# block (the partition block's irregular prefix), shared + group-limited routed experts.
TINY_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 8,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="session")
def tiny_deepseek() -> ModelSpec:
    return model_spec_from_config(TINY_DEEPSEEK, name="tiny-deepseek")
